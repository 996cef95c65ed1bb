"""The HTTP/1.1 transport under the SDK's and the worker's httpx clients: asyncio streams and httptools' parser.

httpx's own transport (httpcore over h11, both pure Python) was a fifth of a submit-to-result round trip on
loopback: 0.47 ms of 2.7 (the same requests, the same client, side by side). This one speaks HTTP/1.1 over
asyncio's streams and parses answers with httptools (llhttp, in C, the parser uvicorn serves the controller
with), behind httpx's one-method port, so everything above it is httpx as before: the client's API, its
errors, its timeouts, its decoding of compressed bodies. It keeps idle connections per origin for reuse, as
httpcore does (at most `MAX_IDLE` each, none older than `IDLE_S`, none the server has closed) and holds at
most `MAX_CONNECTIONS` open at once (a request past those waits its pool timeout, then `httpx.PoolTimeout`).

What it does not take goes to httpx's own transport (`fallback`): a HEAD request (whose answer has a length
and no body, which the parser cannot be told), a scheme other than http and https. Failures are httpx's:
`ConnectError`/`ConnectTimeout` (connecting or the TLS handshake), `WriteError`/`WriteTimeout`,
`ReadError`/`ReadTimeout`, `RemoteProtocolError` (a server that closes without answering, or answers
something that is not HTTP/1.x), `PoolTimeout`. A connection whose exchange did not end cleanly (an error, a
cancelled caller, a body left unread) is closed, never reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
import sys
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import httptools
import httpx

T = TypeVar("T")
MAX_CONNECTIONS = 100  # httpx's default limits
MAX_IDLE = 20
IDLE_S = 4.0  # under uvicorn's 5 s keep-alive: a connection is not reused as the server gives it up
READ_BYTES = 65536
MAX_HEAD_BYTES = 64 * 1024  # an answer's status line and headers; h11 stops at 16 KiB of an incomplete event
TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # a method or a header name (RFC 9110)
NOT_IN_VALUES = re.compile(rb"[\r\n\0]")  # what would end a header line early: a request smuggled in it
Origin = tuple[str, str, int]  # scheme, host, port
HTTP11 = {"http_version": b"HTTP/1.1"}


def _head(request: httpx.Request) -> bytes:
    """The request line and headers, refused (`httpx.LocalProtocolError`, as h11 refuses them) where a method,
    a header name or a value would let another line into the request."""
    method = request.method.encode("ascii", "replace")
    if not TOKEN.fullmatch(method):
        raise httpx.LocalProtocolError(f"illegal method {request.method!r}", request=request)
    lines = [b"%s %s HTTP/1.1" % (method, request.url.raw_path)]
    for name, value in request.headers.raw:
        if not TOKEN.fullmatch(name) or NOT_IN_VALUES.search(value):  # the value unsaid: it may be a secret
            said = name.decode("latin-1")
            raise httpx.LocalProtocolError(
                f"illegal header {said!r}: a line break in its value, or a character no header name holds",
                request=request,
            )
        lines.append(name + b": " + value)
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def _within(step: Awaitable[T], timeout_s: float | None) -> T:
    """`step`, limited to `timeout_s` (None: no limit); `asyncio.timeout` where there is one: no task per call."""
    if timeout_s is None:
        return await step
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout_s):
            return await step
    return await asyncio.wait_for(step, timeout_s)  # pragma: no cover (Python 3.10)


class _Answer:
    """httptools' callbacks for one response: its headers, the body parsed so far, whether it is complete, and
    whether the server keeps the connection open after it (asked as it completes: the parser resets after).
    Anything after the complete answer is a server out of step: kept out of it, and the connection not reused."""

    def __init__(self) -> None:
        self.parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.head_done = False
        self.head_bytes = 0  # read before the head was complete
        self.done = False
        self.interim = False
        self.keep_alive = False

    def on_message_begin(self) -> None:
        if self.done:
            self.keep_alive = False
        else:  # the first message, or the one after an interim answer (`100 Continue`), which is dropped
            self.headers, self.body = [], []

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.done:
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.parser is not None and not self.head_done:
            self.status = self.parser.get_status_code()
            self.interim = 100 <= self.status < 200  # informational: the answer is still to come
            self.head_done = not self.interim

    def on_body(self, chunk: bytes) -> None:
        if not self.done:
            self.body.append(chunk)

    def on_message_complete(self) -> None:
        if self.parser is not None and not self.done and not self.interim:
            self.done = True
            self.keep_alive = self.parser.should_keep_alive()
        self.interim = False

    def ends_at_close(self) -> bool:
        """An answer with neither a length nor chunks: its body is whatever comes until the server closes."""
        names = {name.lower() for name, _ in self.headers}
        return b"content-length" not in names and b"transfer-encoding" not in names


class _Connection:
    """One socket to an origin, used for one exchange at a time."""

    def __init__(self, origin: Origin, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.origin = origin
        self.reader = reader
        self.writer = writer
        self.idle_since = 0.0

    def usable(self, now: float) -> bool:
        """Fit for another exchange: not closed by either side, and not idle so long the server may be closing it."""
        return (
            now - self.idle_since < IDLE_S
            and not self.reader.at_eof()
            and not self.writer.is_closing()
            and self.reader.exception() is None
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()

    async def send(self, request: httpx.Request, head: bytes, timeout_s: float | None) -> None:
        try:
            if isinstance(request.stream, httpx.ByteStream):
                self.writer.write(head + request.content)
            else:  # a streamed body (an upload): as it comes, in chunks where the headers say so
                chunked = request.headers.get("transfer-encoding", "").lower() == "chunked"
                self.writer.write(head)
                async for part in request.stream:  # type: ignore[union-attr]
                    if part:
                        self.writer.write(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
                        await _within(self.writer.drain(), timeout_s)
                if chunked:
                    self.writer.write(b"0\r\n\r\n")
            if self.writer.transport.get_write_buffer_size():
                await _within(self.writer.drain(), timeout_s)
        except asyncio.TimeoutError:  # TimeoutError itself from 3.11
            raise httpx.WriteTimeout("timed out sending the request", request=request) from None
        except OSError as exc:
            raise httpx.WriteError(str(exc) or type(exc).__name__, request=request) from None

    async def read(self, answer: _Answer, request: httpx.Request, timeout_s: float | None) -> None:
        """Read once more and parse it; a closed connection ends an answer that ends at close, and is an error
        anywhere else."""
        try:
            data = await _within(self.reader.read(READ_BYTES), timeout_s)
        except asyncio.TimeoutError:  # TimeoutError itself from 3.11
            raise httpx.ReadTimeout("timed out waiting for the answer", request=request) from None
        except OSError as exc:
            raise httpx.ReadError(str(exc) or type(exc).__name__, request=request) from None
        if not data:
            if not answer.head_done:
                raise httpx.RemoteProtocolError(
                    "Server disconnected without sending a response.", request=request
                )
            if answer.ends_at_close():
                answer.done, answer.parser = True, None
                return
            raise httpx.RemoteProtocolError(
                "peer closed connection without sending complete message body", request=request
            )
        parser = answer.parser
        if parser is None:  # the answer is complete: nothing more of it to parse
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if not answer.done:
                raise httpx.RemoteProtocolError(f"not an HTTP/1.1 answer: {exc}", request=request) from None
            # garbage after a complete answer: the answer stands, the connection is not reused
            answer.keep_alive = False
        if not answer.head_done:
            answer.head_bytes += len(data)
            if answer.head_bytes > MAX_HEAD_BYTES:  # all read so far, and still no end of the head
                raise httpx.RemoteProtocolError(
                    f"the answer's headers run past {MAX_HEAD_BYTES // 1024} KiB", request=request
                )
        if answer.done:
            answer.parser = None  # no cycle (parser <-> answer) left for the collector


class LeanTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 for an httpx.AsyncClient; TLS with `context` (the client's trust, `tls.async_client`)."""

    def __init__(self, context: ssl.SSLContext, fallback: httpx.AsyncBaseTransport) -> None:
        self.context = context
        self.fallback = fallback
        self._idle: dict[Origin, list[_Connection]] = {}
        self._slots = asyncio.Semaphore(MAX_CONNECTIONS)
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if request.method == "HEAD" or url.scheme not in ("http", "https"):
            return await self.fallback.handle_async_request(request)
        if self._closed:
            raise RuntimeError("the transport is closed")  # as httpx's own says of a closed client
        head = _head(request)
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        # at the limit: wait as long as the pool timeout for a connection to come free
        if self._slots.locked():
            try:
                await _within(self._slots.acquire(), timeouts.get("pool"))
            except asyncio.TimeoutError:  # TimeoutError itself from 3.11
                raise httpx.PoolTimeout("no connection came free in time", request=request) from None
        else:
            await self._slots.acquire()
        conn: _Connection | None = None
        try:
            origin = (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))
            conn = self._reused(origin) or await self._connect(origin, request, timeouts.get("connect"))
            await conn.send(request, head, timeouts.get("write"))
            answer = _Answer()
            while not answer.head_done:
                await conn.read(answer, request, timeouts.get("read"))
            body = _Body(self, conn, answer, request, timeouts.get("read"))
        except BaseException:
            if conn is not None:
                conn.close()
            self._slots.release()
            raise
        if answer.done:  # the whole answer came with its head (nearly every API answer): no stream to keep
            body.finish()
            return httpx.Response(answer.status, headers=answer.headers, content=b"".join(answer.body),
                                  extensions=HTTP11)  # fmt: skip
        return httpx.Response(answer.status, headers=answer.headers, stream=body, extensions=HTTP11)

    def _reused(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.usable(now):
                return conn
            conn.close()
        return None

    async def _connect(self, origin: Origin, request: httpx.Request, timeout_s: float | None) -> _Connection:
        scheme, host, port = origin
        secure = scheme == "https"
        try:
            reader, writer = await _within(
                asyncio.open_connection(host, port, ssl=self.context if secure else None,
                                        server_hostname=host if secure else None, limit=READ_BYTES),
                timeout_s,
            )  # fmt: skip
        except asyncio.TimeoutError:  # TimeoutError itself from 3.11
            raise httpx.ConnectTimeout(f"timed out connecting to {host}:{port}", request=request) from None
        except OSError as exc:  # refused, unreachable, unknown host, a certificate not trusted (ssl.SSLError)
            raise httpx.ConnectError(str(exc) or type(exc).__name__, request=request) from None
        return _Connection(origin, reader, writer)

    def release(self, conn: _Connection, reusable: bool) -> None:
        """An exchange on `conn` ended: keep the connection for the next one where it may be, else close it."""
        self._slots.release()
        idle = self._idle.setdefault(conn.origin, [])
        if reusable and not self._closed and len(idle) < MAX_IDLE:
            conn.idle_since = time.monotonic()
            idle.append(conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
        await self.fallback.aclose()


class _Body(httpx.AsyncByteStream):
    """A response's body as it arrives; the connection goes back to the pool once the body is complete, and is
    closed if the body is closed before that."""

    def __init__(self, transport: LeanTransport, conn: _Connection, answer: _Answer, request: httpx.Request,
                 timeout_s: float | None) -> None:  # fmt: skip
        self.transport = transport
        self.conn: _Connection | None = conn
        self.answer = answer
        self.request = request
        self.timeout_s = timeout_s

    def finish(self) -> None:
        """The body is all here: hand the connection back (for reuse only where the server keeps it open)."""
        if self.conn is not None:
            conn, self.conn = self.conn, None
            self.transport.release(conn, self.answer.keep_alive and not conn.reader.at_eof())

    async def __aiter__(self) -> AsyncIterator[bytes]:
        answer = self.answer
        while True:
            if answer.body:
                chunks, answer.body = answer.body, []
                yield b"".join(chunks)
            if answer.done:
                self.finish()
                return
            if self.conn is None:  # closed by the reader while it was iterating
                return
            try:
                await self.conn.read(answer, self.request, self.timeout_s)
            except BaseException:
                self.abort()
                raise

    def abort(self) -> None:
        """The answer will not be read to its end: the connection is mid-answer, so it is closed."""
        if self.conn is not None:
            conn, self.conn = self.conn, None
            self.transport.release(conn, reusable=False)

    async def aclose(self) -> None:
        if self.answer.done:
            self.finish()
        else:
            self.abort()


def lean_transport(context: ssl.SSLContext) -> LeanTransport:
    """The transport `tls.async_client` gives its clients: this one, over httpx's own for what it leaves."""
    return LeanTransport(context, httpx.AsyncHTTPTransport(verify=context))


__all__ = ["LeanTransport", "lean_transport"]
