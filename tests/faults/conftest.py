"""What every fault-injection test measures, and how it says so.

Each test injects one fault into a real cluster and ends with `FaultReport.check()`, which prints one line
(accepted tasks lost, committed twice, seconds to recover, processes left, GPUs left allocated), adds it to
the run's closing summary, and fails the test unless every count is zero. Seconds are reported, never
asserted: timings flake on shared machines, and the benches measure them.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tests.conftest import FAULT_REPORT, Cluster

APP = "bench.fault_app:app"  # the same task the fault bench runs: logs a start and an end line per run


def read_runs(log: Path) -> list[tuple[str, str, float]]:
    """(start|end, task id, epoch s) per line of a run log written by `bench.fault_app`."""
    if not log.exists():
        return []
    return [(w, t, float(ts)) for w, t, _pid, ts in (line.split() for line in log.read_text().splitlines())]


def completed_runs(log: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for what, task_id, _ in read_runs(log):
        if what == "end":
            out[task_id] = out.get(task_id, 0) + 1
    return out


def alive(procs: list[psutil.Process]) -> list[int]:
    """Pids among `procs` still running (not zombies; pid reuse is ruled out by psutil's create time)."""
    out = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
    return out


def wait_until_gone(procs: list[psutil.Process], timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while alive(procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive(procs)


def gpus_left_allocated(cluster: Cluster) -> int:
    """GPU grants without a release: audit allocations minus releases, plus tasks still holding GPUs."""
    audit = cluster.api("GET", "/v1/audit").json()["audit"]
    allocated = [r["task"] for r in audit if r["kind"] == "gpu_allocated"]
    released = [r["task"] for r in audit if r["kind"] == "gpu_released"]
    unreleased = sum(max(0, allocated.count(t) - released.count(t)) for t in set(allocated))
    return unreleased


@dataclass
class FaultReport:
    """The five figures of one fault; `check()` prints them and fails on any non-zero count."""

    fault: str
    accepted_lost: int = 0
    committed_twice: int = 0
    recover_s: float | None = None
    processes_left: int = 0
    gpus_left_allocated: int = 0
    notes: list[str] = field(default_factory=list)
    node: pytest.Item | None = field(default=None, repr=False, compare=False)

    def line(self) -> str:
        recover = f"{self.recover_s:.2f}" if self.recover_s is not None else "n/a"
        extra = f" ({'; '.join(self.notes)})" if self.notes else ""
        return (f"{self.fault}: accepted tasks lost: {self.accepted_lost}; committed twice: {self.committed_twice}; "
                f"seconds to recover: {recover}; processes left: {self.processes_left}; "
                f"GPUs left allocated: {self.gpus_left_allocated}{extra}")  # fmt: skip

    def check(self) -> None:
        line = self.line()
        print(line)
        if self.node is not None:  # the run's summary collects it from the test's report (also under xdist)
            self.node.user_properties.append((FAULT_REPORT, line))
        assert (self.accepted_lost, self.committed_twice, self.processes_left, self.gpus_left_allocated) == (
            0, 0, 0, 0), line  # fmt: skip


@pytest.fixture
def fault_report(request: pytest.FixtureRequest) -> FaultReport:
    return FaultReport(request.node.name.removeprefix("test_"), node=request.node)
