"""Which GPU units of one worker a task gets: pure logic, no I/O.

The controller calls `allocate` at lease time with one worker's units and the usage summed from that
worker's active grants (`usage_from_grants`); the trace simulator calls the very same function, so what
the benchmark measures is what production does.

Rules (DESIGN.md "Resources"):
* **exclusive** (`count >= 1`): whole, non-MIG GPUs with nothing else on them, all of one model (a
  multi-GPU task on mixed models would run at the pace of the slowest card). A GPU in MIG mode is never
  given whole, and a MIG device is a slice, not a GPU, so it never serves a whole-GPU request.
* **shared** (`memory_bytes` and/or `fraction`): one unit whose unallocated memory fits and which is not
  held exclusively. A MIG device is isolated by hardware and cannot be subdivided, so a shared request
  that fits takes the whole MIG device (the grant is then `exclusive` and carries the device's memory).
* unhealthy units are never chosen; `models` is an ordered preference and the best-ranked feasible model
  wins before the strategy is consulted; a unit whose compute capability is unknown does not satisfy a
  `min_compute_capability`.
* `training` and `inference` never share a unit (their memory patterns clash: a training step's peak
  would OOM a latency-bound server).
* one tenant at a time on a shared non-MIG unit: processes sharing a GPU's memory without MIG are not
  isolated from each other, so another tenant's share waits for a GPU of its own or a MIG device (whole
  GPUs and MIG devices are never shared, so they need no such rule). A request with no tenant (the trace
  simulator) is not constrained.
* PACK = best fit (least memory left over on the chosen unit; for exclusive, the model group left with the
  fewest free GPUs). SPREAD = least allocated, then coolest. Remaining ties: lowest index, then input order.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from turnout.errors import Conflict, InvalidInput
from turnout.gpu.devices import GpuUnit, UnitUsage
from turnout.resources import Resources, model_matches

PPM = 1_000_000  # fractions are resolved to parts per million of a unit's memory (see `need_bytes`)
_CLASHES: dict[str, str] = {"training": "inference", "inference": "training"}
_EMPTY = UnitUsage()


class Strategy(str, enum.Enum):
    PACK = "pack"
    SPREAD = "spread"


@dataclass(frozen=True)
class GpuRequest:
    """The GPU side of one task (plus its host CPU/memory, which node scoring weighs)."""

    count: int = 0  # whole GPUs, exclusive
    memory_bytes: int | None = None  # shared: memory on one unit (with count: minimum memory per GPU)
    fraction: float | None = None  # shared: share of one unit's memory (0 < x < 1)
    models: tuple[str, ...] = ()  # ordered preference, substring, case-insensitive
    min_compute_capability: tuple[int, int] | None = None
    workload: str | None = None  # "training" never shares a unit with "inference" (and vice versa)
    tenant: str | None = None  # never shares a non-MIG unit with another tenant's task
    cpu: float = 0.0  # host cores; not used by `allocate`, only by node scoring
    host_memory_bytes: int = 0
    fraction_ppm: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.count < 0:
            raise InvalidInput(f"gpu: count must be >= 0, got {self.count}", field="gpu")
        if self.fraction is not None and not 0 < self.fraction < 1:
            raise InvalidInput(f"gpu: a share must be 0 < x < 1, got {self.fraction}", field="gpu")
        if self.count and self.fraction is not None:
            raise InvalidInput("gpu: ask for whole GPUs or a share, not both", field="gpu")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise InvalidInput("gpu_memory: must be more than 0", field="gpu_memory")
        # Integer ppm so that e.g. 0.46 + 0.54 fills a unit exactly instead of overflowing by a float byte.
        ppm = round(self.fraction * PPM) if self.fraction is not None else 0
        object.__setattr__(self, "fraction_ppm", ppm)

    @property
    def wants_gpu(self) -> bool:
        return self.count > 0 or self.memory_bytes is not None or self.fraction is not None

    @property
    def exclusive(self) -> bool:
        return self.count > 0

    @classmethod
    def from_resources(
        cls, r: Resources, workload: str | None = None, tenant: str | None = None
    ) -> GpuRequest:
        """Translate a validated requirement; `gpu >= 1` is exclusive, `0 < gpu < 1` or `gpu_memory` shared."""
        count = r.whole_gpus
        fraction = float(r.gpu) if 0 < r.gpu < 1 else None
        return cls(
            count=count,
            memory_bytes=r.gpu_memory_bytes,
            fraction=fraction,
            models=r.gpu_models,
            min_compute_capability=r.min_compute_capability,
            workload=workload,
            tenant=tenant,
            cpu=r.cpu,
            host_memory_bytes=r.memory_bytes,
        )


@dataclass(frozen=True)
class GpuGrant:
    """What a task holds: the units, and the memory held on each (the whole unit's when exclusive)."""

    uuids: tuple[str, ...]
    indices: tuple[int, ...]
    memory_bytes: int  # per unit held
    exclusive: bool
    model: str
    mig: bool
    # a unit's whole memory, as a task's record and its lease carry it (the worker caps memory fractions by it)
    unit_memory_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "uuids": list(self.uuids),
            "indices": list(self.indices),
            "memory_bytes": self.memory_bytes,
            "exclusive": self.exclusive,
            "model": self.model,
            "mig": self.mig,
        }
        if self.unit_memory_bytes is not None:
            out["unit_memory_bytes"] = self.unit_memory_bytes
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GpuGrant:
        try:
            unit = d.get("unit_memory_bytes")
            return cls(
                tuple(str(u) for u in d["uuids"]),
                tuple(int(i) for i in d["indices"]),
                int(d["memory_bytes"]),
                bool(d["exclusive"]),
                str(d["model"]),
                bool(d.get("mig", False)),
                None if unit is None else int(unit),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInput(f"gpu grant: malformed ({exc!r})", field="gpus") from exc


def need_bytes(request: GpuRequest, unit: GpuUnit) -> int:
    """Memory a shared request needs on `unit`: the larger of its bytes and its share (rounded up)."""
    need = -(-request.fraction_ppm * unit.memory_bytes // PPM) if request.fraction is not None else 0
    return max(need, request.memory_bytes or 0)


def _cc(unit: GpuUnit) -> tuple[int, int] | None:
    try:
        major, minor = (unit.compute_capability or "").split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def model_rank(request: GpuRequest, unit: GpuUnit) -> int | None:
    """The unit's rank in the request's model preference, or None when the unit can never serve it."""
    if not unit.healthy or (request.exclusive and unit.is_mig):
        return None
    if request.exclusive and request.memory_bytes is not None and unit.memory_bytes < request.memory_bytes:
        return None
    if request.min_compute_capability is not None:
        cc = _cc(unit)
        if cc is None or cc < request.min_compute_capability:
            return None
    return model_matches(request.models, unit.model)


def _is_free(usage: UnitUsage) -> bool:
    return usage.tasks == 0 and usage.memory_bytes == 0 and not usage.exclusive


def _clashes(request: GpuRequest, usage: UnitUsage) -> bool:
    other = _CLASHES.get(request.workload or "")
    return other is not None and other in usage.workloads


def _other_tenant(request: GpuRequest, usage: UnitUsage) -> bool:
    return request.tenant is not None and bool(usage.tenants - {request.tenant})


def shared_slack(request: GpuRequest, unit: GpuUnit, usage: UnitUsage) -> int | None:
    """Memory left over on `unit` after placing the shared request there, or None if it does not fit now."""
    need = need_bytes(request, unit)
    if unit.is_mig:
        return unit.memory_bytes - need if _is_free(usage) and need <= unit.memory_bytes else None
    if usage.exclusive or _clashes(request, usage) or _other_tenant(request, usage):
        return None
    slack = unit.memory_bytes - usage.memory_bytes - need
    return slack if slack >= 0 else None


def _temp(unit: GpuUnit) -> float:
    return unit.temperature_c if unit.temperature_c is not None else math.inf


def _allocate_shared(
    request: GpuRequest, units: Sequence[GpuUnit], usage: Mapping[str, UnitUsage], strategy: Strategy
) -> GpuGrant | None:
    best: tuple[Any, ...] | None = None
    chosen: tuple[GpuUnit, int] | None = None
    for pos, unit in enumerate(units):
        rank = model_rank(request, unit)
        if rank is None:
            continue
        u = usage.get(unit.uuid, _EMPTY)
        slack = shared_slack(request, unit, u)
        if slack is None:
            continue
        if strategy is Strategy.PACK:
            key: tuple[Any, ...] = (rank, slack, unit.index, pos)
        else:
            key = (
                rank,
                u.memory_bytes / unit.memory_bytes if unit.memory_bytes else 1.0,
                _temp(unit),
                unit.index,
                pos,
            )
        if best is None or key < best:
            best, chosen = key, (unit, slack)
    if chosen is None:
        return None
    unit, _ = chosen
    held = unit.memory_bytes if unit.is_mig else need_bytes(request, unit)
    return GpuGrant((unit.uuid,), (unit.index,), held, unit.is_mig, unit.model, unit.is_mig)


def _allocate_whole(
    request: GpuRequest, units: Sequence[GpuUnit], usage: Mapping[str, UnitUsage], strategy: Strategy
) -> GpuGrant | None:
    groups: dict[str, list[tuple[int, GpuUnit]]] = {}
    ranks: dict[str, int] = {}
    for pos, unit in enumerate(units):
        rank = model_rank(request, unit)
        if rank is None or not _is_free(usage.get(unit.uuid, _EMPTY)):
            continue
        groups.setdefault(unit.model, []).append((pos, unit))
        ranks[unit.model] = rank
    best: tuple[Any, ...] | None = None
    picked: list[tuple[int, GpuUnit]] = []
    for model, members in groups.items():
        if len(members) < request.count:
            continue
        if strategy is Strategy.PACK:  # best fit: leave big free groups intact for big requests
            members = sorted(members, key=lambda m: (m[1].memory_bytes, m[1].index, m[0]))
            key: tuple[Any, ...] = (ranks[model], len(members), members[0][1].index)
        else:
            members = sorted(members, key=lambda m: (_temp(m[1]), m[1].index, m[0]))
            key = (ranks[model], -len(members), members[0][1].index)
        if best is None or key < best:
            best, picked = key, members[: request.count]
    if not picked:
        return None
    picked.sort(key=lambda m: (m[1].index, m[0]))
    return GpuGrant(
        tuple(u.uuid for _, u in picked),
        tuple(u.index for _, u in picked),
        min(u.memory_bytes for _, u in picked),
        True,
        picked[0][1].model,
        False,
    )


def allocate(
    request: GpuRequest,
    units: Sequence[GpuUnit],
    usage: Mapping[str, UnitUsage],
    strategy: Strategy = Strategy.PACK,
) -> GpuGrant | None:
    """The units `request` gets on this worker now, or None when it does not fit at the moment."""
    if not request.wants_gpu:
        raise InvalidInput("gpu: the request asks for no GPU", field="gpu")
    strategy = Strategy(strategy)
    if request.exclusive:
        return _allocate_whole(request, units, usage, strategy)
    return _allocate_shared(request, units, usage, strategy)


def fits_ever(request: GpuRequest, units: Sequence[GpuUnit]) -> bool:
    """Could `request` be placed on these units if all were free? (False means `no_capacity` here.)"""
    return allocate(request, units, {}) is not None


def _hold(
    usage: dict[str, UnitUsage], grant: GpuGrant, workload: str | None, tenant: str | None = None
) -> None:
    for uuid in grant.uuids:
        old = usage.get(uuid, _EMPTY)
        usage[uuid] = UnitUsage(
            old.memory_bytes + grant.memory_bytes,
            old.exclusive or grant.exclusive,
            old.tasks + 1,
            old.workloads | {workload} if workload else old.workloads,
            old.tenants | {tenant} if tenant else old.tenants,
        )


def add_grant(
    usage: Mapping[str, UnitUsage], grant: GpuGrant, workload: str | None, tenant: str | None = None
) -> dict[str, UnitUsage]:
    """A new usage map with `grant` held (by `tenant`'s task, where known); the input is left untouched."""
    out = dict(usage)
    _hold(out, grant, workload, tenant)
    return out


def remove_grant(
    usage: Mapping[str, UnitUsage], grant: GpuGrant, workload: str | None
) -> dict[str, UnitUsage]:
    """A new usage map with `grant` released; a unit left with no task disappears from the map.

    `UnitUsage.workloads` and `.tenants` are sets, so a label stays on a unit until its last task leaves:
    conservative (it may refuse a clashing share a little longer), never unsafe. Usage recomputed with
    `usage_from_grants` is always exact.
    """
    out = dict(usage)
    for uuid in grant.uuids:
        old = out.get(uuid)
        if old is None or old.tasks < 1 or old.memory_bytes < grant.memory_bytes:
            raise Conflict(f"gpu {uuid}: release of a grant that is not held")
        tasks, memory = old.tasks - 1, old.memory_bytes - grant.memory_bytes
        if tasks == 0:
            del out[uuid]
            continue
        out[uuid] = UnitUsage(
            memory, old.exclusive and not grant.exclusive, tasks, old.workloads, old.tenants
        )
    return out


def usage_from_grants(
    grants: Iterable[tuple[GpuGrant, str | None] | tuple[GpuGrant, str | None, str | None]],
) -> dict[str, UnitUsage]:
    """The usage of a worker's units from the grants of its active tasks: (grant, workload[, tenant])."""
    usage: dict[str, UnitUsage] = {}
    for grant, workload, *tenant in grants:
        _hold(usage, grant, workload, tenant[0] if tenant else None)
    return usage


def gpu_units_of(grant: GpuGrant | None, units: Sequence[GpuUnit]) -> float:
    """How many GPUs' worth a grant holds: whole units count 1 each, a share its fraction of the unit's memory."""
    if grant is None:
        return 0.0
    if grant.exclusive:
        return float(len(grant.uuids))
    total = sum(u.memory_bytes for u in units if u.uuid in grant.uuids)
    return grant.memory_bytes / total if total else 1.0
