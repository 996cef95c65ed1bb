"""The worker's end of the channel (api/channel.py): its leases and reports over one WebSocket it holds.

A call is a frame `b"<seq> <call>\\n<body>"` and its answer `b"<seq> <status>\\n<body>"`, matched by `seq`, so a
long poll and the reports that pass it share the connection. The channel is a faster road, never the only
one: `ChannelUnavailable` says nothing was sent (no connection could be opened, or it had closed before the
frame went), and the caller sends the same request over HTTP. A request sent whose answer never came (the
connection dropped, or no answer within its time) raises an `httpx.TransportError`, exactly as the HTTP
request would, so the caller's retries treat it the same. After a failure to open, HTTP carries everything
for a while (backing off from FIRST_RETRY_S to MAX_RETRY_S) before the channel is tried again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import ssl
from dataclasses import dataclass, field

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, WebSocketException

log = logging.getLogger("turnout.worker")

OPEN_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 1.0  # closing is a courtesy: a worker leaving never waits long on a controller gone quiet
FIRST_RETRY_S = 1.0
MAX_RETRY_S = 30.0


class ChannelUnavailable(Exception):
    """Nothing was sent: send the request over HTTP."""


@dataclass
class _Open:
    """One open connection, and the calls waiting for its answers."""

    conn: ClientConnection
    waiting: dict[int, asyncio.Future[tuple[int, bytes]]] = field(default_factory=dict)
    reader: asyncio.Task[None] | None = None

    def fail_waiting(self, why: str) -> None:
        for answer in self.waiting.values():
            if not answer.done():
                answer.set_exception(httpx.ReadError(why))
        self.waiting.clear()


class Channel:
    """One WebSocket to `url` (ws:// or wss://), opened on the first call and again after it breaks."""

    def __init__(self, url: str, headers: dict[str, str], tls: ssl.SSLContext | None) -> None:
        self.url = url
        self.headers = headers
        self.tls = tls if url.startswith("wss://") else None
        self._open_now: _Open | None = None
        self._opening = asyncio.Lock()
        self._seq = itertools.count(1)
        self._retry_at = 0.0
        self._retry_s = FIRST_RETRY_S

    async def call(self, call: str, body: bytes, timeout_s: float) -> tuple[int, bytes]:
        """The controller's status and answer to `call` with `body`; raises ChannelUnavailable when nothing
        was sent, an httpx.TransportError when the answer was lost."""
        opened = await self._open()
        seq = next(self._seq)
        answer = asyncio.get_running_loop().create_future()
        opened.waiting[seq] = answer
        try:
            try:
                await opened.conn.send(b"%d %s\n%s" % (seq, call.encode(), body))
            except ConnectionClosed:
                raise ChannelUnavailable("the channel closed before the request went") from None
            try:
                return await asyncio.wait_for(answer, timeout_s)
            except asyncio.TimeoutError:
                raise httpx.ReadTimeout(f"no answer to {call} on the channel in {timeout_s:g} s") from None
        finally:
            opened.waiting.pop(seq, None)

    async def close(self) -> None:
        opened, self._open_now = self._open_now, None
        if opened is not None:
            if opened.reader is not None:
                opened.reader.cancel()
            await opened.conn.close()
            opened.fail_waiting("the channel was closed")

    async def _open(self) -> _Open:
        if self._open_now is not None:
            return self._open_now
        async with self._opening:
            if self._open_now is not None:
                return self._open_now
            loop = asyncio.get_running_loop()
            if loop.time() < self._retry_at:
                raise ChannelUnavailable("the channel is resting after a failure")
            try:
                conn = await connect(self.url, additional_headers=self.headers, ssl=self.tls,
                                     compression=None, max_size=None, open_timeout=OPEN_TIMEOUT_S,
                                     close_timeout=CLOSE_TIMEOUT_S, user_agent_header="turnout-worker")  # fmt: skip
            except (OSError, WebSocketException, asyncio.TimeoutError) as exc:
                log.info("no channel to the controller (%s: %s); HTTP for %.0f s", type(exc).__name__, exc,
                         self._retry_s)  # fmt: skip
                self._retry_at = loop.time() + self._retry_s
                self._retry_s = min(self._retry_s * 2, MAX_RETRY_S)
                raise ChannelUnavailable(str(exc)) from None
            self._retry_s = FIRST_RETRY_S
            opened = _Open(conn)
            opened.reader = asyncio.ensure_future(self._read(opened))
            self._open_now = opened
            return opened

    async def _read(self, opened: _Open) -> None:
        """Hand each answer to its caller until the connection ends; then fail the calls still waiting."""
        try:
            async for frame in opened.conn:
                head, _, body = (frame.encode() if isinstance(frame, str) else frame).partition(b"\n")
                seq, _, status = head.partition(b" ")
                answer = opened.waiting.get(int(seq))
                if answer is not None and not answer.done():
                    answer.set_result((int(status), body))
        except ConnectionClosed:
            pass
        except ValueError as exc:  # not an answer as api/channel.py writes them: this is no channel of ours
            log.warning("the channel answered a frame it should not (%s); closing it", exc)
            await opened.conn.close()
        finally:
            if self._open_now is opened:
                self._open_now = None
                self._retry_at = asyncio.get_running_loop().time() + FIRST_RETRY_S
            opened.fail_waiting("the channel to the controller closed before the answer came")
