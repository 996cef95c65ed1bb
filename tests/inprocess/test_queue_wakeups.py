"""A new task wakes one parked lease poll that could take it, not every poll: each woken poll costs a lease (a
look at the queue on the database thread), and with all of them woken, all but one looked for nothing. A poll
that could not take the task passes the wake-up on, so no task waits for a poll's periodic look (here 30 s)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import pytest

from tests.inprocess.conftest import CPU_SHOUT, Api, Worker, serve_api
from turnout.access import ALL_TENANTS
from turnout.config import ControllerSettings
from turnout.pipelines import parse_pipelines
from turnout.tenancy import parse_limits

pytestmark = pytest.mark.anyio

CPU_OTHER = {"capability": "other", "device": "cpu", "resources": {"cpu": 1}}


@pytest.fixture
def looks(api: Api, monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How many times each worker's leases looked at the queue, with no periodic look (only a wake-up ends a
    poll early)."""
    api.service.recheck_s = 30.0
    counts: Counter[str] = Counter()
    offer = api.ctrl.offer

    def counted(worker_id: str, **ask: Any) -> Any:
        counts[worker_id] += 1
        return offer(worker_id, **ask)

    monkeypatch.setattr(api.ctrl, "offer", counted)
    return counts


async def park(worker: Worker, looks: Counter[str], running: list[str] | None = None) -> asyncio.Future[Any]:
    """A long poll of `worker` (wait 20 s), returned once it has looked once and parked."""
    before = looks[worker.id]
    body = {"max_tasks": 8, "wait_s": 20, "running": running or []}
    poll = asyncio.ensure_future(worker.post("lease", body))
    while looks[worker.id] == before:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # its answer (nothing) came back and it parked
    assert not poll.done()
    return poll


async def leased_ids(poll: asyncio.Future[Any]) -> list[str]:
    resp = await asyncio.wait_for(poll, 5)
    assert resp.status_code == 200, resp.text
    return [t["id"] for t in resp.json()["tasks"]]


async def test_a_new_task_wakes_one_parked_poll_not_all(api: Api, looks: Counter[str]) -> None:
    first, second = await api.worker(), await api.worker()
    # Given two idle workers' polls parked, each able to take the task
    poll_1, poll_2 = await park(first, looks), await park(second, looks)
    # When one task is submitted
    task = await api.submit(gpu="never")
    # Then the poll parked longest takes it, and the other poll did not look again
    assert await leased_ids(poll_1) == [task["id"]]
    await asyncio.sleep(0.2)
    assert looks[second.id] == 1 and not poll_2.done()
    # And the next task wakes it
    other = await api.submit(gpu="never")
    assert await leased_ids(poll_2) == [other["id"]]


async def test_a_poll_that_cannot_take_the_task_is_not_woken(api: Api, looks: Counter[str]) -> None:
    # Given the longest-parked poll is a worker's that offers another capability, or serves another tenant
    elsewhere = await api.worker(CPU_OTHER)
    token = await api.token("worker", "acme")
    body = {"name": "a", "host": "h", "variants": [CPU_SHOUT], "cpu": 4, "memory": 2**33, "gpus": [],
            "heartbeat_s": 1.0}  # fmt: skip
    resp = await api.as_(token, "POST", "/v1/workers/register", json=body)
    acme = Worker(api, resp.json()["id"], token, resp.json()["secret"])
    shared = await api.worker()
    polls = [await park(w, looks) for w in (elsewhere, acme, shared)]
    # When a task of tenant default is submitted
    task = await api.submit(gpu="never")
    # Then the shared worker's poll takes it, and neither other poll looked again
    assert await leased_ids(polls[2]) == [task["id"]]
    await asyncio.sleep(0.2)
    assert (looks[elsewhere.id], looks[acme.id]) == (1, 1)
    assert not polls[0].done() and not polls[1].done()


async def test_a_poll_with_no_room_for_the_task_passes_the_wake_up_on(api: Api, looks: Counter[str]) -> None:
    busy, idle = await api.worker(), await api.worker()
    # Given the longest-parked poll is a worker's with 2 of its 4 CPUs taken
    held = [await api.submit(gpu="never", resources={"cpu": 1}) for _ in range(2)]
    assert len((await busy.lease(max_tasks=2))["tasks"]) == 2
    poll_busy = await park(busy, looks, running=[t["id"] for t in held])
    poll_idle = await park(idle, looks)
    looked = looks[busy.id]
    # When a task asking 3 CPUs is submitted
    started = time.monotonic()
    task = await api.submit(gpu="never", resources={"cpu": 3})
    # Then the busy worker's poll looks, cannot fit it, and wakes the idle worker's, which takes it at once
    assert await leased_ids(poll_idle) == [task["id"]]
    assert time.monotonic() - started < 5 and looks[busy.id] == looked + 1 and not poll_busy.done()


async def test_a_wake_up_a_poll_did_not_look_at_goes_to_the_next(api: Api) -> None:
    service = api.service
    # Given two polls under way, the first woken for a new task
    first_poll, second_poll = service.queue_poll("w_1", ALL_TENANTS), service.queue_poll("w_2", ALL_TENANTS)
    first, second = first_poll.__enter__(), second_poll.__enter__()
    try:
        first.look(service.polls_epoch), second.look(service.polls_epoch)
        service.pass_on([("shout", "default", service.polls_epoch.count + 1)], second)
        assert first.event.is_set() and not second.event.is_set()
        # When the first ends (it answered its worker with other tasks) before it looked again
        first_poll.__exit__(None, None, None)
        # Then the second is woken for what the first was
        assert second.event.is_set()
        assert second.look(service.polls_epoch) == [("shout", "default", service.polls_epoch.count + 1)]
    finally:
        second_poll.__exit__(None, None, None)


async def test_a_result_wakes_its_workers_poll_only_where_freed_room_could_change_its_answer(
    api: Api, looks: Counter[str]
) -> None:
    worker = await api.worker()
    held = [await api.submit(gpu="never", resources={"cpu": 1}) for _ in range(3)]
    leases = {t["id"]: t for t in (await worker.lease(max_tasks=3))["tasks"]}
    # Given its poll parked with room to spare and nothing queued
    poll = await park(worker, looks, running=list(leases))
    looked = looks[worker.id]
    # When a result comes in (asking for no work)
    assert (await worker.complete(leases[held[0]["id"]], {"n": 1}))["accepted"] == [held[0]["id"]]
    await asyncio.sleep(0.2)
    # Then the poll did not look again: the room it had already let it take any new task
    assert looks[worker.id] == looked and not poll.done()
    # Given a task it has no room for (3 CPUs, 2 free), which its poll looked at and left queued
    big = await api.submit(gpu="never", resources={"cpu": 3})
    await asyncio.sleep(0.2)
    assert looks[worker.id] == looked + 1 and not poll.done()
    # When a result frees a CPU
    assert (await worker.complete(leases[held[1]["id"]], {"n": 2}))["accepted"] == [held[1]["id"]]
    # Then the poll looks again and takes it
    assert await leased_ids(poll) == [big["id"]]


@dataclass
class KeptRoom:
    """A shared worker of 4 CPUs keeping half for each tenant with work: the calm tenant submitted lately, and
    the hog's 2 tasks hold its half, so its poll parks with 2 CPUs free that the hog's backlog may not take."""

    api: Api
    worker: Worker
    looks: Counter[str]
    poll: asyncio.Future[Any]
    hog_leases: list[dict[str, Any]]
    tokens: dict[str, str]

    async def submit(self, tenant: str) -> dict[str, Any]:
        body = {"capability": "shout", "gpu": "never", "input": {}}
        resp = await self.api.as_(self.tokens[tenant], "POST", "/v1/tasks", json=body)
        assert resp.status_code == 201, resp.text
        return dict(resp.json())


@contextlib.asynccontextmanager
async def kept_room() -> AsyncIterator[KeptRoom]:
    limits = parse_limits({"*": {"submit_per_s": 1000, "reserved_share": 0.5}}, None)
    async with serve_api(ControllerSettings(heartbeat_s=1.0, tenant_limits=limits), recheck_s=30.0) as api:
        tokens = {tenant: await api.token("submit", tenant) for tenant in ("calm", "hog")}
        worker = await api.worker()
        room = KeptRoom(api, worker, Counter(), asyncio.get_running_loop().create_future(), [], tokens)
        await room.submit("calm")
        (calm_lease,) = (await worker.lease(max_tasks=1))["tasks"]
        await worker.complete(calm_lease, {"n": 0})
        for _ in range(3):
            await room.submit("hog")
        room.hog_leases = (await worker.lease())["tasks"]
        assert len(room.hog_leases) == 2
        offer = api.ctrl.offer

        def counted(worker_id: str, **ask: Any) -> Any:
            room.looks[worker_id] += 1
            return offer(worker_id, **ask)

        api.ctrl.offer = counted  # type: ignore[method-assign]
        room.poll = await park(worker, room.looks, running=[t["id"] for t in room.hog_leases])
        yield room


async def test_a_result_wakes_a_poll_whose_free_room_was_kept_for_another_tenant() -> None:
    async with kept_room() as room:
        # When one of the hog's tasks ends (its result asks for no work)
        await room.worker.complete(room.hog_leases[0], {"n": 1})
        # Then the poll looks again at once, and the hog may take the CPU that freed
        assert len(await leased_ids(room.poll)) == 1


async def test_a_poll_whose_room_is_kept_for_others_sleeps_through_a_flooding_tenants_tasks() -> None:
    async with kept_room() as room:
        looked = room.looks[room.worker.id]
        # When the hog floods: each new task of its could only be refused there
        for _ in range(20):
            await room.submit("hog")
        await asyncio.sleep(0.2)
        # Then the poll did not look again for any of them
        assert room.looks[room.worker.id] == looked and not room.poll.done()
        # And the calm tenant's next task is taken at once
        task = await room.submit("calm")
        assert await leased_ids(room.poll) == [task["id"]]


async def test_a_poll_after_an_answer_that_left_nothing_queued_parks_without_looking(
    api: Api, looks: Counter[str]
) -> None:
    worker = await api.worker()
    first = await api.submit(gpu="never")
    # Given a poll answered with the only task queued: the answer says `since`
    answer = (await worker.post("lease", {"max_tasks": 8, "wait_s": 0})).json()
    assert [t["id"] for t in answer["tasks"]] == [first["id"]] and answer["since"]
    looked = looks[worker.id]
    # When the worker polls again with it, and nothing has changed
    body = {"max_tasks": 8, "wait_s": 20, "running": [first["id"]], "since": answer["since"]}
    poll = asyncio.ensure_future(worker.post("lease", body))
    await asyncio.sleep(0.2)
    # Then the poll parked without looking at the queue
    assert looks[worker.id] == looked and not poll.done()
    # And a new task still reaches it at once
    second = await api.submit(gpu="never")
    assert await leased_ids(poll) == [second["id"]]


async def test_a_poll_whose_since_is_out_of_date_looks(api: Api) -> None:
    worker = await api.worker()
    await api.submit(gpu="never")
    answer = (await worker.post("lease", {"max_tasks": 8, "wait_s": 0})).json()
    # Given a task queued after the answer that gave `since` (or a `since` from another controller's boot)
    queued = await api.submit(gpu="never")
    for since in (answer["since"], "x" * 64):
        # When a poll sends it
        resp = await worker.post("lease", {"max_tasks": 1, "wait_s": 0, "since": since})
        # Then it looks, and finds what is queued
        assert resp.status_code == 200, resp.text
        if since == answer["since"]:
            assert [t["id"] for t in resp.json()["tasks"]] == [queued["id"]]
    # And a `since` that is no token at all is refused, naming the field
    resp = await worker.post("lease", {"max_tasks": 1, "wait_s": 0, "since": "x" * 65})
    assert resp.status_code == 422 and "since" in resp.text


async def test_a_task_no_poll_can_take_yet_costs_each_poll_one_look(api: Api, looks: Counter[str]) -> None:
    # Given two workers with 2 of their 4 CPUs taken, their polls parked
    workers = [await api.worker(), await api.worker()]
    for _ in range(4):
        await api.submit(gpu="never", resources={"cpu": 1})
    held = {w.id: [t["id"] for t in (await w.lease(max_tasks=2))["tasks"]] for w in workers}
    assert [len(ids) for ids in held.values()] == [2, 2]
    polls = [(w, await park(w, looks, running=held[w.id])) for w in workers]
    before = dict(looks)
    # When a task asking 3 CPUs is submitted: neither can take it now
    await api.submit(gpu="never", resources={"cpu": 3})
    await asyncio.sleep(0.3)
    # Then each poll looked once (the wake-up passed on, and not back), and both still wait
    assert {w.id: looks[w.id] - before[w.id] for w, _ in polls} == {w.id: 1 for w, _ in polls}
    assert not any(poll.done() for _, poll in polls)


async def test_a_pipelines_next_stage_wakes_one_parked_poll_not_all(
    api: Api, looks: Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    two = parse_pipelines({"two": {"stages": [{"capability": "shout", "gpu": "never"}] * 2}})
    monkeypatch.setattr(api.ctrl, "settings", replace(api.ctrl.settings, pipelines=two))
    runner, first, second = await api.worker(), await api.worker(), await api.worker()
    # Given a run's first stage leased, and two idle workers' polls parked
    run = await api.client.post("/v1/pipelines/two/runs", json={"input": {}})
    assert run.status_code == 201, run.text
    [stage0] = (await runner.lease())["tasks"]
    polls = [await park(first, looks), await park(second, looks)]
    # When its result (naming no chained stage) queues the second stage in the same commit
    assert (await runner.complete(stage0, {"a": 1}))["accepted"] == [stage0["id"]]
    # Then the poll parked longest takes it, and the other did not look again
    [stage1] = await leased_ids(polls[0])
    assert (await api.task(stage1))["labels"] == {"pipeline": "two", "stage": "1"}
    await asyncio.sleep(0.2)
    assert looks[second.id] == 1 and not polls[1].done()
