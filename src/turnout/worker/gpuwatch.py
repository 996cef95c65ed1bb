"""The worker's watch over its GPUs: health (quarantine and canary re-admission) and shared-memory limits.

Each heartbeat samples the provider once; this module turns the sample into two decisions: which devices
are out of service (sent to the controller, which then places nothing new on them), and which running
tasks use more GPU memory than their share (stopped with `gpu_memory_exceeded`).

Canaries (the check that re-admits a quarantined device, up to a minute of work) run on a thread of their
own, never inside `sample()`: the heartbeat that samples must not wait for one, or a healthy worker with a
slow canary would look dead to the controller.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import psutil

from turnout.gpu.devices import GpuMetrics
from turnout.gpu.health import HealthTracker, run_canary
from turnout.gpu.provider import GpuProvider

log = logging.getLogger("turnout.worker")


@dataclass(frozen=True)
class SharedTask:
    """A running task that holds a share of GPU memory."""

    task_id: str
    pid: int  # its process; the memory of its descendants counts too
    uuids: tuple[str, ...]
    limit_bytes: int


def memory_over_limit(tasks: Iterable[SharedTask], metrics: Iterable[GpuMetrics],
                      descendants: Mapping[int, set[int]]) -> dict[str, int]:  # fmt: skip
    """task id -> bytes used, for each task whose processes use more than its limit on its GPUs."""
    used_by_pid: dict[tuple[str, int], int] = {}
    for m in metrics:
        for p in m.processes:
            used_by_pid[(m.uuid, p.pid)] = used_by_pid.get((m.uuid, p.pid), 0) + p.used_memory_bytes
    over: dict[str, int] = {}
    for t in tasks:
        pids = {t.pid} | descendants.get(t.pid, set())
        used = sum(b for (uuid, pid), b in used_by_pid.items() if uuid in t.uuids and pid in pids)
        if used > t.limit_bytes:
            over[t.task_id] = used
    return over


def process_tree(pids: Iterable[int]) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for pid in pids:
        try:
            out[pid] = {c.pid for c in psutil.Process(pid).children(recursive=True)}
        except psutil.Error:
            out[pid] = set()
    return out


class GpuWatch:
    def __init__(self, provider: GpuProvider, uuids: Iterable[str], *, canary_command: list[str] | None = None,
                 canary_backoff_s: float = 30.0) -> None:  # fmt: skip
        self.provider = provider
        self.tracker = HealthTracker(list(uuids), canary_backoff_s=canary_backoff_s)
        self.canary_command = canary_command
        self.last: list[GpuMetrics] = []
        self._lock = threading.Lock()  # the tracker is shared by the sampler and the canary thread
        self._canaries: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._canary_thread: threading.Thread | None = None

    def sample(self) -> list[GpuMetrics]:
        """Read the provider once and update health; a provider that fails counts as a missed sample.

        Canaries that fall due are handed to the canary thread; their verdicts show in a later `quarantined()`.
        """
        now = time.monotonic()
        try:
            self.last = self.provider.metrics()
        except Exception as exc:
            log.warning("GPU metrics failed: %s", exc)
            self.last = []
        with self._lock:
            changes = self.tracker.update(self.last, now)
            due = self.tracker.canary_due(now)  # claimed: not due again while it runs (canary_timeout_s)
        for change in changes:
            log.warning(
                "GPU %s %s: %s",
                change.uuid,
                "back in service" if change.healthy else "quarantined",
                change.reason,
            )
        for uuid in due:
            self._canaries.put(uuid)
        if due and self._canary_thread is None:
            # a daemon: a canary stuck in a driver call must not keep a stopping worker alive
            self._canary_thread = threading.Thread(
                target=self._run_canaries, name="turnout-canary", daemon=True
            )
            self._canary_thread.start()
        return self.last

    def quarantine(self, uuid: str, reason: str) -> None:
        for change in self.tracker.quarantine(uuid, reason, time.monotonic()):
            log.warning("GPU %s quarantined: %s", change.uuid, change.reason)

    def quarantined(self) -> dict[str, str]:
        with self._lock:
            return self.tracker.quarantined()

    def _run_canaries(self) -> None:
        while True:
            uuid = self._canaries.get()
            try:
                ok = run_canary(uuid, self.canary_command, provider=self.provider)
            except Exception:  # a canary that cannot even run has not passed
                log.exception("GPU %s: canary could not run", uuid)
                ok = False
            with self._lock:
                changes = self.tracker.record_canary(uuid, ok, time.monotonic())
            for change in changes:
                log.warning("GPU %s %s after canary: %s", change.uuid,
                            "re-admitted" if change.healthy else "still quarantined", change.reason)  # fmt: skip
