"""`GET /v1/workers/{id}/lifeline`: one request each worker holds open for as long as its process lives.

When a worker process dies, even by SIGKILL, its kernel closes the connection at once; the controller sees
the close and, unless the worker opens a new one within the reconnect grace, re-queues its tasks without
waiting three heartbeats (`Service.lifeline_closed`). A byte every `PING_S` keeps proxies from closing the
connection as idle and lets the worker notice a controller that went away.

Only a close by the worker counts. When the controller itself stops, the stream ends cleanly (or is
cancelled by the server), and nobody is judged; a controller that restarts knows of no connection, so it
judges nobody by one either: its workers simply reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from fastapi import APIRouter
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from turnout.api.service import Service
from turnout.auth import WorkerCredential
from turnout.errors import NotFound, Unauthorized
from turnout.models import WorkerState

PING_S = 5.0


class LifelineResponse(Response):
    """A response that never ends on its own: a ping byte every `PING_S` until the client or the server goes."""

    def __init__(self, service: Service, worker_id: str, token_id: str, ping_s: float = PING_S) -> None:
        self.status_code = 200
        self.background = None
        # no Content-Length: the body has no end (Response.__init__ would declare an empty one)
        self.raw_headers = [(b"content-type", b"application/octet-stream"), (b"cache-control", b"no-cache")]
        self.service = service
        self.worker_id = worker_id
        self.token_id = token_id  # the token the worker registered with: revoked, the stream ends
        self.ping_s = ping_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.service.lifeline_opened(self.worker_id)
        by_peer = revoked = False
        waiters: list[asyncio.Future[Any]] = []
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            pinger = asyncio.ensure_future(self._ping(send))
            gone = asyncio.ensure_future(_disconnected(receive))
            waiters = [pinger, gone, asyncio.ensure_future(self.service.closing.wait())]
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            failed = pinger.exception() if pinger.done() else None
            revoked = isinstance(failed, Unauthorized)
            by_peer = gone.done() or (failed is not None and not revoked)
        finally:  # cancelled (the server stopping hard) counts as nobody's close
            for waiter in waiters:
                waiter.cancel()
            # a revoked worker's tasks go back to the queue as a vanished one's do
            self.service.lifeline_closed(self.worker_id, by_peer=by_peer or revoked)
        if not by_peer:
            with contextlib.suppress(Exception):  # the controller is stopping: end the stream cleanly
                await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _ping(self, send: Send) -> None:
        """Ping until the worker's token is revoked: the stream then ends, and its tasks go back to the queue
        after the grace, as a worker's that went away (a reopen hears the 401)."""
        while True:
            await send({"type": "http.response.body", "body": b".", "more_body": True})
            await asyncio.sleep(self.ping_s)
            await self.service.still_valid(self.token_id)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def router(service: Service, worker_role: Any) -> APIRouter:
    """The route, guarded by the same dependency as the rest of the worker protocol (`worker_role`)."""
    api = APIRouter()

    @api.get("/v1/workers/{worker_id}/lifeline")
    async def lifeline(worker_id: str, me: WorkerCredential = worker_role) -> Response:
        worker = await service.read(service.controller.find_worker, worker_id)
        if worker is None or worker.state is WorkerState.GONE:
            raise NotFound(f"worker {worker_id} not found; register again", field="worker")
        # Opening one is a sign of life, stored like a heartbeat: where several controllers share the
        # database, the one that saw the old connection close then knows the worker came back elsewhere.
        await service.heartbeat(worker_id, metrics=None, quarantined=None)
        return LifelineResponse(service, worker_id, me.token_id)

    return api
