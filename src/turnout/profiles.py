"""What finished tasks taught about each (capability, device class, GPU model), and `gpu: auto` decided on it.

A profile holds moving averages of run time and cold start, and the peaks of GPU memory and RAM seen. `auto`
sends each task where its expected finish is earliest:

    expected finish on a device class = queued work ahead / slots that serve it
                                        + cold start (where no warm process is ready)
                                        + its own run time

and says so in `routing.reason` (`gpu queue 41 s + run 0.2 s > cpu run 2 s`). With no history for both
device classes it behaves like `prefer`. Pure: the controller gathers the facts (`Backlog`) and asks.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from turnout.models import Device, Worker

GPU_MEMORY_HEADROOM = 1.25  # a learned gpu_memory is the observed peak plus a quarter
EWMA = 0.3  # weight of the newest sample in a profile's moving averages: recent behaviour counts most
FOLD_EVERY_S = 1.0  # how long finished tasks' samples wait in memory before they are written to the profiles


@dataclass(frozen=True)
class Profile:
    capability: str
    device: str  # cpu or gpu
    gpu_model: str | None
    samples: int
    run_s: float
    cold_start_s: float | None = None
    peak_gpu_memory_bytes: int | None = None
    peak_rss_bytes: int | None = None

    def to_dict(self) -> dict[str, object]:
        return {"device": self.device, "gpu_model": self.gpu_model, "samples": self.samples,
                "run_s": round(self.run_s, 6), "cold_start_s": None if self.cold_start_s is None else round(self.cold_start_s, 6),
                "peak_gpu_memory_bytes": self.peak_gpu_memory_bytes, "peak_rss_bytes": self.peak_rss_bytes}  # fmt: skip


@dataclass(frozen=True)
class RunSample:
    """What one finished task tells its profile."""

    run_s: float
    cold_start_s: float | None = None
    peak_gpu_memory_bytes: int | None = None
    peak_rss_bytes: int | None = None


ProfileKey = tuple[str, str, str | None]  # capability, device class, GPU model


def fold(row: Any, samples: Sequence[RunSample]) -> dict[str, Any]:
    """A profile's columns with `samples` folded in, oldest first, into `row` (a stored profile or anything
    with its fields; None: no profile yet)."""
    n = row.samples if row is not None else 0
    run_s = row.run_s if row is not None else 0.0
    cold = row.cold_start_s if row is not None else None
    gpu = row.peak_gpu_memory_bytes if row is not None else None
    rss = row.peak_rss_bytes if row is not None else None
    for s in samples:
        run_s = s.run_s if n == 0 else (1 - EWMA) * run_s + EWMA * s.run_s
        if s.cold_start_s is not None:
            cold = s.cold_start_s if cold is None else (1 - EWMA) * cold + EWMA * s.cold_start_s
        gpu, rss, n = _max(gpu, s.peak_gpu_memory_bytes), _max(rss, s.peak_rss_bytes), n + 1
    return {"samples": n, "run_s": run_s, "cold_start_s": cold, "peak_gpu_memory_bytes": gpu,
            "peak_rss_bytes": rss}  # fmt: skip


def _max(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


class PendingSamples:
    """Finished tasks' samples not yet written to their profiles.

    A profile is an estimate: writing it in the commit of every result cost a read and a write per report
    (a quarter of the controller's work per no-op task). Samples wait here and are written together at most
    every FOLD_EVERY_S (`due`, `take`), and before `auto` reads the profiles to route; a read for display
    folds them in on top of what is stored (`overlay`). Samples of a controller that dies before writing
    them are lost: at most a second of an estimate. The database thread adds and takes; readers overlay.
    """

    def __init__(self) -> None:
        self._samples: dict[ProfileKey, list[RunSample]] = {}
        self._lock = threading.Lock()
        self._since: float | None = None  # when the oldest sample waiting arrived

    def add(self, key: ProfileKey, sample: RunSample, now: float) -> None:
        with self._lock:
            self._samples.setdefault(key, []).append(sample)
            if self._since is None:
                self._since = now

    def due(self, now: float) -> bool:
        """Whether the oldest sample waiting has waited FOLD_EVERY_S."""
        return self._since is not None and now - self._since >= FOLD_EVERY_S

    def take(self) -> dict[ProfileKey, list[RunSample]]:
        with self._lock:
            taken, self._samples, self._since = self._samples, {}, None
        return taken

    def overlay(self, stored: Sequence[Profile]) -> list[Profile]:
        """`stored` with the samples waiting here folded in (profiles they start included)."""
        with self._lock:
            waiting = {key: list(samples) for key, samples in self._samples.items()}
        if not waiting:
            return list(stored)
        out = []
        for p in stored:
            samples = waiting.pop((p.capability, p.device, p.gpu_model), None)
            out.append(replace(p, **fold(p, samples)) if samples else p)
        for (capability, device, gpu_model), samples in waiting.items():
            out.append(Profile(capability, device, gpu_model, **fold(None, samples)))
        return out


class RecentRunTimes:
    """Each capability's recent run time per device class, as this controller saw its results end: what a
    worker's `--prefetch auto` is weighed on before a task is held waiting there (`Controller.lease`).

    A cautious figure, as TCP bounds a round trip (RFC 6298): the moving average plus four times the moving
    mean deviation, so a capability that now and then runs long is not taken for a short one. In memory, not
    the stored profiles: it is asked on every lease, which a database read would slow, and a restarted
    controller learns it again from the next results (until then, nothing is held waiting)."""

    SMOOTH = 0.125  # weight of the newest run in the average (RFC 6298's alpha)
    SPREAD = 0.25  # and in the mean deviation (its beta)

    def __init__(self) -> None:
        self._stats: dict[tuple[str, str], tuple[float, float]] = {}  # (average, mean deviation)

    def note(self, capability: str, device: str, run_s: float) -> None:
        key = (capability, device)
        before = self._stats.get(key)
        if before is None:
            self._stats[key] = (run_s, run_s / 2)
            return
        mean, deviation = before
        deviation += self.SPREAD * (abs(run_s - mean) - deviation)
        self._stats[key] = (mean + self.SMOOTH * (run_s - mean), deviation)

    def expected(self, capability: str, device: str) -> float | None:
        """Seconds a task of it likely stays within; None before a task of it ended here."""
        stats = self._stats.get((capability, device))
        return None if stats is None else stats[0] + 4 * stats[1]


def learned_gpu_memory(profiles: Iterable[Profile]) -> int | None:
    """The gpu_memory a GPU variant that declares none gets: its largest observed peak, with headroom."""
    peaks = [p.peak_gpu_memory_bytes for p in profiles if p.device == "gpu" and p.peak_gpu_memory_bytes]
    return int(max(peaks) * GPU_MEMORY_HEADROOM) if peaks else None


def pick(
    profiles: Sequence[Profile], capability: str, device: str, gpu_model: str | None = None
) -> Profile | None:
    """The profile for a device class: the given GPU model's when known, else the one with most samples."""
    mine = [p for p in profiles if p.capability == capability and p.device == device]
    if gpu_model:
        exact = [p for p in mine if p.gpu_model and p.gpu_model.lower() == gpu_model.lower()]
        if exact:
            return exact[0]
    return max(mine, key=lambda p: p.samples, default=None)


@dataclass(frozen=True)
class Side:
    """One device class as `auto` sees it for one task."""

    profile: Profile | None
    work_ahead_s: float = 0.0  # expected seconds of the tasks ahead that only (or first) this class serves
    slots: int = 1  # tasks this class serves at once, across healthy workers offering the variant
    warm: bool = True  # a warm process of the variant is ready somewhere

    def finish_s(self) -> float | None:
        if self.profile is None:
            return None
        cold = 0.0 if self.warm else (self.profile.cold_start_s or 0.0)
        return self.work_ahead_s / max(1, self.slots) + cold + self.profile.run_s

    def queue_s(self) -> float:
        return self.work_ahead_s / max(1, self.slots)


@dataclass(frozen=True)
class AutoChoice:
    device: Device
    reason: str


def choose(cpu: Side, gpu: Side) -> AutoChoice | None:
    """The device class with the earliest expected finish, with the numbers; None without history for both."""
    cpu_s, gpu_s = cpu.finish_s(), gpu.finish_s()
    if cpu_s is None or gpu_s is None or cpu.profile is None or gpu.profile is None:
        return None
    gpu_text = _side_text("gpu", gpu)
    cpu_text = _side_text("cpu", cpu)
    if gpu_s <= cpu_s:
        return AutoChoice(Device.GPU, f"{gpu_text} <= {cpu_text}")
    return AutoChoice(Device.CPU, f"{gpu_text} > {cpu_text}")


def _side_text(name: str, side: Side) -> str:
    assert side.profile is not None
    parts = []
    if side.queue_s() >= 0.05:
        parts.append(f"queue {_s(side.queue_s())}")
    if not side.warm and side.profile.cold_start_s:
        parts.append(f"cold start {_s(side.profile.cold_start_s)}")
    parts.append(f"run {_s(side.profile.run_s)}")
    return f"{name} " + " + ".join(parts)


def _s(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.2g} s"


DEFAULT_RUN_S = (
    1.0  # the expected run of a task whose capability has no profile yet, when counting work ahead
)
WARM_SETTLE_S = 0.5  # how long a task waits for a worker with a warm process before a cold one takes it


@dataclass(frozen=True)
class Fleet:
    """What `auto` and warm affinity need to know of the cluster, gathered once per lease request."""

    profiles: tuple[Profile, ...]
    workers: tuple[Worker, ...]  # healthy ones
    active: tuple[tuple[str, str, int], ...]  # (capability, device, count) leased or running
    queued: tuple[tuple[str, str, int], ...]  # (capability, gpu mode, count) queued

    def run_s(self, capability: str, device: str) -> float:
        found = pick(self.profiles, capability, device)
        return found.run_s if found else DEFAULT_RUN_S

    def side(self, capability: str, device: Device) -> Side:
        d = device.value
        bound = "require" if device is Device.GPU else "never"
        ahead = sum(n * self.run_s(cap, d) for cap, dev, n in self.active if dev == d)
        ahead += sum(n * self.run_s(cap, d) for cap, mode, n in self.queued if mode == bound)
        slots = 0
        warm = False
        for w in self.workers:
            variant = w.offers(capability).get(device)
            if variant is None:
                continue
            if device is Device.GPU:
                slots += max(1, len(w.gpus))
            else:
                slots += max(1, int(w.cpu / variant.resources.cpu) if variant.resources.cpu > 0 else 1)
            warm = warm or warm_processes(w, capability, device) > 0
        return Side(pick(self.profiles, capability, d), ahead, max(1, slots), warm)


def warm_processes(worker: Worker, capability: str, device: Device) -> int:
    """Processes with the variant's model loaded (busy or idle) that the worker reported at its last heartbeat."""
    pools = (worker.metrics or {}).get("pools") or {}
    entry = pools.get(f"{capability}:{device.value}") if isinstance(pools, dict) else None
    warm = entry.get("loaded") if isinstance(entry, dict) else None
    return warm if isinstance(warm, int) and not isinstance(warm, bool) else 0


def leave_for_warm(
    here: Worker, others: Sequence[Worker], capability: str, device: Device, waited_s: float
) -> bool:
    """Warm affinity: whether a worker with no warm process for the variant should leave the task a moment for
    one that has (its model loaded). Bounded by WARM_SETTLE_S, so a stale report never strands a task."""
    if waited_s >= WARM_SETTLE_S or warm_processes(here, capability, device) > 0:
        return False
    return any(w.id != here.id and device in w.offers(capability) and warm_processes(w, capability, device) > 0
               for w in others)  # fmt: skip
