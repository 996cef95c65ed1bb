"""The application: middleware, error mapping, lifespan, and one router per resource.

Each router (api/tasks.py, api/protocol.py, ...) checks the caller with the app's `Guards`, translates the
wire format (api/schemas.py), and calls the controller through the service (api/service.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from turnout import __version__
from turnout.api import (
    audit,
    capabilities,
    channel,
    dashboard,
    docs,
    errors,
    files,
    lifeline,
    pipelines,
    protocol,
    tasks,
    tokens,
    workers,
)
from turnout.api import metrics as prometheus
from turnout.api.errors import error_response
from turnout.api.fastpath import FastPath
from turnout.api.gate import SubmitGate
from turnout.api.guards import Guards
from turnout.api.limits import BodyLimit
from turnout.api.service import Service
from turnout.api.strictjson import StrictJsonRoute
from turnout.errors import Unauthorized
from turnout.escalation import Escalator


class Api(FastAPI):
    """FastAPI with the door in front of its own middleware: every HTTP request meets the rate gate, the body
    limit and the fast path (in that order) before FastAPI's and Starlette's layers (error pages, telemetry,
    their body limit), so a plain report, lease, submission or result wait skips those layers, which it does
    not need (the fast path renders its own errors as the app's handlers do). Everything else goes on through
    the whole application, as before; the WebSocket channel and the lifespan go straight to it."""

    front: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan" and (twice := _credential_twice(scope["headers"])) is not None:
            await _refuse_ambiguous(twice, scope, receive, send)
        elif self.front is not None and scope["type"] == "http":
            await self.front(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    async def whole(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The application behind the door."""
        await super().__call__(scope, receive, send)


CREDENTIALS = (b"authorization", b"x-worker-secret")


def _credential_twice(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The credential header a request carries more than once, if any. Each layer that reads one (the fast
    path, the routes, the gate, a proxy in front) might take another of the copies, so a caller would be one
    principal to one of them and another to the next: such a request is refused before any of them sees it."""
    seen: list[bytes] = []
    for name, _ in headers:  # ASGI names headers in lower case
        if name in CREDENTIALS:
            if name in seen:
                return name
            seen.append(name)
    return None


async def _refuse_ambiguous(name: bytes, scope: Scope, receive: Receive, send: Send) -> None:
    """A 401 naming the header sent twice (a WebSocket is closed before it opens: a 403 to the client)."""
    said = name.decode("latin-1")
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008, "reason": f"more than one {said} header"})
        return
    refusal = Unauthorized(f"{said}: sent more than once; send exactly one", field=said)
    await error_response(refusal)(scope, receive, send)


def create_app(service: Service) -> Api:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await service.start()
        escalator = Escalator(service) if service.controller.settings.escalation else None  # escalation.py
        if escalator:
            await escalator.start()
        try:
            yield
        finally:
            if escalator:
                await escalator.stop()
            await service.stop()

    # the API docs are served by api/docs.py, behind a token (they describe every route, worker protocol included)
    app = Api(title="Turnout", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)  # fmt: skip
    app.router.route_class = StrictJsonRoute  # every JSON body is parsed strictly (api/strictjson.py)
    errors.install(app)
    settings = service.controller.settings
    guards = Guards(service)
    metrics = prometheus.Metrics(service.controller)
    worker_routes = protocol.router(service, guards, metrics)
    task_routes = tasks.router(service, guards)
    pipeline_routes = pipelines.router(service, guards)
    # inside the limits: reports, single submissions, result waits and run starts answered without FastAPI's
    # machinery when plain; outermost, the gate: 429 over the rate, body unread
    fast = FastPath(app.whole, service=service, complete=worker_routes.complete, lease=worker_routes.lease,
                    events=worker_routes.events,
                    submit=task_routes.submit, start_run=pipeline_routes.start, result=task_routes.result)  # fmt: skip
    app.front = SubmitGate(BodyLimit(fast, limits=settings.request_limits), service=service)

    # in this order: the OpenAPI document lists the routes as they are included
    app.include_router(docs.router(app, guards))
    app.include_router(prometheus.router(service, metrics))  # /healthz and /metrics: open to anyone
    app.include_router(task_routes.router)
    app.include_router(capabilities.router(service, guards))
    app.include_router(workers.router(service, guards))
    app.include_router(worker_routes.router)
    app.include_router(tokens.router(service, guards))
    app.include_router(audit.router(service, guards))
    app.include_router(lifeline.router(service, guards.this_worker()))  # held by the worker as it heartbeats
    # the worker's leases and reports over a WebSocket, each answered as its HTTP request by the app
    app.router.routes.append(channel.route(app, guards, metrics))
    app.include_router(dashboard.router(service, guards))
    app.mount("/static", dashboard.static_files(), name="static")
    app.include_router(pipeline_routes.router)
    if settings.storage_dir is not None:  # a controller built without storage (some tests) has no files
        app.include_router(files.router(service, guards))
    return app
