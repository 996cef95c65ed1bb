"""A worker's report answered without FastAPI's per-request machinery, when it could be answered no other way.

`POST /v1/workers/{id}/complete` comes once per finished task (or batch of them) from every worker. Routing
through the included routers, solving the worker check as a dependency, and building the request and the
response objects took about as much of the controller's event loop as the exchange itself. `WorkerFastPath`
answers it directly, with the route's own answer (`protocol.WorkerRoutes.complete`), when the caller is
plainly that worker: a token already verified (the token cache), the worker's credential cached, its secret
matching, a JSON body that the route's model validates. Anything else (an unknown token, a wrong secret, a
body the model refuses, another content type) goes on to the route with the body replayed, so every refusal
is the route's own, word for word. Limits stay with the middleware around this one (`BodyLimit`).
"""

from __future__ import annotations

import re

import pydantic
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from turnout.access import ANONYMOUS_OPERATOR, Action, allow
from turnout.api.errors import error_response, unexpected_response
from turnout.api.protocol import CompleteAnswer
from turnout.api.schemas import CompleteIn
from turnout.api.service import Service
from turnout.api.strictjson import strict_loads
from turnout.auth import WorkerCredential
from turnout.auth import check as check_worker
from turnout.errors import TurnoutError

REPORT = re.compile(r"/v1/workers/([A-Za-z0-9_]{1,64})/complete")


class WorkerFastPath:
    """ASGI middleware: the route's answer to a plain `complete` report, or the route itself when unsure."""

    def __init__(self, app: ASGIApp, service: Service, complete: CompleteAnswer) -> None:
        self.app = app
        self.service = service
        self.complete = complete

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = (
            REPORT.fullmatch(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        )
        me = self._worker(scope, found.group(1)) if found is not None else None
        if found is None or me is None or scope.get("query_string") or not _json_content(scope):
            await self.app(scope, receive, send)
            return
        body = await _read(receive)
        if body is None:
            return  # the client left (or BodyLimit refused the body and answered): nothing to say
        try:
            report = CompleteIn.model_validate(strict_loads(body))
        except (TurnoutError, pydantic.ValidationError, ValueError):
            await self.app(scope, _replay(body, receive), send)  # the route says what is wrong, as always
            return
        response: Response
        try:
            response = await self.complete(found.group(1), report, me)
        except TurnoutError as exc:
            response = error_response(exc)
        except Exception as exc:
            response = unexpected_response(exc)
        await response(scope, receive, send)

    def _worker(self, scope: Scope, worker_id: str) -> WorkerCredential | None:
        """The caller's credential when it is plainly the worker `worker_id` by what is cached; else None."""
        headers = dict(scope["headers"])
        service = self.service
        try:
            if service.auth:
                token = headers.get(b"authorization")
                principal = service.tokens.cached(token.decode("latin-1")) if token is not None else None
            else:
                principal = ANONYMOUS_OPERATOR
            cred = service.workers.cached(worker_id)
            if principal is None or cred is None:
                return None
            secret = headers.get(b"x-worker-secret")
            return check_worker(
                cred, allow(principal, Action.WORKER), secret.decode("latin-1") if secret else None
            )
        except TurnoutError:
            return None  # the route refuses it, in its own words


def _json_content(scope: Scope) -> bool:
    kind = next((v for k, v in scope["headers"] if k == b"content-type"), b"application/json")
    return kind.split(b";", 1)[0].strip().lower() == b"application/json"


async def _read(receive: Receive) -> bytes | None:
    """The whole request body; None if the client disconnected first."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives `body` once, then what the connection says (a disconnect, in time)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
