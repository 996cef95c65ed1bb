"""A task an idle worker waits for is leased in its submission's own commit (`Service.submit`): the parked
lease poll that the new task would wake looks at the queue right after the submission, in the same
transaction, so the task costs one fsync and no wake-up hop before its worker has it. What the look leaves
wakes other polls as before; a submission refused, or a look that fails, costs the other nothing."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from tests.inprocess.conftest import Api, Worker
from tests.inprocess.test_queue_wakeups import leased_ids
from turnout.errors import NotFound
from turnout.pipelines import parse_pipelines

pytestmark = pytest.mark.anyio


@pytest.fixture
def commits(api: Api, monkeypatch: pytest.MonkeyPatch) -> list[list[tuple[str, str]]]:
    """Each transaction the database thread ran, as the (call, worker or tenant) of the controller's
    submissions, run starts and lease looks in it; no periodic look (only a wake-up ends a poll early). Each
    commit takes 20 ms, as a disk's fsync might: the event loop runs on meanwhile, as in production."""
    api.service.recheck_s = 30.0
    groups: list[list[tuple[str, str]]] = []
    group = api.store.group

    @contextlib.contextmanager
    def counted() -> Iterator[Any]:
        groups.append([])
        with group() as conn:
            yield conn
            time.sleep(0.02)

    monkeypatch.setattr(api.store, "group", counted)
    for name, calls in (("submit", api.ctrl), ("offer", api.ctrl), ("start", api.ctrl.runs)):
        call = getattr(calls, name)

        def noted(first: str, *args: Any, _call: Any = call, _name: str = name, **kwargs: Any) -> Any:
            groups[-1].append((_name, first))
            return _call(first, *args, **kwargs)

        monkeypatch.setattr(calls, name, noted)
    return groups


async def park(worker: Worker, running: list[str] | None = None) -> asyncio.Future[Any]:
    """A long poll of `worker` (wait 20 s), returned once it has looked and parked waiting for new tasks, its
    next look ready for a submission to make (the service's polls under way, read in-process)."""
    poll = asyncio.ensure_future(
        worker.post("lease", {"max_tasks": 8, "wait_s": 20, "running": running or []})
    )
    deadline = time.monotonic() + 10
    while not any(p.worker_id == worker.id and p.ask is not None for p in worker.api.service._polls):
        assert time.monotonic() < deadline and not poll.done(), "the poll never parked"
        await asyncio.sleep(0.01)
    return poll


def looks_of(worker: Worker, commits: list[list[tuple[str, str]]]) -> int:
    return sum(g.count(("offer", worker.id)) for g in commits)


async def test_an_idle_workers_poll_leases_a_new_task_in_the_submissions_commit(
    api: Api, commits: list[list[tuple[str, str]]]
) -> None:
    worker = await api.worker()
    # Given an idle worker's poll parked
    poll = await park(worker)
    before = len(commits)
    # When a task is submitted
    task = await api.submit(gpu="never")
    # Then the poll answers with it, leased in the submission's transaction: one commit, not two
    assert await leased_ids(poll) == [task["id"]]
    assert commits[before:] == [[("submit", "default"), ("offer", worker.id)]]
    assert (await api.task(task["id"]))["state"] == "leased"


async def test_a_pipeline_runs_first_stage_is_leased_in_the_runs_commit(
    api: Api, commits: list[list[tuple[str, str]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    two = parse_pipelines({"two": {"stages": [{"capability": "shout", "gpu": "never"}] * 2}})
    monkeypatch.setattr(api.ctrl, "settings", replace(api.ctrl.settings, pipelines=two))
    worker = await api.worker()
    poll = await park(worker)
    before = len(commits)
    # When a run starts
    run = await api.client.post("/v1/pipelines/two/runs", json={"input": {}})
    assert run.status_code == 201, run.text
    # Then its first stage goes to the parked poll in the run's own commit
    [stage0] = await leased_ids(poll)
    assert (await api.task(stage0))["labels"] == {"pipeline": "two", "stage": "0"}
    assert commits[before:] == [[("start", "default"), ("offer", worker.id)]]


async def test_a_task_the_look_leaves_wakes_the_next_poll_not_the_one_that_looked(
    api: Api, commits: list[list[tuple[str, str]]]
) -> None:
    small, big = await api.worker(), await api.worker()
    # Given the longest-parked poll is a worker's with 3 of its 4 CPUs taken, and an idle one's after it
    held = await api.submit(gpu="never", resources={"cpu": 3})
    assert [t["id"] for t in (await small.lease(max_tasks=1))["tasks"]] == [held["id"]]
    poll_small = await park(small, running=[held["id"]])
    poll_big = await park(big)
    small_looks = looks_of(small, commits)
    # When a task asking 2 CPUs is submitted
    task = await api.submit(gpu="never", resources={"cpu": 2})
    # Then the busy worker's poll looked in the submission's commit and left it; the idle one's takes it
    assert await leased_ids(poll_big) == [task["id"]]
    await asyncio.sleep(0.2)
    assert looks_of(small, commits) == small_looks + 1 and not poll_small.done()


async def test_a_refused_submission_leaves_the_poll_that_looked_for_it_waiting(
    api: Api, commits: list[list[tuple[str, str]]]
) -> None:
    worker = await api.worker()
    first = await api.submit(gpu="never", idempotency_key="k1")
    [lease] = (await worker.lease())["tasks"]
    assert lease["id"] == first["id"]
    await worker.complete(lease, {"ok": True})
    poll = await park(worker)
    before = len(commits)
    # When a submission is refused inside its transaction (its key names another request)
    resp = await api.client.post(
        "/v1/tasks", json={"capability": "shout", "input": {"text": "other"}, "idempotency_key": "k1"}
    )
    assert resp.status_code == 409, resp.text
    # Then nothing of it is kept; the poll looked in that commit, found nothing, and waits on
    assert commits[before:] == [[("submit", "default"), ("offer", worker.id)]]
    await asyncio.sleep(0.1)
    assert not poll.done()
    # And the next task reaches it
    task = await api.submit(gpu="never")
    assert await leased_ids(poll) == [task["id"]]


async def test_a_look_that_fails_fails_its_poll_and_not_the_submission(
    api: Api, commits: list[list[tuple[str, str]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    gone, other = await api.worker(), await api.worker()
    poll_gone = await park(gone)
    poll_other = await park(other)
    # Given the longest-parked poll's next look fails (its worker left as the look ran)
    offer = api.ctrl.offer

    def failing(worker_id: str, *args: Any, **kwargs: Any) -> Any:
        if worker_id == gone.id:
            raise NotFound(f"worker {worker_id} has left; register again", field="worker")
        return offer(worker_id, *args, **kwargs)

    monkeypatch.setattr(api.ctrl, "offer", failing)
    # When a task is submitted
    task = await api.submit(gpu="never")
    # Then the submission stands, the failing poll hears its own error, and the next poll takes the task
    resp = await asyncio.wait_for(poll_gone, 5)
    assert resp.status_code == 404 and "has left" in resp.text
    assert await leased_ids(poll_other) == [task["id"]]


async def test_a_poll_whose_worker_went_before_its_look_ran_is_leased_nothing(
    api: Api, commits: list[list[tuple[str, str]]]
) -> None:
    worker = await api.worker()
    poll = await park(worker)
    # Given the database thread busy for a moment, and a task submitted meanwhile (its look for the poll waits)
    busy = asyncio.ensure_future(api.service.call(time.sleep, 0.3))
    await asyncio.sleep(0.05)
    submitted = asyncio.ensure_future(api.submit(gpu="never"))
    await asyncio.sleep(0.05)
    assert not submitted.done()
    # When the poll's request ends before its look runs (its worker's connection closed)
    poll.cancel()
    task = await asyncio.wait_for(submitted, 5)
    await busy
    # Then the task was leased to nobody: it is queued, and the worker's next poll takes it
    assert (await api.task(task["id"]))["state"] == "queued"
    assert [t["id"] for t in (await worker.lease())["tasks"]] == [task["id"]]
