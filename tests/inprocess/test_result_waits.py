"""A result wait is woken by its own task's result, not by every result in the cluster: each wake costs a read
of the task, and with every wait woken by every result, waits cost reads in proportion to the cluster's work."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from tests.inprocess.conftest import Api, serve_api, task_reads
from tests.inprocess.harness import FakeClock
from turnout.access import ALL_TENANTS
from turnout.api.app import create_app
from turnout.api.service import Service
from turnout.auth import TokenBook
from turnout.config import ControllerSettings
from turnout.controller import Controller
from turnout.models import Role, new_id
from turnout.pipelines import parse_pipelines
from turnout.store import MemoryStore, open_store

pytestmark = pytest.mark.anyio


async def test_a_result_wait_reads_again_only_for_its_own_tasks_result(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    api.service.recheck_s = 30.0  # no periodic look: only a wake-up can end the wait early
    reads = task_reads(api, monkeypatch)
    worker = await api.worker()
    mine, other = await api.submit(gpu="never"), await api.submit(gpu="never")
    leases = {t["id"]: t for t in (await worker.lease())["tasks"]}
    # Given a client waiting for the result of `mine`
    waiting = asyncio.ensure_future(api.client.get(f"/v1/tasks/{mine['id']}/result", params={"wait": 20}))
    while not reads:
        await asyncio.sleep(0.01)
    # When another task's result comes in
    assert (await worker.complete(leases[other["id"]], {"n": 2}))["accepted"] == [other["id"]]
    await asyncio.sleep(0.2)
    # Then the wait did not read again
    assert reads == [mine["id"]] and not waiting.done()
    # And its own task's result answers it at once, with the task as the result's commit read it back: no
    # second read of its own
    started = time.monotonic()
    assert (await worker.complete(leases[mine["id"]], {"n": 1}))["accepted"] == [mine["id"]]
    done = (await asyncio.wait_for(waiting, 5)).json()
    assert (done["state"], done["output"]) == ("succeeded", {"n": 1})
    assert time.monotonic() - started < 5 and reads == [mine["id"]]
    assert done == await api.task(mine["id"])  # what a read gives
    assert not api.service._ended_tasks  # kept only while a wait is on it


async def test_an_ended_task_kept_for_its_waits_is_not_given_to_another_tenant(api: Api) -> None:
    # Given tenant acme's task ended while a wait is on it, its commit's read-back kept for that wait
    worker = await api.worker()
    acme = await api.token("submit", "acme")
    other = await api.token("read", "default")
    task = (await api.as_(acme, "POST", "/v1/tasks", json={"capability": "shout", "gpu": "never"})).json()
    [lease] = (await worker.lease())["tasks"]
    with api.service.watch_tasks([task["id"]]):
        assert (await worker.complete(lease, {"secret": 1}))["accepted"] == [task["id"]]
        assert api.service.ended_task(task["id"], "acme") is not None
        # When another tenant waits for it
        probe = await api.as_(other, "GET", f"/v1/tasks/{task['id']}/result", params={"wait": 5})
        # Then it answers 404, as for any task of another tenant; its own tenant gets it
        assert probe.status_code == 404, probe.text
        assert api.service.ended_task(task["id"], "default") is None
        mine = await api.as_(acme, "GET", f"/v1/tasks/{task['id']}/result", params={"wait": 5})
        assert mine.json()["output"] == {"secret": 1}
    assert api.service.ended_task(task["id"], "acme") is None  # gone with the last wait on it


async def test_a_result_wait_still_hears_a_cancel(api: Api) -> None:
    api.service.recheck_s = 30.0
    await api.worker()
    task = await api.submit(gpu="never")
    waiting = asyncio.ensure_future(api.client.get(f"/v1/tasks/{task['id']}/result", params={"wait": 20}))
    await asyncio.sleep(0.1)
    assert (await api.client.post(f"/v1/tasks/{task['id']}/cancel")).status_code == 200
    done = (await asyncio.wait_for(waiting, 5)).json()
    assert done["state"] == "cancelled"


async def test_a_pipeline_runs_wait_wakes_on_its_stages_results_alone() -> None:
    # Given the API with a two-stage pipeline, no periodic look (only a wake-up ends a wait early)
    store = MemoryStore()
    tokens = TokenBook(store)
    _, admin = tokens.create(Role.ADMIN, ALL_TENANTS)
    pipelines = parse_pipelines({"two": {"stages": [{"capability": "shout", "gpu": "never"}] * 2}})
    settings = ControllerSettings(heartbeat_s=1.0, pipelines=pipelines)
    service = Service(Controller(store, settings, clock=FakeClock()), tokens, recheck_s=30.0)
    app = create_app(service)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://turnout",
                                     headers={"Authorization": f"Bearer {admin}"}) as client:  # fmt: skip
            api = Api(client, service, FakeClock(), store)
            worker = await api.worker()
            resp = await client.post("/v1/pipelines/two/runs", json={"input": {"text": "hi"}})
            assert resp.status_code == 201, resp.text
            run_id = resp.json()["id"]
            waiting = asyncio.ensure_future(client.get(f"/v1/pipeline-runs/{run_id}", params={"wait": 20}))
            # When each stage's result comes in (the second stage queued by the first one's commit)
            for _ in range(2):
                [stage] = (await worker.lease())["tasks"]
                assert (await worker.complete(stage, {"text": "HI"}))["accepted"] == [stage["id"]]
            # Then the wait answers at once, not after its 30 s look, with the run as a read gives it
            run = (await asyncio.wait_for(waiting, 5)).json()
            assert run["state"] == "succeeded"
            assert run == (await client.get(f"/v1/pipeline-runs/{run_id}")).json()
            assert not service._ended_runs  # kept only while a wait is on it


async def test_waits_answer_on_sqlite_exactly_as_a_read_of_the_database_gives_it(tmp_path: Path) -> None:
    """The waits answer with the tasks and runs as the report's transaction wrote them, not read back: on a real
    database file, what they answer is what a read gives afterwards, for a task and for a run whose three
    stages ran chained on one worker and were settled from one report."""
    pipelines = parse_pipelines({"three": {"stages": [{"capability": "shout", "gpu": "never"}] * 3}})
    store = open_store(f"sqlite:///{tmp_path / 'turnout.db'}")
    try:
        settings = ControllerSettings(heartbeat_s=1.0, pipelines=pipelines)
        async with serve_api(settings, store, recheck_s=30.0) as api:
            worker = await api.worker()
            # a task
            task = await api.submit(gpu="never")
            waiting = asyncio.ensure_future(
                api.client.get(f"/v1/tasks/{task['id']}/result", params={"wait": 20})
            )
            [lease] = (await worker.lease())["tasks"]
            assert (await worker.complete(lease, {"n": [1, 2.5, "x"]}))["accepted"] == [task["id"]]
            done = (await asyncio.wait_for(waiting, 5)).json()
            assert done["state"] == "succeeded" and done == await api.task(task["id"])
            # a run, its stages chained on the worker
            resp = await api.client.post("/v1/pipelines/three/runs", json={"input": {"text": "hi"}})
            run_id = resp.json()["id"]
            waiting = asyncio.ensure_future(
                api.client.get(f"/v1/pipeline-runs/{run_id}", params={"wait": 20})
            )
            [stage] = (await worker.lease())["tasks"]
            assert [step["stage"] for step in stage["chain"]] == [1, 2]
            ids = [stage["id"], new_id("t_"), new_id("t_")]
            results = [{"task_id": tid, "attempt": 1, "status": "succeeded", "output": {f"s{i}": i}, "run_s": 0.25}
                       for i, tid in enumerate(ids)]  # fmt: skip
            results[0]["chain"], results[1]["chain"] = ids[1], ids[2]
            answer = (await worker.post("complete", {"results": results})).json()
            assert answer["accepted"] == ids and answer["chained"] == ids[1:]
            run = (await asyncio.wait_for(waiting, 5)).json()
            assert run["state"] == "succeeded" and [s["task_id"] for s in run["stages"]] == ids
            assert run == (await api.client.get(f"/v1/pipeline-runs/{run_id}")).json()
            assert not api.service._ended_runs and not api.service._ended_tasks
    finally:
        store.close()
