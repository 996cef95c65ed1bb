"""A long poll's list of what its worker runs is as old as the poll: tasks leased to the worker since (by its
other request, or chained after a stage it ran) are watched, so a cancel of one reaches the worker at once."""

from __future__ import annotations

from tests.inprocess.harness import Harness


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
