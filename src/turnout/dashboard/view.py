"""What the dashboard and /metrics show, computed without I/O from the records the store returns.

One set of functions feeds both, so every number on the page has a Prometheus series of the same value:
workers and their health, each GPU's memory split by the tasks and tenants that hold it (against what is
measured in use), MIG devices under their parent, and the queues per capability and device class.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from turnout.models import Task, Worker

OTHER_TENANTS = "other tenants"  # what a tenant-scoped viewer sees instead of another tenant's task
DEVICE_CLASS_OF_MODE = {"never": "cpu", "require": "gpu", "prefer": "any", "auto": "any"}
_UUID = re.compile(r"\b(?:GPU|MIG)-[0-9A-Za-z-]+")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


@dataclass(frozen=True)
class GpuHold:
    """One task's hold on one GPU or MIG device. `task_id` is None when the viewer may not see the task."""

    tenant: str
    memory_bytes: int
    exclusive: bool
    task_id: str | None = None
    capability: str | None = None


@dataclass(frozen=True)
class GpuView:
    """A physical GPU (or, under `mig_devices`, one MIG device of it) with its allocations and readings."""

    uuid: str
    index: int
    name: str
    memory_total_bytes: int
    allocations: tuple[GpuHold, ...] = ()
    memory_used_bytes: int | None = None  # measured by the worker's provider; physical GPUs only
    utilization_pct: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    health: str = "ok"
    quarantined: str | None = None  # the reason, while nothing new may be placed on it
    mig_profile: str | None = None
    mig_devices: tuple[GpuView, ...] = ()

    @property
    def allocated_bytes(self) -> int:
        """Granted memory: this unit's grants, or for a GPU in MIG mode, its MIG devices' grants."""
        own = sum(a.memory_bytes for a in self.allocations)
        return own + sum(m.allocated_bytes for m in self.mig_devices)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["allocated_bytes"] = self.allocated_bytes
        out["mig_devices"] = [m.to_dict() for m in self.mig_devices]
        return out


@dataclass(frozen=True)
class WorkerView:
    id: str
    name: str
    host: str
    state: str
    heartbeat_age_s: float
    heartbeat_s: float
    cpu: float
    memory_bytes: int
    active_tasks: int
    capabilities: tuple[str, ...]
    gpus: tuple[GpuView, ...] = ()
    health: str = "ok"  # why the worker is not fine, in words ("missed heartbeats for 7 s", "GPU 1: xid 79")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["gpus"] = [g.to_dict() for g in self.gpus]
        return out


@dataclass(frozen=True)
class QueueView:
    """Tasks of one capability for one device class: `cpu`, `gpu`, or `any` (queued with gpu prefer/auto)."""

    capability: str
    device_class: str
    queued: int = 0
    running: int = 0  # leased or running


@dataclass(frozen=True)
class Totals:
    queued: int = 0
    running: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    cost_usd: float = 0.0
    by_device: dict[str, dict[str, float]] = field(default_factory=dict)  # device -> {tasks, run_s, cost_usd}


def worker_views(
    workers: Sequence[Worker], active: Iterable[Task], *, viewer_tenant: str | None, now: float
) -> list[WorkerView]:
    """Workers with their GPUs; `viewer_tenant` None sees every task, else other tenants' holds are anonymous.

    A hold is found by its worker and GPU UUID together: two workers may report the same UUID (fake GPUs are
    `GPU-fake-0` on every host; a worker may say what it likes), and one worker's task is not on another's GPU.
    """
    holds: dict[str, dict[str, list[GpuHold]]] = {}  # worker id -> GPU UUID -> its holds
    running: dict[str, int] = {}
    for t in active:
        running[t.worker_id or ""] = running.get(t.worker_id or "", 0) + 1
        grant = t.gpus
        if grant is None:
            continue
        visible = viewer_tenant is None or t.tenant == viewer_tenant
        for uuid in grant.uuids:
            holds.setdefault(t.worker_id or "", {}).setdefault(uuid, []).append(
                GpuHold(
                    tenant=t.tenant if visible else OTHER_TENANTS,
                    memory_bytes=grant.memory_bytes,
                    exclusive=grant.exclusive,
                    task_id=t.id if visible else None,
                    capability=t.spec.capability if visible else None,
                )
            )
    out = []
    for w in workers:
        live = {m.get("uuid"): m for m in (w.metrics or {}).get("gpus", []) if isinstance(m, dict)}
        mine = holds.get(w.id, {})
        gpus = tuple(_gpu_view(g, live.get(g.get("uuid")) or {}, mine, w.quarantined) for g in w.gpus)
        age = max(0.0, now - w.last_heartbeat)
        out.append(
            WorkerView(
                id=w.id, name=w.name, host=w.host, state=w.state.value, heartbeat_age_s=round(age, 3),
                heartbeat_s=w.heartbeat_s, cpu=w.cpu, memory_bytes=w.memory_bytes,
                active_tasks=running.get(w.id, 0), capabilities=tuple(sorted({v.capability for v in w.variants})),
                gpus=gpus, health=_worker_health(w.state.value, age, w.heartbeat_s, gpus),
            )
        )  # fmt: skip
    return out


def _gpu_view(
    dev: dict[str, Any], live: dict[str, Any], holds: dict[str, list[GpuHold]], quarantined: dict[str, str]
) -> GpuView:
    migs = tuple(_mig_view(dev, m, holds, quarantined) for m in dev.get("mig_devices") or () if m.get("uuid"))
    uuid = str(dev.get("uuid", ""))
    return GpuView(
        uuid=uuid, index=int(dev.get("index", 0)), name=str(dev.get("name", "GPU")),
        memory_total_bytes=int(dev.get("memory_total_bytes") or 0), allocations=tuple(holds.get(uuid, ())),
        memory_used_bytes=live.get("memory_used_bytes"), utilization_pct=live.get("utilization_pct"),
        temperature_c=live.get("temperature_c"), power_w=live.get("power_w"), health=str(live.get("health") or "ok"),
        quarantined=quarantined.get(uuid), mig_devices=migs,
    )  # fmt: skip


def _mig_view(
    dev: dict[str, Any], mig: dict[str, Any], holds: dict[str, list[GpuHold]], quarantined: dict[str, str]
) -> GpuView:
    uuid = str(mig["uuid"])
    return GpuView(
        uuid=uuid, index=int(dev.get("index", 0)), name=f"{dev.get('name', 'GPU')} {mig.get('profile', '')}".strip(),
        memory_total_bytes=int(mig.get("memory_total_bytes") or 0), allocations=tuple(holds.get(uuid, ())),
        quarantined=quarantined.get(uuid), mig_profile=mig.get("profile"),
    )  # fmt: skip


def _worker_health(state: str, age_s: float, heartbeat_s: float, gpus: Sequence[GpuView]) -> str:
    if state == "unhealthy":
        return f"no heartbeat for {age_s:.0f} s (expected every {heartbeat_s:g} s)"
    if state == "draining":
        return "draining: finishing its tasks, taking no new ones"
    bad = [f"GPU {g.index}: {g.quarantined}" for g in gpus if g.quarantined]
    bad += [
        f"GPU {g.index} {m.mig_profile}: {m.quarantined}"
        for g in gpus
        for m in g.mig_devices
        if m.quarantined
    ]
    return "; ".join(bad) if bad else "ok"


def queue_views(stats: Iterable[dict[str, Any]]) -> list[QueueView]:
    """Rows of `SqlStore.task_stats` over non-terminal states -> one line per (capability, device class).

    A queued task has no device yet: its class is what its `gpu` value allows. A leased or running one counts
    under the device it was given.
    """
    acc: dict[tuple[str, str], list[int]] = {}
    for row in stats:
        if row["state"] == "queued":
            key = (row["capability"], DEVICE_CLASS_OF_MODE.get(row["gpu_mode"], "any"))
            acc.setdefault(key, [0, 0])[0] += row["count"]
        elif row["state"] in ("leased", "running"):
            key = (row["capability"], row["device"] or "any")
            acc.setdefault(key, [0, 0])[1] += row["count"]
    return [QueueView(cap, cls, q, r) for (cap, cls), (q, r) in sorted(acc.items())]


def totals(stats: Iterable[dict[str, Any]]) -> Totals:
    counts = {"queued": 0, "running": 0, "succeeded": 0, "failed": 0, "cancelled": 0}
    cost = 0.0
    by_device: dict[str, dict[str, float]] = {}
    for row in stats:
        state = "running" if row["state"] == "leased" else row["state"]
        counts[state] = counts.get(state, 0) + row["count"]
        cost += row["cost_usd"]
        if row["device"] and row["state"] in ("succeeded", "failed", "cancelled"):
            d = by_device.setdefault(row["device"], {"tasks": 0, "run_s": 0.0, "cost_usd": 0.0})
            d["tasks"] += row["count"]
            d["run_s"] += row["run_s_sum"]
            d["cost_usd"] += row["cost_usd"]
    return Totals(**counts, cost_usd=round(cost, 8), by_device=by_device)


def reason_class(reason: str | None) -> str:
    """A routing reason without its numbers and GPU ids, so a metric label stays low-cardinality.

    `gpu queue wait 41 s > gpu_wait_s 10 s` -> `gpu queue wait N s > gpu_wait_s N s`.
    """
    if not reason:
        return "unknown"
    return _NUMBER.sub("N", _UUID.sub("GPU", reason))[:120]
