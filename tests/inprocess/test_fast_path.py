"""`FastPath` answers a plain report or submission itself and passes everything else to the route, body intact.

Driven as ASGI, around a stand-in for the rest of the app that records what reaches it, with a real service
whose token and worker caches were filled by a real registration (the in-process API, conftest.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.inprocess.conftest import Api, Worker
from turnout.access import Principal
from turnout.api.fastpath import FastPath
from turnout.api.pipelines import RunIn
from turnout.api.protocol import EventItem
from turnout.api.schemas import CompleteIn, FastJSON, LeaseIn, TaskIn
from turnout.auth import WorkerCredential
from turnout.errors import NotFound, RateLimited

pytestmark = pytest.mark.anyio
REPORT = {"results": [{"task_id": "t_0123456789abcdef01234567", "attempt": 1, "status": "succeeded",
                       "output": {"n": 1}, "run_s": 0.1}]}  # fmt: skip


class Rest:
    """The app behind the fast path: records each request that reaches it and the body it read."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        await FastJSON({"route": True})(scope, receive, send)


async def call(
    app: Any, path: str, headers: dict[str, str], body: bytes, query: bytes = b"", method: str = "POST"
) -> tuple[int, Any]:
    """One request (a POST unless told) through `app` as ASGI, the body in two chunks; the status and the
    decoded JSON answer."""
    scope = {"type": "http", "method": method, "path": path, "query_string": query, "http_version": "1.1",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}  # fmt: skip
    chunks = [{"type": "http.request", "body": body[:5], "more_body": True},
              {"type": "http.request", "body": body[5:], "more_body": False}]  # fmt: skip
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


@pytest.fixture
async def worker(api: Api) -> Worker:
    w = await api.worker()
    await w.heartbeat()  # a call through the route: the worker's credential and its token are cached now
    return w


def headers(w: Worker, **changes: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {w.token}", "X-Worker-Secret": w.secret,
            "Content-Type": "application/json", **changes}  # fmt: skip


def fast_path(api: Api, answered: list[Any]) -> tuple[FastPath, Rest]:
    async def answer(worker_id: str, body: CompleteIn, me: WorkerCredential) -> FastJSON:
        answered.append((worker_id, body, me))
        if body.results[0].attempt == 9:
            raise NotFound("no such attempt", field="results.0.attempt")
        return FastJSON({"fast": True})

    async def leased(worker_id: str, body: LeaseIn, me: WorkerCredential) -> FastJSON:
        answered.append((worker_id, body, me))
        return FastJSON({"leased": True})

    async def stored(worker_id: str, items: list[EventItem], me: WorkerCredential) -> FastJSON:
        answered.append((worker_id, items, me))
        return FastJSON({"stored": len(items)})

    async def submitted(body: TaskIn, wait: float, p: Principal) -> FastJSON:
        answered.append((body, wait, p))
        if body.priority == 9:
            raise RateLimited("too many submissions", retry_after_s=2.5)
        return FastJSON({"submitted": True}, status_code=201)

    async def started(name: str, body: RunIn, wait: float, p: Principal) -> FastJSON:
        answered.append((name, body, wait, p))
        return FastJSON({"started": True}, status_code=201)

    async def result(task_id: str, wait: float, p: Principal) -> FastJSON:
        answered.append((task_id, wait, p))
        if task_id == "t_missing":
            raise NotFound(f"task {task_id} not found", field="task_id")
        return FastJSON({"result": True})

    rest = Rest()
    fast = FastPath(rest, api.service, complete=answer, lease=leased, events=stored, submit=submitted,
                    start_run=started, result=result)  # fmt: skip
    return fast, rest


async def test_a_plain_report_is_answered_without_the_route(api: Api, worker: Worker) -> None:
    answered: list[Any] = []
    app, rest = fast_path(api, answered)
    status, body = await call(
        app, f"/v1/workers/{worker.id}/complete", headers(worker), json.dumps(REPORT).encode()
    )
    assert (status, body, rest.bodies) == (200, {"fast": True}, [])
    [(worker_id, report, me)] = answered
    assert worker_id == worker.id and me.worker_id == worker.id
    assert report == CompleteIn.model_validate(REPORT)


async def test_a_plain_lease_poll_is_answered_without_the_route(api: Api, worker: Worker) -> None:
    answered: list[Any] = []
    app, rest = fast_path(api, answered)
    poll = {"max_tasks": 2, "running": [], "wait_s": 5}
    status, body = await call(
        app, f"/v1/workers/{worker.id}/lease", headers(worker), json.dumps(poll).encode()
    )
    assert (status, body, rest.bodies) == (200, {"leased": True}, [])
    [(worker_id, lease, me)] = answered
    assert worker_id == worker.id and me.worker_id == worker.id and lease == LeaseIn.model_validate(poll)
    # another worker's secret, or a body the model refuses: the route's own answer
    for hdrs, sent in (
        (headers(worker, **{"X-Worker-Secret": "nope"}), poll),
        (headers(worker), {"wait_s": -1}),
    ):
        await call(app, f"/v1/workers/{worker.id}/lease", hdrs, json.dumps(sent).encode())
    assert len(answered) == 1 and len(rest.bodies) == 2


async def test_a_plain_event_batch_is_answered_without_the_route(api: Api, worker: Worker) -> None:
    answered: list[Any] = []
    app, rest = fast_path(api, answered)
    batch = {"events": [{"task_id": "t_1", "attempt": 1, "event": {"type": "log", "line": "hi"}}]}
    path = f"/v1/workers/{worker.id}/events"
    assert await call(app, path, headers(worker), json.dumps(batch).encode()) == (200, {"stored": 1})
    assert answered == [(worker.id, [("t_1", 1, {"type": "log", "line": "hi"})], answered[0][2])]
    # more events than a request may hold, or a malformed one: the route refuses it, in its own words
    too_many = {
        "events": batch["events"]
        * (api.service.controller.settings.request_limits.max_events_per_request + 1)
    }
    for sent in (too_many, {"events": [{"task_id": "t_1", "attempt": 0, "event": {}}]}):
        await call(app, path, headers(worker), json.dumps(sent).encode())
    assert len(answered) == 1 and len(rest.bodies) == 2


async def test_an_error_the_answer_raises_is_rendered_as_the_route_would(api: Api, worker: Worker) -> None:
    app, _ = fast_path(api, [])
    bad_attempt = {"results": [{**REPORT["results"][0], "attempt": 9}]}
    status, body = await call(app, f"/v1/workers/{worker.id}/complete", headers(worker),
                              json.dumps(bad_attempt).encode())  # fmt: skip
    assert status == 404 and body["error"]["field"] == "results.0.attempt"


@pytest.mark.parametrize(
    "case",
    [
        "wrong secret",
        "other worker",
        "no token",
        "unknown token",
        "not JSON",
        "bad body",
        "extra field",
        "NaN",
        "query",
        "text body",
        "another route",
    ],
)
async def test_anything_unsure_goes_to_the_route_with_its_body_intact(
    api: Api, worker: Worker, case: str
) -> None:
    answered: list[Any] = []
    app, rest = fast_path(api, answered)
    path, hdrs, body, query = (
        f"/v1/workers/{worker.id}/complete",
        headers(worker),
        json.dumps(REPORT).encode(),
        b"",
    )
    if case == "wrong secret":
        hdrs["X-Worker-Secret"] = "not-it"
    elif case == "other worker":
        path = "/v1/workers/w_0123456789abcdef01234567/complete"
    elif case == "no token":
        del hdrs["Authorization"]
    elif case == "unknown token":
        hdrs["Authorization"] = "Bearer tok_never_seen"
    elif case == "not JSON":
        body = b"{results: nope"
    elif case == "bad body":
        body = json.dumps({"results": [{"task_id": 5}]}).encode()
    elif case == "extra field":
        body = json.dumps({**REPORT, "sneaky": 1}).encode()
    elif case == "NaN":
        body = json.dumps(REPORT).replace('"run_s": 0.1', '"run_s": NaN').encode()
    elif case == "query":
        query = b"x=1"
    elif case == "text body":
        hdrs["Content-Type"] = "text/plain"
    if case == "another route":
        scope_path = path.replace("/complete", "/lease")  # passed on untouched
        status, answer = await call(app, scope_path, hdrs, body)
    else:
        status, answer = await call(app, path, hdrs, body, query)
    assert (status, answer, answered) == (200, {"route": True}, [])
    assert rest.bodies == [body]


SUBMISSION = {"capability": "shout", "input": {"text": "hi"}}


async def submitter(api: Api, role: str = "submit") -> dict[str, str]:
    """Headers of a token of `role` the service has cached (one request through the app verified it)."""
    token = await api.token(role, "acme")
    assert (await api.as_(token, "GET", "/v1/tasks")).status_code in (200, 403)
    return {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}


@pytest.mark.parametrize(("query", "wait"), [(b"", 0.0), (b"wait=30", 30.0), (b"wait=0.5", 0.5)])
async def test_a_plain_submission_is_answered_without_the_route(api: Api, query: bytes, wait: float) -> None:
    answered: list[Any] = []
    app, rest = fast_path(api, answered)
    status, body = await call(app, "/v1/tasks", await submitter(api), json.dumps(SUBMISSION).encode(), query)
    assert (status, body, rest.bodies) == (201, {"submitted": True}, [])
    [(task, waited, principal)] = answered
    assert task == TaskIn.model_validate(SUBMISSION) and principal.home_tenant == "acme" and waited == wait


async def test_a_refusal_the_submission_raises_is_rendered_as_the_route_would(api: Api) -> None:
    app, _ = fast_path(api, [])
    status, body = await call(app, "/v1/tasks", await submitter(api),
                              json.dumps({**SUBMISSION, "priority": 9}).encode())  # fmt: skip
    assert status == 429 and body["error"]["type"] == "rate_limited"


@pytest.mark.parametrize(
    "case",
    [
        "read token",
        "unknown token",
        "no token",
        "bad body",
        "extra field",
        "NaN",
        "query",
        "wait=1e2",
        "wait=-1",
        "the batch",
    ],
)
async def test_an_unsure_submission_goes_to_the_route_with_its_body_intact(api: Api, case: str) -> None:
    answered: list[Any] = []
    app, rest = fast_path(api, answered)
    hdrs = await submitter(api, "read" if case == "read token" else "submit")
    path, body, query = "/v1/tasks", json.dumps(SUBMISSION).encode(), b""
    if case == "unknown token":
        hdrs["Authorization"] = "Bearer tok_never_seen"
    elif case == "no token":
        del hdrs["Authorization"]
    elif case == "bad body":
        body = json.dumps({"capability": 5}).encode()
    elif case == "extra field":
        body = json.dumps({**SUBMISSION, "sneaky": 1}).encode()
    elif case == "NaN":
        body = b'{"capability": "shout", "input": NaN}'
    elif case == "query":
        query = b"x=1"
    elif case.startswith("wait="):  # a wait only the route takes (or refuses), in its own words
        query = case.encode()
    elif case == "the batch":
        path, body = "/v1/tasks/batch", json.dumps({"tasks": [SUBMISSION]}).encode()
    status, answer = await call(app, path, hdrs, body, query)
    assert (status, answer, answered) == (200, {"route": True}, [])
    assert rest.bodies == [body]


RUN = {"input": {"text": "hi"}}


@pytest.mark.parametrize(
    ("query", "wait"), [(b"", 0.0), (b"wait=60", 60.0), (b"wait=0.25", 0.25), (b"wait=3600", 3600.0)]
)
async def test_a_plain_run_start_is_answered_without_the_route(api: Api, query: bytes, wait: float) -> None:
    answered: list[Any] = []
    app, rest = fast_path(api, answered)
    status, body = await call(app, "/v1/pipelines/classify/runs", await submitter(api), json.dumps(RUN).encode(),
                              query)  # fmt: skip
    assert (status, body, rest.bodies) == (201, {"started": True}, [])
    [(name, run, waited, principal)] = answered
    assert (name, run, waited) == ("classify", RunIn.model_validate(RUN), wait)
    assert principal.home_tenant == "acme"


@pytest.mark.parametrize(
    "query",
    [b"wait=3601", b"wait=-1", b"wait=abc", b"wait=1e2", b"wait=nan", b"wait=", b"wait=1&wait=2", b"wait=1&x=2",
     b"x=1", b"wait=%FF", b"wait", b"&&"],
)  # fmt: skip
async def test_a_run_start_with_any_other_query_goes_to_the_route_with_its_body_intact(
    api: Api, query: bytes
) -> None:
    answered: list[Any] = []
    app, rest = fast_path(api, answered)
    body = json.dumps(RUN).encode()
    status, answer = await call(app, "/v1/pipelines/classify/runs", await submitter(api), body, query)
    assert (status, answer, answered, rest.bodies) == (200, {"route": True}, [], [body])


@pytest.mark.parametrize("case", ["read token", "bad body", "NaN", "another pipeline route"])
async def test_an_unsure_run_start_goes_to_the_route(api: Api, case: str) -> None:
    answered: list[Any] = []
    app, rest = fast_path(api, answered)
    hdrs = await submitter(api, "read" if case == "read token" else "submit")
    path, body = "/v1/pipelines/classify/runs", json.dumps(RUN).encode()
    if case == "bad body":
        body = json.dumps({"input": {}, "sneaky": 1}).encode()
    elif case == "NaN":
        body = b'{"input": {"x": NaN}}'
    elif case == "another pipeline route":
        path = "/v1/pipeline-runs/r_0123456789abcdef01234567/cancel"
    status, answer = await call(app, path, hdrs, body)
    assert (status, answer, answered, rest.bodies) == (200, {"route": True}, [], [body])


@pytest.mark.parametrize(("query", "wait"), [(b"", 0.0), (b"wait=30", 30.0), (b"wait=0.5", 0.5)])
@pytest.mark.parametrize("role", ["read", "submit"])
async def test_a_plain_wait_for_a_result_is_answered_without_the_route(
    api: Api, query: bytes, wait: float, role: str
) -> None:
    answered: list[Any] = []
    app, rest = fast_path(api, answered)
    path = "/v1/tasks/t_0123456789abcdef01234567/result"
    status, body = await call(app, path, await submitter(api, role), b"", query, method="GET")
    assert (status, body, rest.bodies) == (200, {"result": True}, [])
    [(task_id, waited, principal)] = answered
    assert (task_id, waited, principal.home_tenant) == ("t_0123456789abcdef01234567", wait, "acme")


async def test_a_result_the_answer_cannot_find_is_refused_as_the_route_would(api: Api) -> None:
    app, rest = fast_path(api, [])
    status, body = await call(app, "/v1/tasks/t_missing/result", await submitter(api), b"", method="GET")
    assert status == 404 and body["error"]["field"] == "task_id" and rest.bodies == []


@pytest.mark.parametrize(
    "case",
    ["unknown token", "no token", "wait=3601", "wait=1e2", "wait=nan", "wait=1&x=2", "events", "the task",
     "a POST"],
)  # fmt: skip
async def test_an_unsure_wait_for_a_result_goes_to_the_route(api: Api, case: str) -> None:
    answered: list[Any] = []
    app, rest = fast_path(api, answered)
    hdrs = await submitter(api, "read")
    path, query, method = "/v1/tasks/t_0123456789abcdef01234567/result", b"", "GET"
    if case == "unknown token":
        hdrs["Authorization"] = "Bearer tok_never_seen"
    elif case == "no token":
        del hdrs["Authorization"]
    elif case.startswith("wait="):
        query = case.encode()
    elif case == "events":
        path = "/v1/tasks/t_0123456789abcdef01234567/events"
    elif case == "the task":
        path = "/v1/tasks/t_0123456789abcdef01234567"
    elif case == "a POST":
        method = "POST"
    status, answer = await call(app, path, hdrs, b"", query, method=method)
    assert (status, answer, answered, rest.bodies) == (200, {"route": True}, [], [b""])


async def test_a_result_wait_answers_the_same_through_the_fast_path_and_the_route(api: Api) -> None:
    # Given a finished task of tenant acme, and read tokens of acme and of another tenant, both cached
    worker = await api.worker()
    acme = await submitter(api, "read")
    other = {"Authorization": f"Bearer {await api.token('read', 'default')}"}
    assert (await api.client.get("/v1/tasks", headers=other)).status_code == 200
    submit = await api.token("submit", "acme")
    task = (await api.as_(submit, "POST", "/v1/tasks", json={"capability": "shout", "gpu": "never"})).json()
    [lease] = (await worker.lease())["tasks"]
    await worker.complete(lease, {"n": 1})
    for hdrs, task_id, status in [(acme, task["id"], 200), (other, task["id"], 404),
                                  (acme, "t_0123456789abcdef01234567", 404)]:  # fmt: skip
        path = f"/v1/tasks/{task_id}/result"
        # When the same wait is asked plainly (the fast path) and in a form only the route takes
        fast = await api.client.get(path, params={"wait": "0"}, headers=hdrs)
        route = await api.client.get(path, params={"wait": "0e0"}, headers=hdrs)
        # Then both answer alike: the task for its tenant, 404 for another tenant and for no task
        assert (fast.status_code, fast.json()) == (route.status_code, route.json())
        assert fast.status_code == status


async def test_a_plain_request_never_enters_fastapis_own_middleware_anything_else_does(
    api: Api, worker: Worker
) -> None:
    """The rate gate, the body limit and the fast path stand in front of FastAPI's middleware (`app.Api`): a
    plain submission, lease poll or report is answered without entering it (its error pages, telemetry and body
    limit); a request the fast path does not take goes on through it."""
    assert api.app is not None
    entered: list[str] = []
    whole = api.app.build_middleware_stack()

    async def counted(scope: Any, receive: Any, send: Any) -> None:
        entered.append(scope["path"])
        await whole(scope, receive, send)

    api.app.middleware_stack = counted  # what Starlette calls, below FastAPI's own door
    submit = await submitter(api)
    assert entered == ["/v1/tokens", "/v1/tasks"]  # made, then its first use: the route checks it
    entered.clear()
    resp = await api.client.post("/v1/tasks", json=SUBMISSION, headers=submit)
    assert resp.status_code == 201, resp.text
    [task] = (await worker.lease())["tasks"]
    assert (await worker.complete(task, {"text": "HI"}))["accepted"] == [task["id"]]
    assert entered == []
    assert (await api.client.get(f"/v1/tasks/{task['id']}", headers=submit)).json()["state"] == "succeeded"
    assert entered == [f"/v1/tasks/{task['id']}"]
