"""A controller over the in-memory store with a clock the test moves: the orchestration with no process,
no socket and no sleep. Lease expiry and timeouts happen because the test advances the clock and runs the
sweep (`Controller.reap`), as the API's sweep loop would."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from turnout.config import ControllerSettings
from turnout.controller import Controller
from turnout.gpu.devices import GpuDevice
from turnout.models import Completion, Device, Lease, Task, TaskSpec, TaskState, Variant
from turnout.resources import parse_resources
from turnout.store import MemoryStore, Store

GiB = 2**30
HEARTBEAT_S = 1.0
SHOUT_CPU = Variant("shout", Device.CPU, parse_resources({"cpu": 1}))
SHOUT_GPU = Variant("shout", Device.GPU, parse_resources({"cpu": 1, "gpu": 1}))


class FakeClock:
    """Epoch seconds that move only when the test says so."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Harness:
    """One controller on a fresh MemoryStore, its fake clock, and helpers that speak for workers."""

    settings: ControllerSettings = field(default_factory=lambda: ControllerSettings(heartbeat_s=HEARTBEAT_S))
    clock: FakeClock = field(default_factory=FakeClock)
    store: Store = field(default_factory=MemoryStore)

    def __post_init__(self) -> None:
        self.ctrl = Controller(self.store, self.settings, clock=self.clock)

    def worker(
        self, name: str = "w", variants: Sequence[Variant] = (SHOUT_CPU,), *, gpus: int = 0, cpu: float = 4.0
    ) -> str:
        devices = [GpuDevice(i, f"GPU-{name}-{i}", "Fake H100", 80 * GiB).to_dict() for i in range(gpus)]
        worker = self.ctrl.register_worker(name=name, host="h", variants=list(variants), cpu=cpu,
                                           memory_bytes=64 * GiB, gpus=devices, strategy="pack")  # fmt: skip
        return worker.id

    def submit(self, capability: str = "shout", tenant: str = "default", **spec: Any) -> str:
        """Submit one task; each a millisecond after the last, so the queue's oldest-first order is defined."""
        self.clock.advance(0.001)
        return self.ctrl.submit(tenant, [TaskSpec(capability, {"text": "hi"}, **spec)])[0].id

    def lease(self, worker_id: str, max_tasks: int = 8, running: Sequence[str] = ()) -> list[Lease]:
        return self.ctrl.lease(worker_id, max_tasks=max_tasks, running=list(running)).leases

    def succeed(self, worker_id: str, lease: Lease, output: Any = None) -> tuple[list[str], list[str]]:
        done = Completion(lease.task.id, lease.task.attempts, True, output or {"ok": True}, run_s=0.5)
        return self.ctrl.complete(worker_id, [done])

    def fail(self, worker_id: str, lease: Lease, error_type: str) -> tuple[list[str], list[str]]:
        error = {"type": error_type, "message": error_type}
        return self.ctrl.complete(
            worker_id, [Completion(lease.task.id, lease.task.attempts, False, error=error)]
        )

    def task(self, task_id: str) -> Task:
        task = self.store.get_task(task_id)
        assert task is not None, task_id
        return task

    def state(self, task_id: str) -> TaskState:
        return self.task(task_id).state

    def audit(self, kind: str) -> list[dict[str, Any]]:
        return [r["body"] for r in self.store.list_audit(kind=kind)]

    def silent_for(self, seconds: float, *alive: str) -> None:
        """Move the clock on; the workers in `alive` heartbeat all the while (every heartbeat period)."""
        left = seconds
        while left > 0:
            step = min(HEARTBEAT_S, left)
            self.clock.advance(step)
            left -= step
            for worker_id in alive:
                self.ctrl.heartbeat(worker_id)
