"""The task lifecycle through the HTTP API, in-process (conftest.py): the worker protocol spoken by the test,
lease expiry by moving the controller's clock and running the sweep, never by sleeping."""

from __future__ import annotations

import json

import pytest

from tests.inprocess.conftest import GPU_SHOUT, Api, Worker

pytestmark = pytest.mark.anyio


async def test_a_task_runs_through_the_worker_protocol_and_its_events_stream(api: Api) -> None:
    worker = await api.worker()
    task = await api.submit(gpu="never")
    [leased] = (await worker.lease())["tasks"]
    assert (leased["id"], leased["attempt"], leased["device"]) == (task["id"], 1, "cpu")
    events = [{"task_id": task["id"], "attempt": 1, "event": {"event": "text_delta", "delta": "H"}},
              {"task_id": task["id"], "attempt": 1, "event": {"event": "progress", "done": 1, "total": 1}}]  # fmt: skip
    assert (await worker.post("events", {"events": events})).json() == {"stored": 2}
    assert await worker.complete(leased, {"text": "HI"}) == {"accepted": [task["id"]], "refused": []}
    done = (await api.client.get(f"/v1/tasks/{task['id']}/result", params={"wait": 5})).json()
    assert (done["state"], done["output"], done["worker"]) == ("succeeded", {"text": "HI"}, worker.id)
    stream = await api.client.get(f"/v1/tasks/{task['id']}/events")
    frames = [
        json.loads(line[len("data: ") :]) for line in stream.text.splitlines() if line.startswith("data: ")
    ]
    assert [(f["seq"], f["event"]) for f in frames] == [(1, "text_delta"), (2, "progress"), (3, "finish")]


async def test_a_lease_expires_when_the_clock_passes_three_heartbeats_and_a_late_result_is_refused(
    api: Api,
) -> None:
    lost, alive = await api.worker(), await api.worker()
    task = await api.submit(gpu="never", max_retries=1)
    [old] = (await lost.lease())["tasks"]
    # When three heartbeats pass on the controller's clock with `lost` silent (and `alive` heartbeating)
    for _ in range(4):
        api.clock.advance(1.0)
        await alive.heartbeat()
    await api.sweep()
    back = await api.task(task["id"])
    assert (back["state"], back["attempts"]) == ("queued", 1)
    workers = {w["id"]: w["state"] for w in (await api.client.get("/v1/workers")).json()["workers"]}
    assert workers == {lost.id: "unhealthy", alive.id: "healthy"}
    # Then another worker runs it as attempt 2, and the lost worker's late result is refused
    [new] = (await alive.lease())["tasks"]
    assert (new["id"], new["attempt"]) == (task["id"], 2)
    assert await lost.complete(old, {"by": "lost"}) == {"accepted": [], "refused": [task["id"]]}
    assert await alive.complete(new, {"by": "alive"}) == {"accepted": [task["id"]], "refused": []}
    assert (await api.task(task["id"]))["output"] == {"by": "alive"}


async def test_a_cancelled_task_is_stopped_on_its_worker_and_never_leased_again(api: Api) -> None:
    worker = await api.worker()
    task = await api.submit(gpu="never")
    await worker.lease()
    cancelled = (await api.client.post(f"/v1/tasks/{task['id']}/cancel")).json()
    assert (cancelled["state"], cancelled["error"]["type"]) == ("cancelled", "cancelled")
    answer = await worker.lease(running=[task["id"]])
    assert (answer["tasks"], answer["cancel"]) == ([], [task["id"]])
    again = await api.client.post(f"/v1/tasks/{task['id']}/cancel")
    assert (again.status_code, again.json()["error"]["field"]) == (409, "id")


async def test_a_task_past_its_timeout_fails_on_the_sweep_and_its_gpu_is_released(api: Api) -> None:
    worker = await api.worker(GPU_SHOUT, gpus=1)
    task = await api.submit(gpu="require", timeout_s=5)
    [leased] = (await worker.lease())["tasks"]
    assert leased["gpus"]["uuids"] == ["GPU-fake-0"]
    for _ in range(7):  # timeout_s and one heartbeat's grace, on the controller's clock
        api.clock.advance(1.0)
        await worker.heartbeat()
    await api.sweep()
    failed = await api.task(task["id"])
    assert (failed["state"], failed["error"]["type"]) == ("failed", "timeout")
    audit = (await api.client.get("/v1/audit", params={"kind": "gpu_released"})).json()
    assert [(r["task"], r["gpus"]) for r in audit["audit"]] == [(task["id"], ["GPU-fake-0"])]


async def test_one_tenants_task_is_not_found_by_another(api: Api) -> None:
    await api.worker()
    acme, globex = await api.token(tenant="acme"), await api.token(tenant="globex")
    resp = await api.as_(acme, "POST", "/v1/tasks", json={"capability": "shout", "input": {}})
    assert resp.status_code == 201, resp.text
    task_id = resp.json()["id"]
    assert (await api.as_(acme, "GET", f"/v1/tasks/{task_id}")).status_code == 200
    theirs = await api.as_(globex, "GET", f"/v1/tasks/{task_id}")
    assert (theirs.status_code, theirs.json()["error"]["type"]) == (404, "not_found")
    assert (await api.as_(globex, "POST", f"/v1/tasks/{task_id}/cancel")).status_code == 404
    assert (await api.as_(globex, "GET", "/v1/tasks")).json()["tasks"] == []


async def test_require_without_a_gpu_worker_fails_no_capacity_after_placement_timeout(api: Api) -> None:
    await api.worker()  # a CPU worker only
    task = await api.submit(gpu="require", placement_timeout_s=1)
    await api.sweep()  # nobody can serve it: its placement clock starts
    assert (await api.task(task["id"]))["state"] == "queued"
    api.clock.advance(1.0)
    await api.sweep()
    done = (await api.client.get(f"/v1/tasks/{task['id']}/result", params={"wait": 5})).json()
    assert (done["state"], done["error"]["type"], done["attempts"]) == ("failed", "no_capacity", 0)


async def test_another_tenants_private_worker_neither_tells_its_capabilities_nor_holds_a_tenants_tasks(
    api: Api,
) -> None:
    # globex runs a private worker serving `globexonly` (and a GPU, for `prefer`); nobody else serves it
    token = await api.token("worker", "globex")
    body = {"name": "private", "host": "h", "cpu": 4, "memory": 2**33, "heartbeat_s": 1.0,
            "gpus": [{"index": 0, "uuid": "GPU-globex", "name": "Fake H100", "memory_total_bytes": 80 * 2**30}],
            "variants": [{"capability": "globexonly", "device": "cpu", "resources": {"cpu": 1}},
                         {"capability": "shout", "device": "gpu", "resources": {"cpu": 1, "gpu": 1}}]}  # fmt: skip
    resp = await api.as_(token, "POST", "/v1/workers/register", json=body)
    assert resp.status_code == 201, resp.text
    private = Worker(api, resp.json()["id"], token, resp.json()["secret"])
    shared = await api.worker()  # every tenant's CPU worker for `shout`
    acme, globex = await api.token("submit", "acme"), await api.token("submit", "globex")

    # acme is told of `globexonly` what it is told of a name nobody registered
    answers = []
    for name in ("globexonly", "globexonlz"):
        refused = await api.as_(acme, "POST", "/v1/tasks", json={"capability": name})
        assert refused.status_code == 422, refused.text
        answers.append(refused.json()["error"]["message"].replace(name, "NAME"))
    assert answers[0] == answers[1] and "globex" not in answers[0]
    assert (await api.as_(globex, "POST", "/v1/tasks", json={"capability": "globexonly"})).status_code == 201

    # acme's task that waits for capacity fails no_capacity on time, though globex's worker stays healthy
    waiting = await api.as_(
        acme, "POST", "/v1/tasks", json={"capability": "globexonly", "placement_timeout_s": 2}
    )
    assert waiting.status_code == 201, waiting.text
    await api.sweep()
    for _ in range(3):
        api.clock.advance(1.0)
        await private.heartbeat()
        await shared.heartbeat()
        await api.sweep()
    done = (await api.client.get(f"/v1/tasks/{waiting.json()['id']}")).json()
    assert (done["state"], done["error"]["type"]) == ("failed", "no_capacity")
    mine = (await api.as_(globex, "GET", "/v1/tasks")).json()["tasks"]
    assert [t["state"] for t in mine] == ["queued"]  # globex's own, servable by its worker, waits on

    # acme's `prefer` task does not wait for globex's GPU: no GPU worker serves acme, so the CPU at once
    preferred = await api.as_(acme, "POST", "/v1/tasks", json={"capability": "shout", "gpu": "prefer"})
    (leased,) = (await shared.lease())["tasks"]
    assert leased["id"] == preferred.json()["id"] and leased["device"] == "cpu"
    routed = (await api.client.get(f"/v1/tasks/{leased['id']}")).json()["routing"]
    assert "no healthy gpu worker" in routed["reason"], routed
