"""The HTTP contract: validation errors name the field, tokens gate everything but /healthz, tenants are apart."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import Cluster

APP = "tests.apps.testapp:app"


@pytest.fixture(scope="module")
def api(shared_cluster: Cluster) -> Cluster:
    shared_cluster.start_worker(APP, gpus="fake:1x24Gi", name="api-worker")
    return shared_cluster


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"capability": "count", "colour": "red"}, "colour"),
        ({"capability": "count", "resources": {"memory": "8Gx"}}, "resources.memory"),
        ({"capability": "count", "resources": {"gpu": 1.5}}, "resources.gpu"),
        ({"capability": "count", "resources": {"gpu": -1}}, "resources.gpu"),
        ({"capability": "Bad Name"}, "capability"),
        ({"capability": "count", "gpu": "sometimes"}, "gpu"),
        ({"capability": "count", "timeout_s": -3}, "timeout_s"),
        ({"input": {}}, "capability"),
    ],
)
def test_bad_submissions_are_422_naming_the_field(api: Cluster, body: dict, field: str) -> None:
    resp = api.api("POST", "/v1/tasks", json=body)
    assert resp.status_code == 422
    err = resp.json()["error"]
    assert err["field"] == field
    assert err["type"] == "invalid_input"


def test_batch_errors_name_the_task_index(api: Cluster) -> None:
    body = {"tasks": [{"capability": "count"}, {"capability": "count", "resources": {"memory": "lots"}}]}
    resp = api.api("POST", "/v1/tasks/batch", json=body)
    assert resp.status_code == 422
    assert resp.json()["error"]["field"] == "tasks.1.resources.memory"
    assert (
        api.api("POST", "/v1/tasks/batch", json={"tasks": [{"capability": "count", "bogus": 1}]}).json()[
            "error"
        ]["field"]
        == "tasks.0.bogus"
    )


def test_malformed_json_is_a_422_not_a_500(api: Cluster) -> None:
    resp = httpx.post(f"{api.url}/v1/tasks", content=b"{not json", headers={"Authorization": f"Bearer {api.token}",
                                                                             "Content-Type": "application/json"})  # fmt: skip
    assert resp.status_code == 422
    assert resp.json()["error"]["type"] == "invalid_input"


def test_batch_answers_tasks_in_the_order_submitted(api: Cluster) -> None:
    body = {"tasks": [{"capability": "count", "input": {"n": i}} for i in range(20)]}
    tasks = api.api("POST", "/v1/tasks/batch", json=body).json()["tasks"]
    assert [t["input"]["n"] for t in tasks] == list(range(20))
    assert [api.result(t["id"])["output"]["n"] for t in tasks] == list(range(20))


def test_the_same_idempotency_key_returns_the_first_task(api: Cluster) -> None:
    first = api.submit("count", {"n": 1}, idempotency_key="order-42")
    # the same body again (another body under the key is a 409: test_api_hardening.py)
    again = api.submit("count", {"n": 1}, idempotency_key="order-42")
    assert again["id"] == first["id"]
    assert again["input"] == {"n": 1}


def test_every_endpoint_but_healthz_needs_a_token(api: Cluster) -> None:
    assert httpx.get(f"{api.url}/healthz").status_code == 200
    for method, path in [("GET", "/v1/tasks"), ("POST", "/v1/tasks"), ("GET", "/v1/workers"),
                         ("GET", "/v1/capabilities"), ("POST", "/v1/workers/register")]:  # fmt: skip
        resp = httpx.request(method, f"{api.url}{path}", json={})
        assert resp.status_code == 401, path
        assert resp.json()["error"]["type"] == "unauthorized"
    bad = httpx.get(f"{api.url}/v1/tasks", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401


def test_a_tenant_sees_only_its_own_tasks_and_workers_cannot_submit(api: Cluster) -> None:
    acme = api.api("POST", "/v1/tokens", json={"role": "submit", "tenant": "acme"}).json()
    other = api.api("POST", "/v1/tokens", json={"role": "submit", "tenant": "other"}).json()
    worker = api.api("POST", "/v1/tokens", json={"role": "worker", "tenant": "default"}).json()
    h = lambda tok: {"Authorization": f"Bearer {tok['token']}"}  # noqa: E731
    mine = httpx.post(f"{api.url}/v1/tasks", json={"capability": "count"}, headers=h(acme)).json()
    assert httpx.get(f"{api.url}/v1/tasks/{mine['id']}", headers=h(acme)).status_code == 200
    assert httpx.get(f"{api.url}/v1/tasks/{mine['id']}", headers=h(other)).status_code == 404
    assert httpx.post(f"{api.url}/v1/tasks/{mine['id']}/cancel", headers=h(other)).status_code == 404
    listed = httpx.get(f"{api.url}/v1/tasks", headers=h(other)).json()["tasks"]
    assert mine["id"] not in {t["id"] for t in listed}
    assert (
        httpx.post(f"{api.url}/v1/tasks", json={"capability": "count"}, headers=h(worker)).status_code == 403
    )
    kinds = {r["kind"] for r in api.api("GET", "/v1/audit").json()["audit"]}
    assert {"token_created", "worker_registered"} <= kinds


def test_unknown_task_is_404_with_an_error_body(api: Cluster) -> None:
    resp = api.api("GET", "/v1/tasks/t_nope")
    assert resp.status_code == 404
    assert resp.json()["error"]["type"] == "not_found"


def test_cancel_of_a_running_task_kills_its_process(api: Cluster, tmp_path) -> None:
    import time

    from tests.conftest import pid_alive

    pidfile = tmp_path / "pids"
    task = api.submit("spawn", {"pidfile": str(pidfile)})
    deadline = time.monotonic() + 20
    while not pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    handler, child = (int(x) for x in pidfile.read_text().split())
    assert api.api("POST", f"/v1/tasks/{task['id']}/cancel").json()["state"] == "cancelled"
    deadline = time.monotonic() + 10
    while (pid_alive(handler) or pid_alive(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(handler) and not pid_alive(child)
    assert api.api("POST", f"/v1/tasks/{task['id']}/cancel").status_code == 409
    assert api.result(api.submit("count", {"n": 7})["id"])["state"] == "succeeded"  # the worker serves on


def test_timeout_fails_the_task_and_kills_the_process_tree(api: Cluster, tmp_path) -> None:
    task = api.submit("spawn", {"pidfile": str(tmp_path / "p")}, timeout_s=1, max_retries=0)
    done = api.result(task["id"], wait=20)
    assert done["state"] == "failed"
    assert done["error"]["type"] == "timeout"


def test_a_handler_exception_fails_the_task_with_its_message(api: Cluster) -> None:
    done = api.result(api.submit("boom", {})["id"])
    assert done["state"] == "failed"
    assert done["error"]["type"] == "handler_error"
    assert "boom" in done["error"]["message"]


def test_capabilities_and_workers_list_variants_and_gpus(api: Cluster) -> None:
    caps = {c["name"]: c for c in api.api("GET", "/v1/capabilities").json()["capabilities"]}
    assert {v["device"] for v in caps["work"]["variants"]} == {"cpu", "gpu"}
    workers = api.api("GET", "/v1/workers").json()["workers"]
    w = next(w for w in workers if w["name"] == "api-worker")
    assert w["gpus"][0]["memory_total_bytes"] == 24 * 2**30
    drained = api.api("POST", f"/v1/workers/{w['id']}/drain").json()
    assert drained["state"] == "draining"


def test_malformed_worker_events_are_422_naming_the_event(api: Cluster) -> None:
    reg = api.api("POST", "/v1/workers/register", json={"name": "events-probe", "host": "h", "variants": [],
                                                       "cpu": 1, "memory": 0}).json()  # fmt: skip
    me = {"Authorization": f"Bearer {api.token}", "X-Worker-Secret": reg["secret"]}
    bad = {
        "events": [
            {"task_id": "t_x", "attempt": 1, "event": {"event": "log"}},
            {"task_id": "t_x", "attempt": 0, "event": {}},
        ]
    }
    resp = httpx.post(f"{api.url}/v1/workers/{reg['id']}/events", json=bad, headers=me)
    assert resp.status_code == 422
    assert resp.json()["error"]["field"] == "events.1"
    assert httpx.post(f"{api.url}/v1/workers/{reg['id']}/events", content=b"[", headers=me).status_code == 422
