"""Pipeline runs on a bad day, in-process: a cancel that races another controller moving the run on, and the
cost of a run whose prices do not cover every device it ran on. Two controllers share one store, as replicas
share a database; the interleaving a race needs is made by running the other controller's commit between the
cancelling controller's reads."""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.console import Console

from tests.inprocess.test_run_copies import controller, started
from turnout.cli_runs import cost_table, stage_table
from turnout.config import Prices
from turnout.controller import Controller
from turnout.models import Completion, Device, Task, TaskSpec, TaskState
from turnout.pipelines import PipelineRun, RunState, run_costs
from turnout.store import Store


def succeed_on(store: Store, ctrl: Controller, worker: str, task_id: str) -> None:
    with store.group():
        ctrl.exchange(worker, [Completion(task_id, 1, True, {"m": 2}, run_s=0.01, started_at=time.time())])


def race(
    ctrl: Controller, monkeypatch: pytest.MonkeyPatch, between: Callable[[], None], *, after_read: bool
) -> None:
    """Run `between` (another controller's commit) inside `ctrl`'s first read of the run's stage tasks: before
    that read (`after_read=False`: the read sees the stage ended) or after it (the read saw it in flight)."""
    tasks_of = ctrl.runs.tasks_of
    calls = []

    def raced(run: PipelineRun) -> list[Task | None]:
        calls.append(run.id)
        if len(calls) > 1:
            return tasks_of(run)
        if not after_read:
            between()
            return tasks_of(run)
        found = tasks_of(run)
        between()
        return found

    monkeypatch.setattr(ctrl.runs, "tasks_of", raced)


@pytest.mark.parametrize(
    "after_read", [False, True], ids=["stage-ended-before-read", "stage-ended-after-read"]
)
def test_a_cancel_racing_another_controllers_move_on_cancels_the_run_and_the_stage_it_queued(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, after_read: bool
) -> None:
    # Given a run on controller A whose first stage is in flight, and a replica B that records its success
    ctrl = controller(store, tmp_path)
    worker, run_id, first = started(store, ctrl)
    other = controller(store, tmp_path)
    race(ctrl, monkeypatch, lambda: succeed_on(store, other, worker, first), after_read=after_read)
    # When the run is cancelled on A while B's commit (stage 0 succeeded, stage 1 queued) lands between A's reads
    with store.group():
        run = ctrl.runs.cancel("default", run_id)
    monkeypatch.undo()
    # Then the cancel answers the run cancelled (not a 409 about a stage task), and no stage is left to run
    assert run.state is RunState.CANCELLED
    stored = store.runs.get_run(run_id)
    assert stored is not None and stored.state is RunState.CANCELLED
    stages = [store.get_task(tid) for tid in stored.task_ids]
    assert all(t is not None and t.state.terminal for t in stages), [(t.id, t.state) for t in stages if t]
    assert [t.id for t in store.queued_tasks(["noop"])] == []


def _task(device: Device, run_s: float, cost: float | None) -> Task:
    return Task("t_x", "default", TaskSpec("noop", {}), TaskState.SUCCEEDED, 0.0, device=device, run_s=run_s,
                cost_usd=cost)  # fmt: skip


def test_a_run_with_a_stage_its_prices_do_not_cover_has_no_total_rather_than_a_partial_one() -> None:
    # Given prices for the GPU only, and runs whose CPU stages are therefore unpriced (cost None)
    prices = Prices(gpu=0.0015)
    all_cpu = [_task(Device.CPU, 2.0, None), _task(Device.CPU, 3.0, None)]
    mixed = [_task(Device.CPU, 2.0, None), _task(Device.GPU, 1.0, 0.0015)]
    # Then the run's cost is unknown: not $0 (a "100% saving"), nor the GPU stage's alone (CPU seconds free)
    assert run_costs(prices, all_cpu)[0] is None
    assert run_costs(prices, mixed)[0] is None
    # and a run whose every stage that ran is priced still totals as before
    assert run_costs(Prices(cpu=0.001, gpu=0.0015), [_task(Device.CPU, 2.0, 0.002)]) == (0.002, 0.003)


def test_the_run_display_shows_what_the_controller_sent_as_text_never_as_markup_or_terminal_codes() -> None:
    # Given a run whose stage ran on a worker that registered its GPU with markup and escape sequences in its
    # name, and whose routing reason holds a bracket
    stage = {"index": 0, "capability": "split", "state": "succeeded", "device": "gpu", "worker": "w_1\x1b[2J",
             "gpu_model": "Evil\x1b]0;pwned\x07\x1b[2J[/bold]", "queue_s": 0.1, "cold_start_s": None, "run_s": 0.2,
             "cost_usd": None, "reason": "x [/bold] y\nnext line"}  # fmt: skip
    run = {"pipeline": "p", "id": "r_1", "state": "succeeded", "stages": [stage], "run_s": 0.2, "cost_usd": None,
           "gpu_only_cost_usd": None}  # fmt: skip
    # When the live table and the bill are drawn on a terminal
    console = Console(file=io.StringIO(), force_terminal=True, width=300)
    console.print(stage_table(run))
    console.print(cost_table(run))
    shown = console.file.getvalue()  # type: ignore[attr-defined]
    # Then they are drawn (no MarkupError), the text is there as sent, and no control sequence but rich's own
    assert "[/bold]" in shown and "x [/bold] y" in shown
    assert "\x1b]0;" not in shown and "\x1b[2J" not in shown and "\x07" not in shown
