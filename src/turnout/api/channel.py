"""`GET /v1/workers/{id}/channel`, a WebSocket: the worker protocol's calls over one connection the worker holds.

One call over HTTP costs a Python worker's httpx client about 1.5 ms of CPU and the controller about 1 ms;
over a held WebSocket about 0.2 ms and 0.8 ms (`python -m bench --only channel`). So a worker sends its leases
and reports here, each framed as

    request:  b"<seq> <call>\\n" + the JSON body of `POST /v1/workers/{id}/<call>`   (lease, complete, events, scrubs)
    answer:   b"<seq> <status>\\n" + that route's JSON answer

and the controller answers each as that HTTP request, made with the headers the connection opened with: the
same middleware, fast path, checks, limits and answers, word for word, so nothing of the protocol differs but
its framing. Answers go as they are ready, not in order (a long poll waits while reports pass it); a
connection has at most MAX_IN_FLIGHT requests under way, and reads no more until one is answered.

Only the worker in the path opens one (its token and secret, as for any worker route; anyone else's upgrade
is refused with a 403), and each request is checked again as its route checks it, so a revoked token stops
the very next request. When the connection closes, its unanswered requests are cancelled: the worker takes
an answer lost that way as any lost answer (a report is sent again; tasks a lost lease gave it go back to the
queue, since it never lists them as running).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from starlette.routing import WebSocketRoute
from starlette.types import ASGIApp, Message
from starlette.websockets import WebSocket, WebSocketDisconnect

from turnout.access import WORKER_SECRET_HEADER
from turnout.api.errors import error_response, unexpected_response
from turnout.api.guards import Guards
from turnout.api.metrics import Metrics
from turnout.errors import NotFound, TurnoutError

PATH = "/v1/workers/{worker_id}/channel"
CALLS = frozenset({"lease", "complete", "events", "scrubs"})
MAX_IN_FLIGHT = 16
HEAD = re.compile(rb"(\d{1,18}) ([a-z]{1,16})")
POLICY_VIOLATION = 1008  # WebSocket close codes (RFC 6455): before the accept, uvicorn answers it as a 403
PROTOCOL_ERROR = 1002
NO_ANSWER = b'{"error":{"type":"internal","message":"the controller gave no answer"}}'
KEPT_HEADERS = (b"authorization", WORKER_SECRET_HEADER.lower().encode())


def route(app: ASGIApp, guards: Guards, metrics: Metrics) -> WebSocketRoute:
    """The channel's route: each request on it is answered by `app` (the whole application) as HTTP."""

    async def channel(ws: WebSocket) -> None:
        worker_id: str = ws.path_params["worker_id"]
        try:
            await guards.worker_of(worker_id, ws.headers.get("authorization"),
                                   ws.headers.get(WORKER_SECRET_HEADER))  # fmt: skip
        except TurnoutError:  # refused before the accept: the worker sees a 403 (its HTTP call says why)
            await ws.close(code=POLICY_VIOLATION)
            return
        await ws.accept()
        metrics.channels_open.inc()
        try:
            await _Channel(app, ws, worker_id, metrics).serve()
        finally:
            metrics.channels_open.dec()

    return WebSocketRoute(PATH, channel)


class _Channel:
    """One worker's open channel: its requests under way, and the one writer of its answers."""

    def __init__(self, app: ASGIApp, ws: WebSocket, worker_id: str, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics
        self.ws = ws
        self.worker_id = worker_id
        self.headers = [(k, v) for k, v in ws.scope["headers"] if k in KEPT_HEADERS]
        self.closed = asyncio.Event()
        self.slots = asyncio.Semaphore(MAX_IN_FLIGHT)
        self.under_way: set[asyncio.Task[None]] = set()
        self.writing = asyncio.Lock()

    async def serve(self) -> None:
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                frame: bytes | None = message.get("bytes")
                head, newline, body = frame.partition(b"\n") if frame is not None else (b"", b"", b"")
                found = HEAD.fullmatch(head)
                if not newline or found is None:
                    await self.ws.close(code=PROTOCOL_ERROR, reason="frames are b'<seq> <call>\\n<body>'")
                    return
                await self.slots.acquire()
                task = asyncio.ensure_future(self._answer(found.group(1), found.group(2).decode(), body))
                self.under_way.add(task)
                task.add_done_callback(self.under_way.discard)
        except WebSocketDisconnect:
            return
        finally:
            self.closed.set()
            for task in list(self.under_way):
                task.cancel()

    async def _answer(self, seq: bytes, call: str, body: bytes) -> None:
        try:
            if call in CALLS:
                self.metrics.channel_requests.labels(call).inc()
                status, answer = await self._request(call, body)
            else:
                refusal = error_response(NotFound(f"no call {call!r} on the channel; calls: {sorted(CALLS)}",
                                                  field="call"))  # fmt: skip
                status, answer = refusal.status_code, bytes(refusal.body)
            async with self.writing:
                await self.ws.send_bytes(b"%s %d\n%s" % (seq, status, answer))
        except (OSError, RuntimeError, WebSocketDisconnect):
            pass  # the worker went: its request is answered as any lost answer is
        finally:
            self.slots.release()

    async def _request(self, call: str, body: bytes) -> tuple[int, bytes]:
        """`POST /v1/workers/{id}/<call>` with `body`, through the whole application: its status and body."""
        base = self.ws.scope
        path = f"/v1/workers/{self.worker_id}/{call}"
        headers = [*self.headers, (b"content-type", b"application/json"),
                   (b"content-length", b"%d" % len(body))]  # fmt: skip
        scope: dict[str, Any] = {
            "type": "http", "asgi": base.get("asgi", {"version": "3.0"}), "http_version": "1.1",
            "method": "POST", "scheme": "https" if base.get("scheme") == "wss" else "http", "path": path,
            "raw_path": path.encode(), "root_path": base.get("root_path", ""), "query_string": b"",
            "headers": headers, "client": base.get("client"), "server": base.get("server"),
            "state": dict(base.get("state") or {}),
        }  # fmt: skip
        given = False
        status: int | None = None
        chunks: list[bytes] = []

        async def receive() -> Message:
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            await self.closed.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        try:
            await self.app(scope, receive, send)
        except Exception as exc:  # the server's error middleware has answered it (a 500), and logged it
            if status is None:
                failed = unexpected_response(exc)
                return failed.status_code, bytes(failed.body)
        if status is None:  # an application that ends without an answer: as uvicorn answers it
            return 500, NO_ANSWER
        return status, b"".join(chunks)
