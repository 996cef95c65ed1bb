"""What every peer of the peer bench measures the same way: CPU from /proc, phase figures, latency percentiles.

Each system's phases (in `bench_peers` for Turnout and Celery, in `peer_ray`'s own process for Ray) report
through `phase_figures` and `latency_figures`, so the three rows of the table mean the same thing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import psutil

from bench.common import percentile


def tree_cpu_s(roots: Iterable[int], *, include_roots: bool = True) -> float:
    """User + system CPU seconds of the processes under `roots` (each counted once), and of the children they
    reaped. `include_roots=False` leaves the roots' own time out (Ray's driver is the client, not the system)."""
    seen: dict[int, psutil.Process] = {}
    for pid in roots:
        try:
            root = psutil.Process(pid)
            members = (
                [root, *root.children(recursive=True)] if include_roots else root.children(recursive=True)
            )
        except psutil.NoSuchProcess:
            continue
        seen.update((p.pid, p) for p in members)
    total = 0.0
    for proc in seen.values():
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


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
