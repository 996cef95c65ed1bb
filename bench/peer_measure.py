"""What every peer of the peer bench measures the same way: CPU from /proc, phase figures, latency percentiles.

Each system's phases (in `bench_peers` for Turnout and Celery, in `peer_ray`'s own process for Ray) report
through `phase_figures` and `latency_figures`, so the three rows of the table mean the same thing.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import psutil

from bench.common import percentile


class CpuMeter:
    """User + system CPU seconds that process trees burn while the meter runs, by role.

    Processes come and go during a phase (Ray replaces idle workers, a pool may restart one), and a parent that
    ignores SIGCHLD never adds a dead child's time to its own; so each process (pid and start time) is read every
    `interval_s` on a thread, and what counts is its last reading less its reading when the meter started (0 for
    one born meanwhile). Reaped children's totals are not used, so nothing counts twice; a process that lives
    less than one interval unseen is missed. `include_roots=False` leaves the roots' own time out (Ray's driver
    is the client, not the system).
    """

    def __init__(
        self, roots: dict[str, int], *, include_roots: bool = True, interval_s: float = 0.25
    ) -> None:
        self.roots, self.include_roots, self.interval_s = roots, include_roots, interval_s
        self._first: dict[tuple[int, float], float] = {}
        self._last: dict[str, dict[tuple[int, float], float]] = {role: {} for role in roots}
        self.overhead_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="cpu-meter", daemon=True)

    def _read(self) -> None:
        for role, pid in self.roots.items():
            try:
                root = psutil.Process(pid)
                procs = (
                    [root, *root.children(recursive=True)]
                    if self.include_roots
                    else root.children(recursive=True)
                )
            except psutil.Error:
                continue
            for proc in procs:
                with contextlib.suppress(psutil.Error):
                    t = proc.cpu_times()
                    self._last[role][(proc.pid, proc.create_time())] = t.user + t.system

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._read()
        self.overhead_s = time.thread_time()  # this thread's own CPU: the caller takes it off the client's

    def __enter__(self) -> CpuMeter:
        self._read()
        self._first = {key: cpu for readings in self._last.values() for key, cpu in readings.items()}
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._read()

    def started(self) -> int:
        """Processes first seen after the meter started: a short-lived one may also have come and gone unseen."""
        return sum(1 for readings in self._last.values() for key in readings if key not in self._first)

    def seconds(self) -> dict[str, float]:
        """CPU seconds by role, once the meter has stopped."""
        return {role: sum(cpu - self._first.get(key, 0.0) for key, cpu in readings.items())
                for role, readings in self._last.items()}  # fmt: skip


def own_cpu_s() -> float:
    """This process's user + system CPU seconds, all threads, without any reaped children (the client's share)."""
    t = psutil.Process().cpu_times()
    return t.user + t.system


def phase_figures(tasks: int, elapsed_s: float, submit_s: float, succeeded: int, *,
                  cpu_s: float | None = None, client_cpu_s: float | None = None) -> dict[str, Any]:  # fmt: skip
    """One throughput phase: N tasks submitted in `submit_s`, all results in after `elapsed_s`."""
    out: dict[str, Any] = {
        "tasks": tasks, "elapsed_s": round(elapsed_s, 3), "submit_s": round(submit_s, 3),
        "tasks_per_s": round(tasks / elapsed_s, 1) if elapsed_s > 0 else None,
        "succeeded": succeeded, "all_succeeded": succeeded == tasks,
    }  # fmt: skip
    if cpu_s is not None:
        out["cpu_ms_per_task"] = round(1000 * cpu_s / tasks, 3)
    if client_cpu_s is not None:
        out["client_cpu_ms_per_task"] = round(1000 * client_cpu_s / tasks, 3)
    return out


def latency_figures(samples_s: list[float], failed: int) -> dict[str, Any]:
    """Submit-to-result round trips, one at a time, in milliseconds."""
    return {
        "n": len(samples_s), "failed": failed, "all_succeeded": failed == 0,
        "p50_ms": round(1000 * percentile(samples_s, 50), 2), "p99_ms": round(1000 * percentile(samples_s, 99), 2),
    }  # fmt: skip
