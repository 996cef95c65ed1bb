"""A controller moves a pipeline run on from the copy it kept since it started or last moved it, unread; a copy
that fell behind the database (another controller's write, a transaction that rolled back) changes nothing,
and the run is read and moved on from what the database says. On SQLite and the memory store alike."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from bench.bench_pipelines import CONFIG  # noop3: three no-op stages, each `gpu: never`
from turnout.config import controller_settings
from turnout.controller import Controller
from turnout.models import Completion, Device, TaskState, Variant
from turnout.pipelines import RunState
from turnout.resources import parse_resources
from turnout.store import Store

NOOP = Variant("noop", Device.CPU, parse_resources({"cpu": 0.5}))


def controller(store: Store, tmp_path: Path) -> Controller:
    config = tmp_path / "turnout.yaml"
    config.write_text(CONFIG)
    return Controller(store, controller_settings(config))


def started(store: Store, ctrl: Controller) -> tuple[str, str, str]:
    """A worker, and a run whose first stage it leased: (worker id, run id, the first stage's task id)."""
    worker = ctrl.register_worker(name="w", host="h", variants=[NOOP], cpu=2.0, memory_bytes=2**33, gpus=[],
                                  strategy="pack").id  # fmt: skip
    with store.group():
        run, first = ctrl.runs.start("default", "noop3", {"n": 1})
    with store.group():
        [lease] = ctrl.offer(worker, max_tasks=4, running=[]).leases
    assert lease.task.id == first.id
    return worker, run.id, first.id


def succeeded(store: Store, ctrl: Controller, worker: str, task_id: str) -> list[str]:
    with store.group():
        done = ctrl.exchange(
            worker, [Completion(task_id, 1, True, {"m": 2}, run_s=0.01, started_at=time.time())]
        )
    return done.accepted


def test_a_kept_run_moves_on_without_a_read_and_queues_the_next_stage(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctrl = controller(store, tmp_path)
    worker, run_id, first = started(store, ctrl)
    reads: list[object] = []
    get_runs = ctrl.runs.store.get_runs
    monkeypatch.setattr(ctrl.runs.store, "get_runs", lambda ids: reads.append(ids) or get_runs(ids))
    # When the first stage's result comes in to the controller that started the run
    assert succeeded(store, ctrl, worker, first) == [first]
    assert reads == []  # moved on from its copy
    monkeypatch.undo()
    # Then the second stage is queued with the first's output, and the run lists both
    run = store.runs.get_run(run_id)
    assert run is not None and run.state is RunState.RUNNING and len(run.task_ids) == 2
    second = store.get_task(run.task_ids[1])
    assert second is not None and second.state is TaskState.QUEUED and second.spec.input == {"n": 1, "m": 2}


def test_a_kept_copy_another_controller_left_behind_changes_nothing(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a run this controller started (and so kept), which another controller then ended as failed
    ctrl = controller(store, tmp_path)
    worker, run_id, first = started(store, ctrl)
    other = controller(store, tmp_path)
    error = {"type": "failed", "message": "ended elsewhere"}
    with store.group():
        assert store.runs.update_run(
            run_id, 1, {"state": RunState.FAILED, "error": error, "finished_at": 1.0}
        )
    # When its first stage's result comes in here, to the controller whose copy still says running
    reads: list[object] = []
    get_runs = ctrl.runs.store.get_runs
    monkeypatch.setattr(ctrl.runs.store, "get_runs", lambda ids: reads.append(list(ids)) or get_runs(ids))
    assert succeeded(store, ctrl, worker, first) == [first]
    monkeypatch.undo()
    assert reads == [[run_id]]  # its write took no effect: the run was read again, and found ended
    # Then the run stays as the other controller left it, and no stage is queued after it
    run = store.runs.get_run(run_id)
    assert run is not None and (run.state, run.error, run.task_ids) == (RunState.FAILED, error, (first,))
    assert [t.id for t in store.queued_tasks(["noop"])] == []
    assert other.runs.get(None, run_id).state is RunState.FAILED


def test_a_kept_copy_ahead_of_the_database_is_read_again(store: Store, tmp_path: Path) -> None:
    # Given a kept copy that lists a stage the database never got (its transaction rolled back)
    ctrl = controller(store, tmp_path)
    worker, run_id, first = started(store, ctrl)
    kept = ctrl.runs._kept[run_id]
    ctrl.runs._kept[run_id] = replace(kept, task_ids=(first, "t_0123456789abcdef01234567"))
    # When the first stage's result comes in
    assert succeeded(store, ctrl, worker, first) == [first]
    # Then the run moves on as the database says: one new stage, queued, after the first
    run = store.runs.get_run(run_id)
    assert run is not None and run.state is RunState.RUNNING and len(run.task_ids) == 2
    assert run.task_ids[0] == first and run.task_ids[1] != "t_0123456789abcdef01234567"
    assert [t.id for t in store.queued_tasks(["noop"])] == [run.task_ids[1]]
