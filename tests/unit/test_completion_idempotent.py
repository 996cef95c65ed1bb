"""A worker that re-sends a result after reconnecting (the first answer was lost on the way) hears it
accepted again, and nothing changes; a different report for the same attempt is still refused."""

from __future__ import annotations

from pathlib import Path

from turnout.config import ControllerSettings
from turnout.controller import Controller
from turnout.models import Completion, Device, TaskSpec, TaskState, Variant
from turnout.resources import parse_resources
from turnout.store import open_store
from turnout.worker.agent import jittered


def test_a_result_sent_twice_is_accepted_twice_and_committed_once(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 't.db'}")
    try:
        ctrl = Controller(store, ControllerSettings())
        worker = ctrl.register_worker(name="w", host="h", variants=[Variant("c", Device.CPU, parse_resources({"cpu": 1}))],
                                      cpu=1.0, memory_bytes=2**30, gpus=[], strategy="pack")  # fmt: skip
        task = ctrl.submit("default", [TaskSpec(capability="c", input={})])[0]
        assert ctrl.lease(worker.id, max_tasks=1).leases
        first = Completion(task.id, 1, True, {"v": 1}, run_s=0.5)
        assert ctrl.complete(worker.id, [first]) == ([task.id], [])
        done = store.get_task(task.id)
        # When the same report arrives again
        assert ctrl.complete(worker.id, [first]) == ([task.id], [])
        # Then nothing changed; while a failure for that attempt, or a report of another attempt, is refused
        assert store.get_task(task.id) == done and done is not None and done.state is TaskState.SUCCEEDED
        failed = Completion(task.id, 1, False, error={"type": "handler_error", "message": "x"})
        assert ctrl.complete(worker.id, [failed]) == ([], [task.id])
        assert ctrl.complete(worker.id, [Completion(task.id, 2, True, {"v": 2})]) == ([], [task.id])
        assert store.get_task(task.id) == done
    finally:
        store.close()


def test_reconnect_delays_are_jittered_between_half_and_all_of_the_backoff() -> None:
    delays = [jittered(4.0) for _ in range(200)]
    assert all(2.0 <= d <= 4.0 for d in delays)
    assert max(delays) - min(delays) > 1.0  # spread out, not one instant for a whole fleet
