"""The hot routes answered without FastAPI's per-request machinery, when they could be answered no other way.

A worker's report (`POST /v1/workers/{id}/complete`, once per finished task or batch from every worker) and a
single submission (`POST /v1/tasks`, once per task from every client submitting one at a time). Routing through
the included routers, solving the caller's check as a dependency, and building the request and the response
objects took about as much of the controller's event loop as the work itself. `FastPath` answers them
directly, with the routes' own answers (`protocol.WorkerRoutes.complete`, `tasks.TaskRoutes.submit`), when the
caller is plainly allowed by what is cached (a token already verified; for a report, the worker's credential
and its secret) and the body is JSON that the route's model validates. Anything else (an unknown token, a wrong
secret, a role that may not, a body the model refuses, another content type, a query string) goes on to the
route with the body replayed, so every refusal is the route's own, word for word. An error the answer raises
is rendered as the app's handlers render it. Limits stay with the middleware around this one (`BodyLimit`,
`SubmitGate`).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pydantic
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from turnout.access import ANONYMOUS_OPERATOR, Action, Principal, allow
from turnout.api.errors import error_response, unexpected_response
from turnout.api.protocol import CompleteAnswer
from turnout.api.schemas import CompleteIn, TaskIn
from turnout.api.service import Service
from turnout.api.strictjson import strict_loads
from turnout.api.tasks import SubmitAnswer
from turnout.auth import WorkerCredential
from turnout.auth import check as check_worker
from turnout.errors import TurnoutError

REPORT = re.compile(r"/v1/workers/([A-Za-z0-9_]{1,64})/complete")
SUBMIT = re.compile(r"/v1/tasks")


@dataclass(frozen=True)
class _Route:
    """One hot route: its path, who may call it as far as the caches tell (None: unsure), its body's model,
    and its answer."""

    path: re.Pattern[str]
    caller: Callable[[dict[bytes, bytes], re.Match[str]], Any | None]
    model: type[pydantic.BaseModel]
    answer: Callable[[re.Match[str], Any, Any], Awaitable[Response]]


class FastPath:
    """ASGI middleware: a hot route's own answer to a plain request, or the route itself when unsure."""

    def __init__(
        self, app: ASGIApp, service: Service, complete: CompleteAnswer, submit: SubmitAnswer
    ) -> None:
        self.app = app
        self.service = service
        self.routes = (
            _Route(
                REPORT, self._worker, CompleteIn, lambda found, body, me: complete(found.group(1), body, me)
            ),
            _Route(SUBMIT, self._submitter, TaskIn, lambda _, body, p: submit(body, p)),
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        plain = (scope["type"] == "http" and scope["method"] == "POST" and not scope.get("query_string")
                 and _json_content(scope))  # fmt: skip
        route, found = next(
            ((r, m) for r in self.routes if plain and (m := r.path.fullmatch(scope["path"]))), (None, None)
        )
        caller = route.caller(dict(scope["headers"]), found) if route and found else None
        if route is None or found is None or caller is None:
            await self.app(scope, receive, send)
            return
        body = await _read(receive)
        if body is None:
            return  # the client left (or BodyLimit refused the body and answered): nothing to say
        try:
            request = route.model.model_validate(strict_loads(body))
        except (TurnoutError, pydantic.ValidationError, ValueError):
            await self.app(scope, _replay(body, receive), send)  # the route says what is wrong, as always
            return
        response: Response
        try:
            response = await route.answer(found, request, caller)
        except TurnoutError as exc:
            response = error_response(exc)
        except Exception as exc:
            response = unexpected_response(exc)
        await response(scope, receive, send)

    def _principal(self, headers: dict[bytes, bytes]) -> Principal | None:
        """The caller, if its token is cached (or auth is off); None when only the route can tell."""
        if not self.service.auth:
            return ANONYMOUS_OPERATOR
        token = headers.get(b"authorization")
        return self.service.tokens.cached(token.decode("latin-1")) if token is not None else None

    def _worker(self, headers: dict[bytes, bytes], found: re.Match[str]) -> WorkerCredential | None:
        """The caller's credential when it is plainly the worker in the path by what is cached; else None."""
        try:
            principal = self._principal(headers)
            cred = self.service.workers.cached(found.group(1))
            if principal is None or cred is None:
                return None
            secret = headers.get(b"x-worker-secret")
            return check_worker(
                cred, allow(principal, Action.WORKER), secret.decode("latin-1") if secret else None
            )
        except TurnoutError:
            return None  # the route refuses it, in its own words

    def _submitter(self, headers: dict[bytes, bytes], _: re.Match[str]) -> Principal | None:
        """The caller when its cached token may submit; else None."""
        try:
            principal = self._principal(headers)
            return None if principal is None else allow(principal, Action.SUBMIT)
        except TurnoutError:
            return None


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
