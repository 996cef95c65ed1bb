"""`POST /v1/tasks?wait=S`: a submission whose answer is the task once it ended (or after S seconds), so a
client that wants the result at once sends one request, not a submission and a result wait.

Each test runs the request through the fast path (a plain `?wait=20`) and through the route (`?wait=2e1`, a
form only the route takes): the two must answer alike."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.inprocess.conftest import Api, serve_api, task_reads
from turnout.config import ControllerSettings
from turnout.store import open_store

pytestmark = pytest.mark.anyio
FAST_AND_ROUTE = pytest.mark.parametrize("twenty", ["20", "2e1"], ids=["fast path", "route"])
BODY = {"capability": "shout", "input": {"text": "hi"}, "gpu": "never"}


@FAST_AND_ROUTE
async def test_the_answer_is_the_ended_task_and_nothing_is_read_before_its_result(
    api: Api, monkeypatch: pytest.MonkeyPatch, twenty: str
) -> None:
    api.service.recheck_s = 30.0  # no periodic look: only the task's own result can end the wait early
    reads = task_reads(api, monkeypatch)
    worker = await api.worker()
    # Given a client submitting with a wait
    waiting = asyncio.ensure_future(api.client.post("/v1/tasks", params={"wait": twenty}, json=BODY))
    lease: list[dict] = []  # type: ignore[type-arg]
    while not lease:  # the submission is committed once a lease finds it
        lease = (await worker.lease())["tasks"]
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    assert not waiting.done()
    # When its result comes in
    assert (await worker.complete(lease[0], {"text": "HI"}))["accepted"] == [lease[0]["id"]]
    resp = await asyncio.wait_for(waiting, 5)
    # Then the submission answers 201 with the task as it ended, read neither before its result nor after (the
    # result's commit read it back), and as a read gives it
    assert resp.status_code == 201, resp.text
    assert reads == []
    done = resp.json()
    assert (done["id"], done["state"], done["output"]) == (lease[0]["id"], "succeeded", {"text": "HI"})
    assert done == await api.task(done["id"])


@FAST_AND_ROUTE
async def test_a_task_that_does_not_end_in_time_is_answered_as_it_stands_after_the_wait(
    api: Api, twenty: str
) -> None:
    await api.worker()
    wait = "0.3" if twenty == "20" else "3e-1"
    started = asyncio.get_running_loop().time()
    resp = await api.client.post("/v1/tasks", params={"wait": wait}, json=BODY)
    elapsed = asyncio.get_running_loop().time() - started
    assert resp.status_code == 201, resp.text
    assert resp.json()["state"] in ("queued", "leased") and elapsed >= 0.3
    assert resp.json() == await api.task(resp.json()["id"])


@FAST_AND_ROUTE
async def test_a_cancel_ends_the_wait(api: Api, twenty: str) -> None:
    api.service.recheck_s = 30.0
    await api.worker()
    waiting = asyncio.ensure_future(api.client.post("/v1/tasks", params={"wait": twenty}, json=BODY))
    task_id = None
    while task_id is None:
        listed = (await api.client.get("/v1/tasks")).json()["tasks"]
        task_id = listed[0]["id"] if listed else None
        await asyncio.sleep(0.01)
    assert (await api.client.post(f"/v1/tasks/{task_id}/cancel")).status_code == 200
    resp = await asyncio.wait_for(waiting, 5)
    assert (resp.status_code, resp.json()["state"]) == (201, "cancelled")


@FAST_AND_ROUTE
async def test_an_idempotent_repeat_answers_the_first_task_ended_or_once_it_ends(
    api: Api, twenty: str
) -> None:
    api.service.recheck_s = 30.0
    worker = await api.worker()
    body = {**BODY, "idempotency_key": f"k-{twenty}"}
    first = (await api.client.post("/v1/tasks", json=body)).json()
    [lease] = (await worker.lease())["tasks"]
    # Given the first task running, a repeat with a wait waits for it (it may end any moment: it is read)
    waiting = asyncio.ensure_future(api.client.post("/v1/tasks", params={"wait": twenty}, json=body))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    assert (await worker.complete(lease, {"n": 1}))["accepted"] == [first["id"]]
    resp = await asyncio.wait_for(waiting, 5)
    assert (resp.status_code, resp.json()["id"], resp.json()["state"]) == (201, first["id"], "succeeded")
    # And once it ended, a repeat answers at once
    again = await asyncio.wait_for(api.client.post("/v1/tasks", params={"wait": twenty}, json=body), 5)
    assert (again.status_code, again.json()["id"], again.json()["state"]) == (201, first["id"], "succeeded")


@pytest.mark.parametrize("wait", ["-1", "nan", "inf", str(10**9), "soon", ""])
async def test_a_bad_wait_is_a_422_naming_it_and_submits_nothing(api: Api, wait: str) -> None:
    await api.worker()
    resp = await api.client.post("/v1/tasks", params={"wait": wait}, json=BODY)
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"]["field"] == "wait"
    assert (await api.client.get("/v1/tasks")).json()["tasks"] == []


async def test_on_sqlite_a_bare_number_in_and_out_answers_and_reads_back_exactly(tmp_path: Path) -> None:
    """A JSON column of SQLite would keep a bare number's text as a number (and `GET` would then fail to read
    the task): the submission's answer and every read give back what was sent and what the handler returned."""
    store = open_store(f"sqlite:///{tmp_path / 'turnout.db'}")
    try:
        async with serve_api(ControllerSettings(heartbeat_s=1.0), store, recheck_s=30.0) as api:
            worker = await api.worker()
            big = 12345678901234567890
            waiting = asyncio.ensure_future(
                api.client.post("/v1/tasks", params={"wait": 20}, json={**BODY, "input": big})
            )
            lease: list[dict] = []  # type: ignore[type-arg]
            while not lease:
                lease = (await worker.lease())["tasks"]
                await asyncio.sleep(0.01)
            assert lease[0]["input"] == big
            assert (await worker.complete(lease[0], 1e5))["accepted"] == [lease[0]["id"]]
            done = (await asyncio.wait_for(waiting, 5)).json()
            assert (done["input"], done["output"], repr(done["output"])) == (big, 1e5, "100000.0")
            read = await api.task(done["id"])
            assert read == done and repr(read["output"]) == "100000.0"
    finally:
        store.close()
