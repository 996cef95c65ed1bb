"""Access control on the controller's API, in-process: every route x role x tenant, from the OpenAPI
document, and each escalation of issue 10 tried as a hostile tenant would.

The app is the one `turnout controller` serves (`runtime.build_controller`, with its config, tokens and file
storage), on the memory store, called through `httpx.ASGITransport` (tests/inprocess/asgi.py): who may call
what is decided in the routes, not by the socket or the database, so no process is needed to check it.
(`turnout controller --no-auth` itself is started for real in tests/integration/test_access_control.py.)

The table below restates the contract (DESIGN.md, Security and HTTP API) independently of the code. The
routes come from the controller's own /openapi.json: a new route without a row here fails the suite, so
no route can be added without deciding who may call it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.inprocess.asgi import InProcessApi
from turnout.api.app import create_app
from turnout.runtime import build_controller

# who may call what (DESIGN.md): the roles per action, restated here, not imported from the code under test
ROLES_FOR = {
    "submit": {"admin", "submit"},
    "read": {"admin", "submit", "read"},
    "worker": {"admin", "worker"},
    "admin": {"admin"},
    "any": {"admin", "submit", "worker", "read"},  # any valid token: who am I
}
NO_FILE = "f_" + "0" * 28
NO_TASK = {"task": "t_0123456789abcdef01234567", "attempt": 1}
REGISTER = {"name": "probe", "host": "h", "variants": [{"capability": "count", "device": "cpu"}], "cpu": 1,
            "memory": 2**30}  # fmt: skip


@dataclass(frozen=True)
class Row:
    """One route's contract. `obj`: what its path or tenant parameter names, and so who owns the call:
    task / token / worker / run (a pipeline run) / file (another tenant's: 404), self (the worker protocol:
    only the worker itself, else 403), tenant (a tenant named in the query or body: another's is `cross`), None
    (no one's). A `{name}` in a path is the pipeline configured below, `probe`."""

    action: str | None  # None: public
    obj: str | None = None
    body: Callable[[str], Any] | None = None  # owner tenant -> JSON body
    params: Callable[[str], dict[str, Any]] | None = None
    cross: int = 404
    content: bytes | None = None  # a raw body (a file upload) instead of JSON
    allowed: int | None = None  # what an allowed caller gets where a 2xx needs more than this table sets up


ROUTES: dict[tuple[str, str], Row] = {
    ("GET", "/healthz"): Row(None),
    ("POST", "/v1/tasks"): Row("submit", body=lambda o: {"capability": "count"}),
    ("POST", "/v1/tasks/batch"): Row("submit", body=lambda o: {"tasks": [{"capability": "count"}]}),
    ("GET", "/v1/tasks"): Row("read"),
    ("GET", "/v1/tasks/{task_id}"): Row("read", "task"),
    ("GET", "/v1/tasks/{task_id}/result"): Row("read", "task", params=lambda o: {"wait": 0}),
    ("GET", "/v1/tasks/{task_id}/events"): Row("read", "task"),
    ("POST", "/v1/tasks/{task_id}/cancel"): Row("submit", "task"),
    ("GET", "/v1/capabilities"): Row("read"),
    ("GET", "/v1/workers"): Row("read"),
    ("POST", "/v1/workers/{worker_id}/drain"): Row("admin", "worker"),
    ("POST", "/v1/workers/register"): Row("worker", body=lambda o: REGISTER),
    ("POST", "/v1/workers/{worker_id}/heartbeat"): Row("worker", "self", body=lambda o: {}),
    ("POST", "/v1/workers/{worker_id}/lease"): Row("worker", "self", body=lambda o: {"max_tasks": 0, "wait_s": 0}),
    ("POST", "/v1/workers/{worker_id}/events"): Row("worker", "self", body=lambda o: {"events": []}),
    ("POST", "/v1/workers/{worker_id}/complete"): Row("worker", "self", body=lambda o: {"results": []}),
    ("POST", "/v1/workers/{worker_id}/leave"): Row("worker", "self"),
    ("POST", "/v1/workers/{worker_id}/scrubs"): Row("worker", "self", body=lambda o: {"scrubs": []}),
    ("GET", "/v1/workers/{worker_id}/lifeline"): Row("worker", "self"),  # a stream: its status is enough
    ("GET", "/v1/dashboard"): Row("read"),  # the data; the HTML pages (/, /tasks/{id}) are not in the schema
    ("GET", "/v1/whoami"): Row("any"),
    ("POST", "/v1/tokens"): Row("admin", "tenant", body=lambda o: {"role": "read", "tenant": o}, cross=403),
    ("GET", "/v1/tokens"): Row("admin", "tenant", params=lambda o: {"tenant": o}),
    ("DELETE", "/v1/tokens/{token_id}"): Row("admin", "token"),
    ("GET", "/v1/audit"): Row("admin", "tenant", params=lambda o: {"tenant": o}),
    ("POST", "/v1/files"): Row("submit", content=b"probe"),
    # recording a file already in the shared storage: this controller has none there, so allowed is a 422
    ("POST", "/v1/files/shared"): Row("submit", body=lambda o: {"id": NO_FILE}, allowed=422),
    ("GET", "/v1/files/{file_id}"): Row("read", "file"),
    ("HEAD", "/v1/files/{file_id}"): Row("read", "file"),
    ("DELETE", "/v1/files/{file_id}"): Row("submit", "file"),
    # a worker's transfers are for a task it holds (tests/integration/test_files.py); here it holds none: 404
    ("POST", "/v1/workers/{worker_id}/files"): Row("worker", "self", content=b"out", params=lambda o: NO_TASK,
                                                   allowed=404),
    ("POST", "/v1/workers/{worker_id}/files/shared"): Row("worker", "self", body=lambda o: {"id": NO_FILE},
                                                          params=lambda o: NO_TASK, allowed=404),
    ("GET", "/v1/workers/{worker_id}/files/{file_id}"): Row("worker", "self", params=lambda o: NO_TASK,
                                                            allowed=404),
    ("HEAD", "/v1/workers/{worker_id}/files/{file_id}"): Row("worker", "self", params=lambda o: NO_TASK,
                                                             allowed=404),
    ("GET", "/v1/pipelines"): Row("read"),  # what turnout.yaml configures: the same for every tenant
    ("POST", "/v1/pipelines/{name}/runs"): Row("submit", body=lambda o: {"input": {"n": 1}}),
    ("GET", "/v1/pipeline-runs"): Row("read"),
    ("GET", "/v1/pipeline-runs/{run_id}"): Row("read", "run", params=lambda o: {"wait": 0}),
    ("POST", "/v1/pipeline-runs/{run_id}/cancel"): Row("submit", "run"),
}  # fmt: skip
CONFIG = "pipelines:\n  probe:\n    stages:\n      - {capability: count, timeout_s: 30}\n"

# public, and outside the schema: Prometheus text, and the dashboard's HTML shell (its data is /v1/dashboard)
UNLISTED = (("GET", "/metrics"), ("GET", "/"), ("GET", "/tasks/{task_id}"))

OWNERS = ("acme", "globex")  # objects of the caller's own tenant, and of another


@dataclass
class Tenants:
    """The API with tokens for two tenants, and helpers to make each kind of object."""

    api: InProcessApi
    operator: str  # the operator's token, as `turnout controller` made it
    tokens: dict[str, dict[str, Any]] = field(default_factory=dict)  # "acme-submit" -> {id, token, ...}

    def token(self, name: str) -> str:
        return self.operator if name == "operator" else self.tokens[name]["token"]

    def call(self, token: str | None, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = dict(kwargs.pop("headers", {}))
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return self.api.request(method, path, headers=headers, **kwargs)

    def status(self, token: str | None, method: str, path: str, **kwargs: Any) -> int:
        """The status only: a stream (events) is closed as soon as its headers are in."""
        headers = dict(kwargs.pop("headers", {}))
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return self.api.status(method, path, headers=headers, **kwargs)

    def task(self, owner: str, **input: Any) -> str:
        resp = self.call(
            self.token(f"{owner}-submit"), "POST", "/v1/tasks", json={"capability": "count", "input": input}
        )
        assert resp.status_code == 201, resp.text
        return str(resp.json()["id"])

    def file(self, owner: str) -> str:
        resp = self.call(self.token(f"{owner}-submit"), "POST", "/v1/files", content=b"owned",
                         headers={"Content-Type": "application/octet-stream"})  # fmt: skip
        assert resp.status_code == 201, resp.text
        return str(resp.json()["id"])

    def run(self, owner: str) -> str:
        """A pipeline run of `owner`'s (its first stage queued; no worker here runs it)."""
        resp = self.call(
            self.token(f"{owner}-submit"), "POST", "/v1/pipelines/probe/runs", json={"input": {}}
        )
        assert resp.status_code == 201, resp.text
        return str(resp.json()["id"])

    def make_token(self, owner: str) -> str:
        resp = self.call(self.operator, "POST", "/v1/tokens", json={"role": "read", "tenant": owner})
        assert resp.status_code == 201, resp.text
        return str(resp.json()["id"])

    def worker(self, token: str, body: dict[str, Any] | None = None) -> tuple[str, str]:
        """Register a worker with `token`: (its id, its secret)."""
        resp = self.call(token, "POST", "/v1/workers/register", json=body or REGISTER)
        assert resp.status_code == 201, resp.text
        return resp.json()["id"], resp.json()["secret"]


@pytest.fixture(scope="module")
def controller_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[InProcessApi, str]]:
    """This module's controller, wired as `turnout controller --config turnout.yaml` wires it (a pipeline
    configured, so its routes are called for real), on the memory store; and the operator's token."""
    home = tmp_path_factory.mktemp("access")
    (home / "turnout.yaml").write_text(CONFIG)
    parts = build_controller(db="memory://", home=home / "home", config=home / "turnout.yaml")
    assert parts.admin_token is not None
    api = InProcessApi(create_app(parts.service))
    try:
        yield api, parts.admin_token
    finally:
        api.close()


@pytest.fixture(scope="module")
def tenants(controller_api: tuple[InProcessApi, str]) -> Tenants:
    t = Tenants(*controller_api)
    for tenant in OWNERS:
        for role in ("admin", "submit", "worker", "read"):
            resp = t.call(t.operator, "POST", "/v1/tokens", json={"role": role, "tenant": tenant})
            assert resp.status_code == 201, resp.text
            t.tokens[f"{tenant}-{role}"] = resp.json()
        t.tokens[f"{tenant}-victim"] = t.call(t.operator, "POST", "/v1/tokens",
                                              json={"role": "worker", "tenant": tenant}).json()  # fmt: skip
    t.tokens["pool-worker"] = t.call(t.operator, "POST", "/v1/tokens",
                                     json={"role": "worker", "tenant": "*"}).json()  # fmt: skip
    t.worker(t.token("pool-worker"))  # `count` is then a known capability: submitting it is not a 422 typo
    return t


def expected(caller: str, role: str, caller_tenant: str, row: Row, owner: str) -> int | str:
    """What the contract says `caller` gets: a status code, or "ok" for any 2xx."""
    if row.action is None:
        return "ok"
    if role not in ROLES_FOR[row.action]:
        return 403
    ok: int | str = "ok" if row.allowed is None else row.allowed
    if row.obj == "self":
        return ok  # the worker routes are called for the caller's own worker here (others': see below)
    if row.obj is None or caller_tenant == "*" or owner == caller_tenant:
        return ok
    return row.cross


CALLERS = {  # name -> (role, tenant)
    "acme-admin": ("admin", "acme"),
    "acme-submit": ("submit", "acme"),
    "acme-worker": ("worker", "acme"),
    "acme-read": ("read", "acme"),
    "operator": ("admin", "*"),
    "pool-worker": ("worker", "*"),
}


def openapi_routes(t: Tenants) -> list[tuple[str, str]]:
    doc = t.call(t.operator, "GET", "/openapi.json").json()
    return sorted((m.upper(), p) for p, ops in doc["paths"].items() for m in ops)


def test_every_route_in_the_openapi_document_has_a_row_in_the_access_table(tenants: Tenants) -> None:
    routes = set(openapi_routes(tenants))
    assert routes - set(ROUTES) == set(), "routes with no access row: decide who may call them"
    assert set(ROUTES) - routes == set(), "rows for routes that do not exist"


def test_the_routes_outside_the_schema_are_public_and_the_pages_hold_no_task_data(tenants: Tenants) -> None:
    secret = "acme-private-input-7f3a"
    task_id = tenants.task("acme", note=secret)
    assert not set(UNLISTED) & set(openapi_routes(tenants))
    for method, path in UNLISTED:
        resp = tenants.call(None, method, path.replace("{task_id}", task_id))
        assert resp.status_code == 200, (path, resp.status_code)
        assert secret not in resp.text and "acme" not in resp.text, (
            path
        )  # the page asks the API, with a token


@pytest.mark.parametrize("caller", list(CALLERS))
def test_each_route_answers_each_caller_as_the_contract_says(tenants: Tenants, caller: str) -> None:
    role, tenant = CALLERS[caller]
    token = tenants.token(caller)
    wrong: list[str] = []
    for method, path in openapi_routes(tenants):
        row = ROUTES[(method, path)]
        for owner in OWNERS:
            headers: dict[str, str] = {}
            url = path
            if row.obj == "task":
                url = path.replace("{task_id}", tenants.task(owner))
            elif row.obj == "file":
                url = path.replace("{file_id}", tenants.file(owner))
            elif row.obj == "token":
                url = path.replace("{token_id}", tenants.make_token(owner))
            elif row.obj == "run":
                url = path.replace("{run_id}", tenants.run(owner))
            elif row.obj == "worker":
                url = path.replace("{worker_id}", tenants.worker(tenants.token(f"{owner}-worker"))[0])
            elif row.obj == "self":
                if role in ROLES_FOR["worker"]:
                    worker_id, secret = tenants.worker(token)
                    headers["X-Worker-Secret"] = secret
                else:
                    worker_id = tenants.worker(tenants.token(f"{owner}-victim"))[0]
                url = path.replace("{worker_id}", worker_id).replace("{file_id}", NO_FILE)
            if row.content is not None:
                headers["Content-Type"] = "application/octet-stream"
                url = path.replace("{worker_id}", worker_id)
            url = url.replace("{name}", "probe")
            kwargs: dict[str, Any] = {"headers": headers}
            if row.content is not None:
                kwargs["content"] = row.content
            if row.body is not None:
                kwargs["json"] = row.body(owner)
            if row.params is not None:
                kwargs["params"] = row.params(owner)
            got = tenants.status(token, method, url, **kwargs)
            want = expected(caller, role, tenant, row, owner)
            if not (200 <= got < 300 if want == "ok" else got == want):
                wrong.append(f"{method} {path} as {caller} on {owner}'s: got {got}, want {want}")
            if row.action is not None and row.obj != "self":
                anonymous = tenants.status(None, method, url, **kwargs)
                if anonymous != 401:
                    wrong.append(f"{method} {path} without a token: got {anonymous}, want 401")
    assert wrong == []


def test_a_worker_route_for_another_workers_id_is_403_whoever_asks(tenants: Tenants) -> None:
    victim, victim_secret = tenants.worker(tenants.token("globex-victim"))
    _, my_secret = tenants.worker(tenants.token("acme-worker"))
    attempts = {
        "another tenant's worker token, no secret": (tenants.token("acme-worker"), None),
        "another worker's secret": (tenants.token("acme-worker"), my_secret),
        "a stolen secret with the wrong token": (tenants.token("acme-worker"), victim_secret),
        "the same tenant's other worker token": (tenants.token("globex-worker"), victim_secret),
        "the operator": (tenants.operator, None),
        "the shared pool's token": (tenants.token("pool-worker"), victim_secret),
    }
    for why, (token, secret) in attempts.items():
        headers = {"X-Worker-Secret": secret} if secret else {}
        for route in ("heartbeat", "lease", "events", "complete", "scrubs", "leave"):
            body = {"lease": {"max_tasks": 0, "wait_s": 0}, "events": {"events": []},
                    "complete": {"results": []}, "scrubs": {"scrubs": []}}.get(route, {})  # fmt: skip
            resp = tenants.call(token, "POST", f"/v1/workers/{victim}/{route}", json=body, headers=headers)
            assert resp.status_code == 403, (why, route, resp.text)
            assert resp.json()["error"]["type"] == "forbidden"
        # holding another worker's lifeline would keep it judged alive after its death
        lifeline = tenants.call(token, "GET", f"/v1/workers/{victim}/lifeline", headers=headers)
        assert lifeline.status_code == 403, (why, "lifeline", lifeline.text)
        # nor may anyone else fetch the files of the task it holds, or send outputs in its name
        fetch = tenants.call(
            token, "GET", f"/v1/workers/{victim}/files/{NO_FILE}", params=NO_TASK, headers=headers
        )
        assert fetch.status_code == 403, (why, "files", fetch.text)
        send = tenants.call(token, "POST", f"/v1/workers/{victim}/files", params=NO_TASK, content=b"x",
                            headers={**headers, "Content-Type": "application/octet-stream"})  # fmt: skip
        assert send.status_code == 403, (why, "files upload", send.text)
    ok = {"X-Worker-Secret": victim_secret}
    assert tenants.call(tenants.token("globex-victim"), "POST", f"/v1/workers/{victim}/heartbeat", json={},
                        headers=ok).status_code == 200  # fmt: skip
    unknown = tenants.call(
        tenants.token("globex-victim"), "POST", "/v1/workers/w_nobody/heartbeat", json={}, headers=ok
    )
    assert unknown.status_code == 404  # unknown: register again


def test_registering_again_under_another_workers_id_is_refused(tenants: Tenants) -> None:
    victim, _ = tenants.worker(tenants.token("globex-victim"))
    resp = tenants.call(
        tenants.token("acme-worker"), "POST", "/v1/workers/register", json={**REGISTER, "worker_id": victim}
    )
    assert resp.status_code == 403
    workers = tenants.call(tenants.operator, "GET", "/v1/workers").json()["workers"]
    assert [w["name"] for w in workers if w["id"] == victim] == ["probe"]


# ---- the escalations the issue lists, one by one --------------------------------------------------------


def test_a_tenant_admin_cannot_reach_another_tenant(tenants: Tenants) -> None:
    acme_admin = tenants.token("acme-admin")
    default_task = tenants.call(tenants.operator, "POST", "/v1/tasks", json={"capability": "count"}).json()
    assert default_task["tenant"] == "default"  # the operator submits as tenant default
    made = tenants.call(acme_admin, "POST", "/v1/tokens", json={"role": "admin", "tenant": "default"})
    assert made.status_code == 403 and made.json()["error"]["type"] == "forbidden"
    assert (
        tenants.call(acme_admin, "POST", "/v1/tokens", json={"role": "admin", "tenant": "*"}).status_code
        == 403
    )
    assert tenants.call(acme_admin, "GET", f"/v1/tasks/{default_task['id']}").status_code == 404
    listed = tenants.call(acme_admin, "GET", "/v1/tasks", params={"limit": 1000}).json()["tasks"]
    assert listed and {t["tenant"] for t in listed} == {"acme"}
    audit = tenants.call(acme_admin, "GET", "/v1/audit", params={"limit": 10_000}).json()["audit"]
    assert audit and {r["tenant"] for r in audit} == {"acme"}
    assert tenants.call(acme_admin, "GET", "/v1/audit", params={"tenant": "default"}).status_code == 404
    victim = tenants.tokens["globex-read"]
    assert tenants.call(acme_admin, "DELETE", f"/v1/tokens/{victim['id']}").status_code == 404
    assert tenants.call(victim["token"], "GET", "/v1/tasks").status_code == 200  # still works
    own = tenants.call(acme_admin, "GET", "/v1/tokens").json()["tokens"]
    assert (
        own
        and {t["tenant"] for t in own} == {"acme"}
        and all("hash" not in t and "token" not in t for t in own)
    )
    # within its own tenant it is an admin: it makes a token (tenant defaulting to its own) and revokes it
    mine = tenants.call(acme_admin, "POST", "/v1/tokens", json={"role": "read"}).json()
    assert mine["tenant"] == "acme"
    assert tenants.call(acme_admin, "DELETE", f"/v1/tokens/{mine['id']}").status_code == 200
    assert tenants.call(mine["token"], "GET", "/v1/tasks").status_code == 401


def test_a_worker_token_of_one_tenant_never_leases_another_tenants_tasks(tenants: Tenants) -> None:
    body = {**REGISTER, "variants": [{"capability": "lease-probe", "device": "cpu"}]}
    acme_worker, acme_secret = tenants.worker(tenants.token("acme-worker"), body)  # first: a known capability
    # default's task waits for a worker that serves it (acme's does not: it is not a known capability to default)
    secret_task = tenants.call(tenants.operator, "POST", "/v1/tasks",
                               json={"capability": "lease-probe", "input": {"secret": "default's"},
                                     "placement_timeout_s": 60}).json()  # fmt: skip
    acme_task = tenants.call(tenants.token("acme-submit"), "POST", "/v1/tasks",
                             json={"capability": "lease-probe", "input": {"n": 1}}).json()  # fmt: skip
    leased: list[dict[str, Any]] = []
    for _ in range(3):  # a few leases: nothing of default's ever comes
        resp = tenants.call(tenants.token("acme-worker"), "POST", f"/v1/workers/{acme_worker}/lease",
                            json={"max_tasks": 10, "wait_s": 0}, headers={"X-Worker-Secret": acme_secret})  # fmt: skip
        leased += resp.json()["tasks"]
    assert [t["id"] for t in leased] == [acme_task["id"]]
    pool, pool_secret = tenants.worker(tenants.token("pool-worker"), body)
    resp = tenants.call(tenants.token("pool-worker"), "POST", f"/v1/workers/{pool}/lease",
                        json={"max_tasks": 10, "wait_s": 0}, headers={"X-Worker-Secret": pool_secret})  # fmt: skip
    assert [t["id"] for t in resp.json()["tasks"]] == [secret_task["id"]]  # the shared pool serves everyone


def test_a_tenants_worker_cannot_write_scrub_records_into_another_tenants_audit(tenants: Tenants) -> None:
    worker_id, secret = tenants.worker(tenants.token("acme-worker"))
    me = {"X-Worker-Secret": secret}
    scrub = {"gpu": "GPU-x", "task_id": "t_x", "tenant": "acme", "previous_tenant": "globex", "ok": True,
             "seconds": 0.1}  # fmt: skip
    forged = tenants.call(tenants.token("acme-worker"), "POST", f"/v1/workers/{worker_id}/scrubs",
                          json={"scrubs": [scrub]}, headers=me)  # fmt: skip
    assert forged.status_code == 422 and forged.json()["error"]["field"] == "scrubs.0.previous_tenant"
    own = tenants.call(tenants.token("acme-worker"), "POST", f"/v1/workers/{worker_id}/scrubs",
                       json={"scrubs": [{**scrub, "previous_tenant": None}]}, headers=me)  # fmt: skip
    assert own.status_code == 200 and own.json() == {"stored": 1}
    globex = tenants.call(tenants.operator, "GET", "/v1/audit",
                          params={"tenant": "globex", "kind": "gpu_scrubbed"}).json()["audit"]  # fmt: skip
    assert [r for r in globex if r["worker"] == worker_id] == []


def test_a_forged_result_from_another_worker_leaves_the_task_alone(tenants: Tenants) -> None:
    body = {**REGISTER, "variants": [{"capability": "forge-probe", "device": "cpu"}]}
    owner, owner_secret = tenants.worker(tenants.token("globex-victim"), body)
    task = tenants.call(
        tenants.token("globex-submit"), "POST", "/v1/tasks", json={"capability": "forge-probe"}
    ).json()
    leased = tenants.call(tenants.token("globex-victim"), "POST", f"/v1/workers/{owner}/lease",
                          json={"max_tasks": 1, "wait_s": 0}, headers={"X-Worker-Secret": owner_secret}).json()  # fmt: skip
    assert [t["id"] for t in leased["tasks"]] == [task["id"]]
    forged = {
        "results": [{"task_id": task["id"], "attempt": 1, "status": "succeeded", "output": {"forged": True}}]
    }
    _, attacker_secret = tenants.worker(tenants.token("acme-worker"))
    resp = tenants.call(tenants.token("acme-worker"), "POST", f"/v1/workers/{owner}/complete", json=forged,
                        headers={"X-Worker-Secret": attacker_secret})  # fmt: skip
    assert resp.status_code == 403
    after = tenants.call(tenants.token("globex-submit"), "GET", f"/v1/tasks/{task['id']}").json()
    assert after["state"] == "leased" and after["output"] is None
    # a heartbeat cannot keep it alive, and it cannot be made to leave
    assert tenants.call(tenants.token("acme-worker"), "POST", f"/v1/workers/{owner}/heartbeat", json={},
                        headers={"X-Worker-Secret": attacker_secret}).status_code == 403  # fmt: skip
    assert tenants.call(tenants.token("acme-worker"), "POST", f"/v1/workers/{owner}/leave",
                        headers={"X-Worker-Secret": attacker_secret}).status_code == 403  # fmt: skip
    real = {
        "results": [{"task_id": task["id"], "attempt": 1, "status": "succeeded", "output": {"real": True}}]
    }
    done = tenants.call(tenants.token("globex-victim"), "POST", f"/v1/workers/{owner}/complete", json=real,
                        headers={"X-Worker-Secret": owner_secret}).json()  # fmt: skip
    assert done["accepted"] == [task["id"]]


def test_a_tenant_admin_drains_its_own_workers_only(tenants: Tenants) -> None:
    mine, _ = tenants.worker(tenants.token("acme-worker"))
    theirs, _ = tenants.worker(tenants.token("globex-worker"))
    shared, _ = tenants.worker(tenants.token("pool-worker"))
    admin = tenants.token("acme-admin")
    assert tenants.call(admin, "POST", f"/v1/workers/{mine}/drain").json()["state"] == "draining"
    assert tenants.call(admin, "POST", f"/v1/workers/{theirs}/drain").status_code == 404
    assert tenants.call(admin, "POST", f"/v1/workers/{shared}/drain").status_code == 403
    seen = {w["id"] for w in tenants.call(tenants.token("acme-read"), "GET", "/v1/workers").json()["workers"]}
    assert mine in seen and shared in seen and theirs not in seen


def test_the_api_docs_need_a_token(tenants: Tenants) -> None:
    assert tenants.call(None, "GET", "/redoc").status_code == 404  # not served at all
    assert tenants.call(None, "GET", "/openapi.json").status_code == 401
    assert tenants.call(None, "GET", "/docs").status_code == 401
    page = tenants.call(tenants.token("acme-read"), "GET", "/docs")
    assert page.status_code == 200 and "/v1/workers/{worker_id}/lease" in page.text
    assert (
        tenants.call(tenants.token("acme-worker"), "GET", "/openapi.json").json()["info"]["title"]
        == "Turnout"
    )


def test_a_tenant_sees_and_cancels_its_own_pipeline_runs_only(tenants: Tenants) -> None:
    mine, theirs = tenants.run("acme"), tenants.run("globex")
    reader, submitter = tenants.token("acme-read"), tenants.token("acme-submit")
    # the dashboard's pipeline panel asks this same route with the user's token: it shows these runs only
    listed = tenants.call(reader, "GET", "/v1/pipeline-runs", params={"limit": 1000}).json()["pipeline_runs"]
    assert mine in {r["id"] for r in listed} and theirs not in {r["id"] for r in listed}
    assert {r["tenant"] for r in listed} == {"acme"}
    assert tenants.call(reader, "GET", f"/v1/pipeline-runs/{theirs}").status_code == 404
    refused = tenants.call(submitter, "POST", f"/v1/pipeline-runs/{theirs}/cancel")
    assert refused.status_code == 404 and refused.json()["error"]["type"] == "not_found"
    run = tenants.call(tenants.token("globex-read"), "GET", f"/v1/pipeline-runs/{theirs}").json()
    assert run["state"] == "running" and run["tenant"] == "globex"
    stage = run["stages"][0]["task_id"]  # its stage task is globex's too: hidden from acme like any task
    assert tenants.call(reader, "GET", f"/v1/tasks/{stage}").status_code == 404
    every = tenants.call(tenants.operator, "GET", "/v1/pipeline-runs", params={"limit": 1000}).json()
    assert {mine, theirs} <= {r["id"] for r in every["pipeline_runs"]}  # the operator sees every tenant
    cancelled = tenants.call(submitter, "POST", f"/v1/pipeline-runs/{mine}/cancel").json()
    assert cancelled["state"] == "cancelled"
    audit = tenants.call(tenants.token("acme-admin"), "GET", "/v1/audit", params={"kind": "task_cancelled"})
    by = {r["task"]: r["by"] for r in audit.json()["audit"]}
    assert by[cancelled["stages"][0]["task_id"]] == tenants.tokens["acme-submit"]["id"]


def test_a_pipeline_run_naming_another_tenants_file_is_refused_as_an_unknown_file_is(
    tenants: Tenants,
) -> None:
    theirs, mine = tenants.file("globex"), tenants.file("acme")
    submitter = tenants.token("acme-submit")
    answers = []
    for file_id in (theirs, "f_" + "0" * 28):
        resp = tenants.call(submitter, "POST", "/v1/pipelines/probe/runs",
                            json={"input": {"doc": {"$file": file_id}}})  # fmt: skip
        assert resp.status_code == 422, resp.text
        assert resp.json()["error"]["field"] == "input.doc"
        answers.append(resp.json()["error"]["message"].replace(file_id, "ID"))
    assert answers[0] == answers[1]  # another tenant's file is answered as no file at all
    ok = tenants.call(submitter, "POST", "/v1/pipelines/probe/runs", json={"input": {"doc": {"$file": mine}}})
    assert ok.status_code == 201, ok.text


def test_recording_another_tenants_shared_file_is_answered_as_an_unknown_id(tenants: Tenants) -> None:
    theirs, mine = tenants.file("globex"), tenants.file("acme")
    submitter = tenants.token("acme-submit")

    def answer(file_id: str) -> tuple[int, str]:
        resp = tenants.call(submitter, "POST", "/v1/files/shared", json={"id": file_id})
        return resp.status_code, resp.json()["error"]["message"].replace(file_id, "ID")

    assert answer(theirs) == answer("f_" + "1" * 28) and answer(theirs)[0] == 422
    assert answer(mine)[0] == 409  # its own: already recorded, as it says


def test_a_workers_file_routes_answer_another_tenants_task_as_an_unknown_one(tenants: Tenants) -> None:
    worker, secret = tenants.worker(tenants.token("acme-worker"))
    theirs = tenants.task("globex")
    headers = {"X-Worker-Secret": secret}
    token = tenants.token("acme-worker")
    unknown = "t_0123456789abcdef01234567"

    def answers(task_id: str) -> list[tuple[int, str]]:
        calls = [
            ("POST", f"/v1/workers/{worker}/files", {"content": b"x", "params": {"task": task_id, "attempt": 1},
                                                     "headers": {**headers, "Content-Type": "application/octet-stream"}}),
            ("POST", f"/v1/workers/{worker}/files/shared",
             {"json": {"id": "f_" + "2" * 28}, "params": {"task": task_id, "attempt": 1}, "headers": headers}),
            ("GET", f"/v1/workers/{worker}/files/{'f_' + '3' * 28}", {"params": {"task": task_id}, "headers": headers}),
        ]  # fmt: skip
        out = []
        for method, path, kwargs in calls:
            resp = tenants.call(token, method, path, **kwargs)
            out.append((resp.status_code, resp.text.replace(task_id, "ID")))
        return out

    assert answers(theirs) == answers(unknown)
    assert [status for status, _ in answers(theirs)] == [404, 404, 404]
