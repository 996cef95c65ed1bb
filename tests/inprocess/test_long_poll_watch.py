"""A long poll's list of what its worker runs is as old as the poll: tasks leased to the worker since (by its
other request, or chained after a stage it ran) are watched, so a cancel of one reaches the worker at once."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.inprocess.conftest import serve_api
from tests.inprocess.harness import Harness
from turnout.config import ControllerSettings
from turnout.models import new_id
from turnout.pipelines import parse_pipelines


def test_a_task_leased_after_the_polls_list_is_watched_and_its_cancel_answered() -> None:
    h = Harness()
    w = h.worker()
    task_id = h.submit()
    (lease,) = h.lease(w)  # by the worker's other request: the parked poll below never listed it

    parked = h.ctrl.lease(w, max_tasks=8, running=[])
    assert parked.fresh == (task_id,) and parked.cancel == []
    h.ctrl.cancel(None, task_id)

    watched = h.ctrl.lease(w, max_tasks=8, running=[], watching=parked.fresh)
    unwatched = h.ctrl.lease(w, max_tasks=8, running=[])

    assert watched.cancel == [lease.task.id]
    assert unwatched.cancel == []  # without the watch, the worker would hear only from its next poll


def test_a_listed_task_is_not_fresh() -> None:
    h = Harness()
    w = h.worker()
    task_id = h.submit()
    h.lease(w)
    assert h.ctrl.lease(w, max_tasks=8, running=[task_id]).fresh == ()


@pytest.mark.anyio
async def test_a_cancel_of_a_stage_chained_while_the_poll_was_parked_reaches_it_at_once() -> None:
    """The parked poll never looked after the chain was created (nothing woke it: the result freed room it did
    not need), so it cannot have learnt the stage as `fresh`; the hand-over itself is remembered for it."""
    two = parse_pipelines({"two": {"stages": [{"capability": "shout", "gpu": "never"}] * 2}})
    async with serve_api(ControllerSettings(heartbeat_s=1.0, pipelines=two), recheck_s=30.0) as api:
        worker = await api.worker()
        run = (await api.client.post("/v1/pipelines/two/runs", json={"input": {}})).json()
        [stage0] = (await worker.lease())["tasks"]
        assert [c["stage"] for c in stage0["chain"]] == [1]
        # Given a long poll parked, listing the one task its worker runs
        poll = asyncio.ensure_future(
            worker.post("lease", {"max_tasks": 8, "wait_s": 20, "running": [stage0["id"]]})
        )
        await asyncio.sleep(0.2)
        # When the worker reports stage 0 naming the stage it chained, which is then cancelled
        child = new_id("t_")
        result = {"task_id": stage0["id"], "attempt": stage0["attempt"], "status": "succeeded", "output": {},
                  "chain": child}  # fmt: skip
        answer = (await worker.post("complete", {"results": [result], "lease": {"max_tasks": 8}})).json()
        assert answer["chained"] == [child]
        await asyncio.sleep(0.1)
        assert not poll.done()
        started = time.monotonic()
        assert (await api.client.post(f"/v1/pipeline-runs/{run['id']}/cancel")).status_code == 200
        # Then the parked poll answers the cancel at once, not when its 20 s are over
        resp = await asyncio.wait_for(poll, 5)
        assert resp.json()["cancel"] == [child] and time.monotonic() - started < 2


@pytest.mark.anyio
async def test_a_hand_over_is_watched_until_reported_and_taken_once_per_poll() -> None:
    async with serve_api() as api:
        service = api.service
        start = time.monotonic()
        service.handed("w_1", ["t_a", "t_b"])
        service.handed("w_2", ["t_c"])
        service.reported("w_1", ["t_a"])  # its result came in: nothing to watch
        ids, upto = service.handed_since("w_1", start - 5, 0)
        assert ids == ["t_b"]
        assert service.handed_since("w_1", start - 5, upto) == ([], upto)  # a poll takes each once
        service.handed("w_1", ["t_d"])
        assert service.handed_since("w_1", start - 5, upto)[0] == ["t_d"]
        assert (
            service.handed_since("w_1", time.monotonic() + 1, 0)[0] == []
        )  # before the poll's list: not its
