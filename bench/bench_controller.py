"""The controller's own CPU per call, in-process on a real SQLite file (fsync'd): no HTTP, no worker process.

What one no-op task costs the controller (its submission, its lease, its result, each a commit of its own, as
the API runs them: `store.group()`), next to a 3-stage no-op pipeline run whose stages chain on the worker that
ran the first (the run's start, the first stage's lease with its chain hints, and one report carrying the three
results). And what a lease costs a worker that holds 64 tasks (as `--prefetch auto` may), by the size of their
inputs (none, 10 kB, 100 kB each), with nothing queued: the room is made of what the worker holds. CPU time of this process (`time.process_time`), so a busy host or a slow disk moves it less than wall
time; p50 over the calls after a warm-up fifth. Equal work: the same store, the same worker, alternated.

    python -m bench --only controller [--quick]
    from bench.bench_controller import run     run(quick=False) -> dict
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from bench.bench_pipelines import CONFIG
from turnout.config import ControllerSettings, controller_settings
from turnout.controller import Controller
from turnout.models import Completion, Device, TaskSpec, Variant, new_id
from turnout.resources import parse_resources
from turnout.store import Store, open_store

NAME = "controller"
T = TypeVar("T")
STEPS = ("single.submit", "single.lease", "single.result", "run.start", "run.lease", "run.results")


def run(quick: bool = False) -> dict[str, Any]:
    n = 100 if quick else 400
    with tempfile.TemporaryDirectory(prefix="turnout-bench-controller-") as tmp:
        (Path(tmp) / "turnout.yaml").write_text(CONFIG)
        store = open_store(f"sqlite:///{tmp}/turnout.db")
        try:
            return _measure(store, controller_settings(Path(tmp) / "turnout.yaml"), n)
        finally:
            store.close()


def _measure(store: Store, settings: ControllerSettings, n: int) -> dict[str, Any]:
    ctrl = Controller(store, settings)
    noop = Variant("noop", Device.CPU, parse_resources({"cpu": 0.1}))
    worker = ctrl.register_worker(name="w", host="h", variants=[noop], cpu=2.0, memory_bytes=8 * 2**30, gpus=[],
                                  strategy="pack").id  # fmt: skip

    def committed(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        with store.group():
            return fn(*args, **kwargs)

    cpu: dict[str, list[float]] = {step: [] for step in STEPS}

    def timed(step: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        started = time.process_time()
        out = committed(fn, *args, **kwargs)
        cpu[step].append(time.process_time() - started)
        return out

    for _ in range(n):
        task = timed("single.submit", ctrl.submit, "default", [TaskSpec("noop", None)])[0]
        (lease,) = timed("single.lease", ctrl.offer, worker, max_tasks=4, running=[]).leases
        assert lease.task.id == task.id
        result = Completion(task.id, 1, True, None, run_s=0.0003, started_at=time.time())
        timed("single.result", ctrl.exchange, worker, [result], None, watched=lambda _: True)

        _, first = timed("run.start", ctrl.runs.start, "default", "noop3", {})
        (lease,) = timed("run.lease", ctrl.offer, worker, max_tasks=4, running=[]).leases
        assert lease.task.id == first.id and len(lease.chain) == 2, lease
        second, third, now = new_id("t_"), new_id("t_"), time.time()
        results = [Completion(first.id, 1, True, {}, run_s=0.0003, started_at=now, chain=second),
                   Completion(second, 1, True, {}, run_s=0.0003, started_at=now + 0.0005, chain=third),
                   Completion(third, 1, True, {}, run_s=0.0003, started_at=now + 0.001)]  # fmt: skip
        done = timed("run.results", ctrl.exchange, worker, results, None, watched=lambda _: True)
        assert len(done.accepted) == 3 and done.ended_runs, done
    skip = n // 5
    p50 = {step: round(statistics.median(values[skip:]) * 1000, 3) for step, values in cpu.items()}
    single = sum(p50[s] for s in STEPS[:3])
    pipeline = sum(p50[s] for s in STEPS[3:])
    held = {
        f"{size // 1000}kB" if size else "none": _held_lease_ms(ctrl, noop, size, n // 4)
        for size in HELD_INPUTS
    }
    return {"tasks": n, "runs": n, "cpu_p50_ms": p50, "single_task_ms": round(single, 3),
            "pipeline_run_ms": round(pipeline, 3), "run_over_task": round(pipeline / single, 2),
            "lease_64_held_p50_ms": held}  # fmt: skip


HELD_INPUTS = (0, 10_000, 100_000)  # bytes of input per task held


def _held_lease_ms(ctrl: Controller, variant: Variant, input_bytes: int, n: int) -> float:
    """CPU p50 of a lease of a worker holding 64 tasks (two running, the rest waiting), nothing queued."""
    worker = ctrl.register_worker(name=f"held-{input_bytes}", host="h", variants=[variant], cpu=0.2,
                                  memory_bytes=8 * 2**30, gpus=[], strategy="pack").id  # fmt: skip
    data = {"text": "x" * input_bytes} if input_bytes else None
    with ctrl.store.group():
        ctrl.submit("default", [TaskSpec("noop", data) for _ in range(64)])
    with ctrl.store.group():
        held = [le.task.id for le in ctrl.offer(worker, max_tasks=64, prefetch=62).leases]
    assert len(held) == 64, len(held)
    samples = []
    for _ in range(n):
        started = time.process_time()
        with ctrl.store.group():
            ctrl.offer(worker, max_tasks=64, running=held, waiting=held[2:], prefetch=62)
        samples.append(time.process_time() - started)
    return round(statistics.median(samples[n // 5 :]) * 1000, 3)


def summary(result: dict[str, Any]) -> str:
    p = result["cpu_p50_ms"]
    return (
        f"  controller CPU p50, in-process on SQLite: a no-op task {result['single_task_ms']} ms (submit "
        f"{p['single.submit']}, lease {p['single.lease']}, result {p['single.result']}); a 3-stage chained run "
        f"{result['pipeline_run_ms']} ms (start {p['run.start']}, lease {p['run.lease']}, one report of three "
        f"results {p['run.results']}): {result['run_over_task']}x\n"
        f"  a lease of a worker holding 64 tasks, by their inputs' size: {result['lease_64_held_p50_ms']} ms"
    )
