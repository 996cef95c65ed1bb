"""Where a task fits: a worker's free room, what the cluster could serve, and the fleet-wide GPU choice.

Pure decisions over records the controller hands in (workers, their active tasks): no store, no clock.
`gpu/allocation.py` picks GPUs within one worker; `gpu/policies.py` scores workers; this module applies both
to tasks and variants, so the controller only gathers facts and writes outcomes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from turnout.errors import InvalidInput
from turnout.gpu.allocation import (
    GpuGrant,
    GpuRequest,
    Strategy,
    allocate,
    fits_ever,
    usage_from_grants,
)
from turnout.gpu.devices import GpuDevice, GpuUnit, MigDevice, units_of
from turnout.gpu.policies import Host, PlacementIndex, make_policy, typical_mix
from turnout.models import Device, Task, Variant, Worker
from turnout.resources import Resources
from turnout.routing import ClusterView

# Live placement estimates FGD's typical tasks from what runs now; one whole-GPU task is always among them,
# so a share is not put on a free GPU while a partly used one fits it (as a trace's mix would also say).
WHOLE_GPU = GpuRequest(count=1)


@dataclass
class Room:
    """What a worker has free while one lease request is being filled."""

    cpu: float
    memory_bytes: int
    units: list[GpuUnit]
    usage: dict[str, Any]
    strategy: Strategy


def devices_from_dicts(gpus: Iterable[dict[str, Any]]) -> list[GpuDevice]:
    out = []
    for g in gpus:
        migs = tuple(MigDevice(**m) for m in g.get("mig_devices") or ())
        out.append(GpuDevice(**{**g, "mig_devices": migs}))
    return out


def room_of(worker: Worker, active: Sequence[Task]) -> Room:
    """What a worker has free: its capacity less what its leased and running tasks hold."""
    units = units_of(devices_from_dicts(worker.gpus), frozenset(worker.quarantined))
    grants = [(GpuGrant.from_dict(t.gpus), workload(t), t.tenant) for t in grant_holders(active) if t.gpus]
    cpu = worker.cpu - sum(float((t.alloc or {}).get("cpu", 0)) for t in active)
    memory = worker.memory_bytes - sum(int((t.alloc or {}).get("memory", 0)) for t in active)
    return Room(cpu, memory, units, usage_from_grants(grants), strategy_of(worker.strategy))


def try_gpu(room: Room, res: Resources, task: Task) -> GpuGrant | None:
    """GPUs on this worker for `res` now, chosen by the worker's strategy; None if none fit."""
    if not fits(room, res) or not room.units:
        return None
    return allocate(GpuRequest.from_resources(res, workload(task), task.tenant), usable(room.units, task),
                    room.usage, room.strategy)  # fmt: skip


def cluster_view(workers: Sequence[Worker], task: Task) -> ClusterView:
    """What these workers could serve for `task` if they were idle (for routing and `no_capacity`)."""
    gpu_possible = cpu_possible = False
    for w in workers:
        offered = w.offers(task.spec.capability)
        cpu_res = needs(offered.get(Device.CPU), task)
        gpu_res = needs(offered.get(Device.GPU), task)
        if cpu_res and cpu_res.cpu <= w.cpu and cpu_res.memory_bytes <= w.memory_bytes:
            cpu_possible = True
        if gpu_res and gpu_res.cpu <= w.cpu and gpu_res.memory_bytes <= w.memory_bytes:
            units = usable(units_of(devices_from_dicts(w.gpus), frozenset(w.quarantined)), task)
            if fits_ever(GpuRequest.from_resources(gpu_res, workload(task)), units):
                gpu_possible = True
    return ClusterView(gpu_possible=gpu_possible, cpu_possible=cpu_possible)


class Fleet:
    """Every healthy GPU worker's free room, scored by the placement policy (the one `turnout simulate` replays).

    A worker asking for work takes a GPU task only when it is the policy's best choice among workers that
    could host the task now, so GPU tasks pack across the fleet, not merely within whichever worker asked
    first. FGD weighs fragmentation against the workload's typical tasks: here, the GPU tasks running now,
    the one being placed, and one whole GPU.
    """

    def __init__(self, policy: str, gpu_workers: Sequence[Worker], active: dict[str, list[Task]]) -> None:
        self.policy = policy
        self.rooms = {w.id: room_of(w, active.get(w.id, [])) for w in gpu_workers}
        self.running: list[GpuRequest] = []
        for w in gpu_workers:
            for t in grant_holders(active.get(w.id, [])):
                res = (
                    needs(w.offers(t.spec.capability).get(Device.GPU), t) if t.device is Device.GPU else None
                )
                if res is not None:
                    self.running.append(GpuRequest.from_resources(res, workload(t)))
        self.index: PlacementIndex | None = None

    def update(self, worker_id: str, room: Room) -> None:
        if worker_id in self.rooms:
            self.rooms[worker_id] = room
            if self.index is not None:
                self.index.upsert(worker_id, room.units, room.usage, Host(room.cpu, room.memory_bytes))

    def best(self, res: Resources, task: Task) -> str | None:
        """The worker the policy picks for this task now (None: none can host it now)."""
        if (task.routing or {}).get("avoid_gpus"):
            return None  # an OOM retry goes wherever it fits; the policy does not know about avoided GPUs
        request = GpuRequest.from_resources(res, workload(task), task.tenant)
        if self.index is None:  # the typical mix is about shapes, not owners
            mix = typical_mix([*self.running, replace(request, tenant=None), WHOLE_GPU])
            policy = make_policy(self.policy, mix=mix)
            self.index = PlacementIndex(policy)
            for worker_id, room in self.rooms.items():
                self.index.upsert(worker_id, room.units, room.usage, Host(room.cpu, room.memory_bytes))
        choice = self.index.choose(request)
        return str(choice[0]) if choice else None


def grant_holders(active: Sequence[Task]) -> list[Task]:
    """The tasks whose grants are held now: each task's own, and each batch's once (batching.py), by its leader
    while the leader is active, else by a rider still running on it (a cancelled or timed-out leader does
    not free the GPU its riders' process still uses, nor hand it to another tenant)."""
    ids = {t.id for t in active}
    held: set[str] = set()
    out = []
    for t in active:
        batch = batch_of(t)
        if batch is None:
            out.append(t)
        elif batch not in held and (batch == t.id or batch not in ids):
            held.add(batch)
            out.append(t)
    return out


def batch_of(task: Task) -> str | None:
    """The leader's id of the batch the task was leased in (its own id for a leader); None outside a batch."""
    batch = (task.alloc or {}).get("batch")
    return str(batch) if batch is not None else None


def needs(variant: Variant | None, task: Task) -> Resources | None:
    """The variant's requirement with the task's own overrides; None if the worker lacks the variant."""
    if variant is None:
        return None
    res = variant.resources.merged(task.spec.resources, task.spec.resource_keys)
    if variant.device is Device.CPU and res.wants_gpu:
        res = replace(res, gpu=0, gpu_memory_bytes=None, gpu_models=(), min_compute_capability=None)
    return res


def view_key(task: Task) -> tuple[str, str, str]:
    """Tasks with equal keys get the same ClusterView: same capability, overrides and avoided GPUs."""
    return (
        task.spec.capability,
        repr(task.spec.resources),
        ",".join((task.routing or {}).get("avoid_gpus", ())),
    )


def usable(units: Sequence[GpuUnit], task: Task) -> Sequence[GpuUnit]:
    """Units this task may use: not the GPUs it already ran out of memory on."""
    avoid = set((task.routing or {}).get("avoid_gpus", ()))
    return [u for u in units if u.uuid not in avoid and u.parent_uuid not in avoid] if avoid else units


def fits(room: Room, res: Resources) -> bool:
    return res.cpu <= room.cpu + 1e-9 and res.memory_bytes <= room.memory_bytes


def workload(task: Task) -> str | None:
    return task.spec.labels.get("workload") if task.spec.labels else None


def strategy_of(name: str) -> Strategy:
    try:
        return Strategy(name)
    except ValueError:
        raise InvalidInput(f"strategy: {name!r} is not pack or spread", field="strategy") from None
