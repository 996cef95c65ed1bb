"""The hot routes answered without FastAPI's per-request machinery, when they could be answered no other way.

A worker's report (`POST /v1/workers/{id}/complete`, once per finished task or batch from every worker), its
lease poll (`POST /v1/workers/{id}/lease`, once per task that finds an idle worker) and its event batches
(`POST /v1/workers/{id}/events`, many a second from a chatty task), a single submission
(`POST /v1/tasks`, with or without `?wait=S`, once per task from every client submitting one at a time), the wait for its result
(`GET /v1/tasks/{id}/result`, with or without `?wait=S`: `TaskHandle.result()`) and a pipeline run's start
(`POST /v1/pipelines/{name}/runs`, with or without `?wait=S`). Routing through the included routers, solving
the caller's check as a dependency, and building the request and the response objects took about as much of
the controller's event loop as the work itself. `FastPath` answers them directly, with the routes' own
answers (`protocol.WorkerRoutes.complete`, `.lease` and `.events`, `tasks.TaskRoutes.submit` and `.result`,
`pipelines.PipelineRoutes.start`), when the caller is plainly allowed by what is cached (a token already
verified; for a worker's call, the worker's credential and its secret), the body is JSON that the route's
model (or parser) takes, and the query string is one the route takes, written plainly. Anything else (an unknown
token, a wrong secret, a role that may not, a body the model refuses, another content type, any other query
string) goes on to the route with the body replayed, so every refusal is the route's own, word for word. An
error the answer raises is rendered as the app's handlers render it. Limits stay with the middleware around
this one (`BodyLimit`, `SubmitGate`).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

import pydantic
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from turnout.access import ANONYMOUS_OPERATOR, Action, Principal, allow
from turnout.api.errors import error_response, unexpected_response
from turnout.api.pipelines import RunIn, StartAnswer
from turnout.api.protocol import CompleteAnswer, EventsAnswer, LeaseAnswer
from turnout.api.schemas import MAX_WAIT_S, CompleteIn, LeaseIn, TaskIn, parse_events
from turnout.api.service import Service
from turnout.api.strictjson import strict_loads
from turnout.api.tasks import ResultAnswer, SubmitAnswer
from turnout.auth import WorkerCredential
from turnout.auth import check as check_worker
from turnout.errors import TurnoutError

REPORT = re.compile(r"/v1/workers/([A-Za-z0-9_]{1,64})/complete")
LEASE = re.compile(r"/v1/workers/([A-Za-z0-9_]{1,64})/lease")
EVENTS = re.compile(r"/v1/workers/([A-Za-z0-9_]{1,64})/events")
SUBMIT = re.compile(r"/v1/tasks")
RESULT = re.compile(r"/v1/tasks/([A-Za-z0-9_]{1,64})/result")
START_RUN = re.compile(r"/v1/pipelines/([A-Za-z0-9_.-]{1,64})/runs")
PLAIN_SECONDS = re.compile(
    r"\d{1,4}(\.\d{1,6})?"
)  # `wait=` as a client writes it; any other form: the route's


Params = dict[str, Any]


@dataclass(frozen=True)
class _Route:
    """One hot route: its path, who may call it as far as the caches tell (None: unsure), its body's parser,
    its query parameters as far as plainly written (None: only the route can tell), and its answer."""

    path: re.Pattern[str]
    caller: Callable[[dict[bytes, bytes], re.Match[str]], Any | None]
    # the JSON body -> what the answer takes; raises what the route would refuse. None: a GET, no body read
    parse: Callable[[Any], Any] | None
    answer: Callable[[re.Match[str], Any, Any, Params], Awaitable[Response]]
    params: Callable[[bytes], Params | None] = lambda query: {} if not query else None

    @property
    def method(self) -> str:
        return "POST" if self.parse is not None else "GET"


class FastPath:
    """ASGI middleware: a hot route's own answer to a plain request, or the route itself when unsure."""

    def __init__(
        self,
        app: ASGIApp,
        service: Service,
        complete: CompleteAnswer,
        lease: LeaseAnswer,
        events: EventsAnswer,
        submit: SubmitAnswer,
        start_run: StartAnswer,
        result: ResultAnswer,
    ) -> None:
        self.app = app
        self.service = service
        limits = service.controller.settings.request_limits
        self.routes = (
            _Route(REPORT, self._worker, CompleteIn.model_validate,
                   lambda found, body, me, _: complete(found.group(1), body, me)),
            _Route(LEASE, self._worker, LeaseIn.model_validate,
                   lambda found, body, me, _: lease(found.group(1), body, me)),
            _Route(EVENTS, self._worker, lambda body: parse_events(body, limits),
                   lambda found, items, me, _: events(found.group(1), items, me)),
            _Route(SUBMIT, self._submitter, TaskIn.model_validate,
                   lambda _, body, p, q: submit(body, q["wait"], p), _wait_only),
            _Route(START_RUN, self._submitter, RunIn.model_validate,
                   lambda found, body, p, q: start_run(found.group(1), body, q["wait"], p), _wait_only),
            _Route(RESULT, self._reader, None, lambda found, _, p, q: result(found.group(1), q["wait"], p), _wait_only),
        )  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope.get("method")
        plain = scope["type"] == "http" and (method == "GET" or (method == "POST" and _json_content(scope)))
        route, found = next(
            (
                (r, m)
                for r in self.routes
                if plain and r.method == method and (m := r.path.fullmatch(scope["path"]))
            ),
            (None, None),
        )
        params = route.params(scope.get("query_string", b"")) if route else None
        caller = (
            route.caller(dict(scope["headers"]), found) if route and found and params is not None else None
        )
        if route is None or found is None or params is None or caller is None:
            await self.app(scope, receive, send)
            return
        request: Any = None
        if route.parse is not None:
            body = await _read(receive)
            if body is None:
                return  # the client left (or BodyLimit refused the body and answered): nothing to say
            try:
                request = route.parse(strict_loads(body))
            except (TurnoutError, pydantic.ValidationError, ValueError):
                await self.app(scope, _replay(body, receive), send)  # the route says what is wrong, as always
                return
        response: Response
        try:
            response = await route.answer(found, request, caller, params)
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
        return self._allowed(headers, Action.SUBMIT)

    def _reader(self, headers: dict[bytes, bytes], _: re.Match[str]) -> Principal | None:
        """The caller when its cached token may read; else None."""
        return self._allowed(headers, Action.READ)

    def _allowed(self, headers: dict[bytes, bytes], action: Action) -> Principal | None:
        try:
            principal = self._principal(headers)
            return None if principal is None else allow(principal, action)
        except TurnoutError:
            return None


def _wait_only(query: bytes) -> Params | None:
    """`?wait=S` (seconds, 0 to MAX_WAIT_S, plainly written) or nothing; None for anything else."""
    try:
        pairs = parse_qsl(query.decode("ascii"), keep_blank_values=True, strict_parsing=bool(query))
    except (UnicodeDecodeError, ValueError):
        return None
    if not pairs:
        return {"wait": 0.0}
    if len(pairs) != 1 or pairs[0][0] != "wait" or not PLAIN_SECONDS.fullmatch(pairs[0][1]):
        return None
    wait = float(pairs[0][1])
    return {"wait": wait} if wait <= MAX_WAIT_S else None


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
