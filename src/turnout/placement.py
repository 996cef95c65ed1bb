"""Where a task goes: `place` decides, for one queued task and the worker asking for work, the device, the
resources and GPUs it takes there and why, or that it stays queued.

Pure decisions over records the controller hands in (the worker, its free `Room`, the cluster's `Facts`): no
store, no clock. `gpu/allocation.py` picks GPUs within one worker, `gpu/policies.py` scores workers, `routing.py`
reads the `gpu` field, `profiles.py` weighs `auto` and warm processes, `batching.py` books batches; `place`
applies them all in one order, so the controller only loops over its queue, calls `place`, applies the room
change and writes. `turnout simulate` goes through the same fleet choice (`Fleet.best`, `online_mix`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from turnout import profiles
from turnout.access import ALL_TENANTS, worker_serves
from turnout.batching import BatchBook, OpenBatch, leads_batch
from turnout.errors import Conflict, InvalidInput
from turnout.gpu.allocation import (
    GpuGrant,
    GpuRequest,
    Strategy,
    add_grant,
    allocate,
    fits_ever,
    gpu_units_of,
    remove_grant,
    usage_from_grants,
)
from turnout.gpu.devices import GpuDevice, GpuUnit, MigDevice, units_of
from turnout.gpu.policies import Host, PlacementIndex, Typicals, make_policy, typical_mix
from turnout.models import Allocation, Device, GpuMode, Task, Variant, Worker
from turnout.resources import Resources
from turnout.routing import ClusterView, Route, WorkerOffer, route
from turnout.tenancy import LimitsTable

# Live placement estimates FGD's typical tasks from what runs now; one whole-GPU task is always among them,
# so a share is not put on a free GPU while a partly used one fits it (as a trace's mix would also say).
WHOLE_GPU = GpuRequest(count=1)
PLACEMENT_SETTLE_S = (
    1.0  # how long a GPU task waits for the policy's best worker before any fitting one takes it
)


@dataclass
class Room:
    """What a worker has free while one lease request is being filled."""

    cpu: float
    memory_bytes: int
    units: list[GpuUnit]
    usage: dict[str, Any]
    strategy: Strategy

    def take(self, task: Task, placed: Placement) -> None:
        """What `placed` holds leaves the room (a rider holds nothing of its own: its leader took it)."""
        if placed.riding is not None:
            return
        self.cpu -= placed.resources.cpu
        self.memory_bytes -= placed.resources.memory_bytes
        if placed.grant is not None:
            self.usage = add_grant(self.usage, placed.grant, workload(task), task.tenant)


def devices_from_dicts(gpus: Iterable[dict[str, Any]]) -> list[GpuDevice]:
    out = []
    for g in gpus:
        migs = tuple(MigDevice(**m) for m in g.get("mig_devices") or ())
        out.append(GpuDevice(**{**g, "mig_devices": migs}))
    return out


def room_of(worker: Worker, active: Sequence[Task]) -> Room:
    """What a worker has free: its capacity less what its leased and running tasks hold."""
    units = units_of(devices_from_dicts(worker.gpus), frozenset(worker.quarantined))
    grants = [(t.gpus, workload(t), t.tenant) for t in grant_holders(active) if t.gpus]
    cpu = worker.cpu - sum(t.alloc.cpu for t in active if t.alloc)
    memory = worker.memory_bytes - sum(t.alloc.memory for t in active if t.alloc)
    return Room(cpu, memory, units, usage_from_grants(grants), strategy_of(worker.strategy))


def ahead_room(worker: Worker, active: Sequence[Task], prefetch: int) -> Room | None:
    """What a worker with `prefetch` may still take to hold waiting for a free slot: its room counting every
    task it holds (running or waiting), widened by `prefetch` slots of its smallest variant; None: no
    prefetch, or a worker with no CPU variant (only a CPU task may wait for any slot, `may_wait`; a GPU task waits
    only after a running one, `Followers`)."""
    if prefetch <= 0 or not any(v.device is Device.CPU for v in worker.variants):
        return None
    room = room_of(worker, active)
    room.cpu += prefetch * smallest_cpu(worker)
    room.memory_bytes += prefetch * max((v.resources.memory_bytes for v in worker.variants), default=0)
    return room


@dataclass
class AheadBudget:
    """How much expected work a worker with `--prefetch auto` may still hold waiting for its slots, in
    CPU-seconds (a task's expected run seconds times its cores): a task held ahead waits, at worst, for the
    work held before it, so the budget bounds that wait whatever the tasks' sizes (`of`)."""

    left_s: float

    @classmethod
    def of(cls, worker: Worker, waiting: Iterable[tuple[float | None, float]], wait_s: float) -> AheadBudget:
        """`wait_s` of the worker's cores, less what waits there now: (expected run seconds, cores) of each
        task held waiting (an unknown run time counts as nothing: none is taken ahead while it is unknown)."""
        return cls(wait_s * worker.cpu - sum((run_s or 0.0) * cpu for run_s, cpu in waiting))

    def take(self, run_s: float | None, cpu: float) -> bool:
        """Book a task expected to run `run_s` on `cpu` cores; False (nothing booked) when its run time is
        unknown or it does not fit what is left."""
        if run_s is None or not math.isfinite(run_s):
            return False
        cost = max(run_s, 0.0) * cpu
        if cost > self.left_s + 1e-12:
            return False
        self.left_s -= cost
        return True


@dataclass
class Followers:
    """GPU tasks held ahead (`--prefetch` with `prefetch_gpu`): each follows one running GPU task of its worker
    (its leader: `Allocation.after`), waits there until the leader ends, and then takes the leader's CPU and
    memory, so a GPU share that frees starts the next task at once instead of idling through the round trip
    that reports the last one. A follower may be followed in turn (each waits for the one before it), up to
    `prefetch` followers waiting on the worker.

    A leader and its follower never run at once, so where the follower's grant is within its leader's (the
    same units, no more memory) the pair holds the leader's share only; any other follower's grant counts as
    held beside it. A new follower's GPUs are placed in the worker's GPUs less all that, but the grants of its
    leader and of the tasks its leader follows (all ended before it starts): its leader's share, or any share
    free now. Whatever starts there later was placed with it counted, so no share is ever held twice. A leader is a solo task, never a batch's or
    a pipeline stage's (a chained stage takes its room over), of the follower's tenant (no scrub between
    them), with no follower yet: one task waits per task it holds, at most.
    """

    worker: Worker
    by_id: dict[str, Task]  # every task the worker holds, running or waiting, and each follower placed now
    within: set[str]  # of those, the followers within their leaders' grants: counted through their leaders
    room: Room  # the worker's GPUs less every grant counted (and every grant placed now for its room)
    leaders: list[Task]  # solo GPU tasks it holds that no task follows yet, oldest lease first
    left: int  # followers it may still hold waiting

    @classmethod
    def of(cls, worker: Worker, held: Sequence[Task], listed: Iterable[str], waiting: Iterable[str],
           prefetch: int) -> Followers:  # fmt: skip
        """Of the tasks `worker` holds, those it listed (running, or a follower waiting) may lead; `prefetch`
        followers may wait there at most."""
        by_id = {t.id: t for t in held}
        within = {t.id for t in held if t.alloc is not None and t.alloc.after
                  and _within(t.gpus, by_id.get(t.alloc.after))}  # fmt: skip
        followed = {t.alloc.after for t in held if t.alloc is not None and t.alloc.after}
        known, waits = set(listed), set(waiting)
        leaders = [t for t in held if t.id in known and t.id not in followed and _may_lead(t)
                   and (t.id not in waits or (t.alloc is not None and t.alloc.after))]  # fmt: skip
        leaders.sort(key=lambda t: t.leased_at or 0.0)
        following = sum(1 for t in held if t.id in waits and t.alloc is not None and t.alloc.after)
        room = room_of(worker, [t for t in held if t.id not in within])
        return cls(worker, by_id, within, room, leaders, prefetch - following)

    def cpu(self) -> float:
        """The cores the followers this request may still place would take over (each its leader's)."""
        most = max((t.alloc.cpu for t in self.leaders if t.alloc is not None), default=0.0)
        return max(self.left, 0) * most

    def place(self, task: Task, facts: Facts, *, now: float) -> tuple[Placement, Task] | None:
        """Where `task` goes as a follower here, and the task it follows; None: no leader's room takes it."""
        if self.left <= 0:
            return None
        tried: set[tuple[Any, ...]] = set()
        for leader in self.leaders:
            alloc, grant = leader.alloc, leader.gpus
            assert alloc is not None and grant is not None  # `of` keeps only such leaders
            shape = (leader.tenant, alloc.cpu, alloc.memory, grant.memory_bytes, grant.exclusive, grant.uuids)
            if leader.tenant != task.tenant or shape in tried:
                continue
            tried.add(shape)
            room = self._room_after(leader)
            where = place(task, self.worker, room, facts, now=now) if room is not None else None
            if where is not None and where.device is Device.GPU and where.batch is BatchRole.SOLO:
                return where, leader
        return None

    def _room_after(self, leader: Task) -> Room | None:
        """The room once `leader` has ended, and with it every task it followed: its CPU and memory, and the
        GPUs less every grant counted but theirs (None: the books disagree; that leader is not followed)."""
        usage = self.room.usage
        try:
            for task_id in _chain(leader, self.by_id):
                ended = self.by_id[task_id]
                if task_id not in self.within and ended.gpus is not None:
                    usage = remove_grant(usage, ended.gpus, workload(ended))
        except Conflict:
            return None
        assert leader.alloc is not None
        return Room(leader.alloc.cpu, leader.alloc.memory, self.room.units, usage, self.room.strategy)

    def record(self, task: Task, where: Placement, leader: Task | None = None) -> None:
        """A placement this request made (a follower's with its `leader`, which no other task follows now). A
        follower is held from now on, and may lead in turn, after every leader before it (one more task per
        chain before any chain gets two)."""
        if leader is None:
            self.room.take(task, where)
            return
        self.leaders.remove(leader)
        self.left -= 1
        alloc = Allocation(cpu=where.resources.cpu, memory=where.resources.memory_bytes,
                           gpu_share=where.gpu_share, after=leader.id)  # fmt: skip
        follower = replace(task, gpus=where.gpus(), alloc=alloc)
        self.by_id[follower.id] = follower
        if _within(follower.gpus, leader):
            self.within.add(follower.id)
        else:
            self.room.take(follower, where)
        if _may_lead(follower):
            self.leaders.append(follower)


def _may_lead(task: Task) -> bool:
    """A solo GPU task, not a pipeline stage (a chained stage takes its room over when it ends)."""
    return (
        task.gpus is not None
        and task.alloc is not None
        and task.alloc.batch is None
        and not task.pipeline_run_id
    )


def _chain(task: Task, by_id: Mapping[str, Task]) -> set[str]:
    """The task and every held task it follows, directly or through others."""
    out = {task.id}
    after = task.alloc.after if task.alloc is not None else None
    while after is not None and after in by_id and after not in out:
        out.add(after)
        alloc = by_id[after].alloc
        after = alloc.after if alloc is not None else None
    return out


def _within(grant: GpuGrant | None, leader: Task | None) -> bool:
    """Whether `grant` holds no more than `leader`'s: the same units, no more memory on each, exclusive only
    where the leader's is."""
    held = leader.gpus if leader is not None else None
    return (grant is not None and held is not None and set(grant.uuids) == set(held.uuids)
            and grant.memory_bytes <= held.memory_bytes and (held.exclusive or not grant.exclusive))  # fmt: skip


def close(room: Room) -> None:
    """Nothing more is placed in `room` (a task waits for it and comes first); a batch's riders still ride."""
    room.cpu = -math.inf


def has_room(room: Room | None, smallest: float) -> bool:
    """Whether `room` (None: none at all) has the CPU for the worker's smallest variant."""
    return room is not None and room.cpu + 1e-9 >= smallest


def may_wait(where: Placement) -> bool:
    """Whether a task placed so may wait on its worker for a free slot (`ahead_room`): only on a CPU variant
    with no GPU and no batch. A GPU, or a batch's wait for riders, is never held idle behind another task."""
    return where.device is Device.CPU and where.grant is None and where.batch is BatchRole.SOLO


def gpu_worker(worker: Worker) -> bool:
    """A worker the fleet choice weighs: it has GPUs and offers a GPU variant."""
    return bool(worker.gpus) and any(v.device is Device.GPU for v in worker.variants)


def may_run_on_gpu(task: Task, worker: Worker) -> bool:
    """Whether `task` may run on a GPU variant of `worker` once its GPUs free: then no task taken ahead there
    may overtake it (`may_wait`), though it does not fit now."""
    return task.spec.gpu is not GpuMode.NEVER and Device.GPU in worker.offers(task.spec.capability)


def try_gpu(room: Room, res: Resources, task: Task) -> GpuGrant | None:
    """GPUs on this worker for `res` now, chosen by the worker's strategy; None if none fit."""
    if not fits(room, res) or not room.units:
        return None
    return allocate(GpuRequest.from_resources(res, workload(task), task.tenant), usable(room.units, task),
                    room.usage, room.strategy)  # fmt: skip


def serving(workers: Sequence[Worker], serves: Mapping[str, str], tenant: str) -> list[Worker]:
    """Those of `workers` that may serve `tenant` (`serves`: whom each serves; a worker not in it, every tenant)."""
    return [w for w in workers if worker_serves(serves.get(w.id, ALL_TENANTS), tenant)]


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
        if task.routing and task.routing.avoid_gpus:
            return None  # an OOM retry goes wherever it fits; the policy does not know about avoided GPUs
        request = GpuRequest.from_resources(res, workload(task), task.tenant)
        if self.index is None:
            policy = make_policy(self.policy, mix=online_mix(self.running, request))
            self.index = PlacementIndex(policy)
            for worker_id, room in self.rooms.items():
                self.index.upsert(worker_id, room.units, room.usage, Host(room.cpu, room.memory_bytes))
        choice = self.index.choose(request)
        return str(choice[0]) if choice else None


def online_mix(running: Iterable[GpuRequest], request: GpuRequest) -> Typicals:
    """FGD's typical tasks as a live cluster knows them: the GPU tasks running now, the one being placed and
    one whole GPU. The controller's fleet choice and `turnout simulate --mix online` both weigh this."""
    return typical_mix([*running, replace(request, tenant=None), WHOLE_GPU])  # shapes, not owners


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
    return task.alloc.batch if task.alloc else None


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
        ",".join(task.routing.avoid_gpus if task.routing else ()),
    )


def usable(units: Sequence[GpuUnit], task: Task) -> Sequence[GpuUnit]:
    """Units this task may use: not the GPUs it already ran out of memory on."""
    avoid = set(task.routing.avoid_gpus if task.routing else ())
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


def smallest_cpu(worker: Worker) -> float:
    """The fewest cores any variant of the worker asks: with less free, only a batch rider can still go."""
    return min((v.resources.cpu for v in worker.variants), default=0.0)


# ---- one task's placement ----------------------------------------------------------------------------


class Reads(Protocol):
    """The cluster facts `place` may need, read only when a task needs them (each costs a store read)."""

    def gpu_use(self) -> Mapping[str, float]:
        """GPUs each tenant holds now (a share counts its fraction)."""
        ...

    def gpu_rate_wait_s(self, tenant: str, n: int) -> float:
        """How long the tenant waits before `n` more GPU allocations fit its rate (0: now)."""
        ...

    def auto_fleet(self) -> profiles.Fleet:
        """What `gpu: auto` weighs: run-time profiles and the work queued and running."""
        ...

    def gpu_fleet(self) -> Fleet:
        """Every healthy GPU worker's room, scored by the placement policy."""
        ...

    def worker_tenants(self) -> Mapping[str, str]:
        """Whom each worker serves (ALL_TENANTS: every tenant)."""
        ...


@dataclass
class Facts:
    """What one lease request knows beyond the asking worker: the healthy workers, tenant limits and, read on
    the first task that needs them and kept for the rest of the request, the `Reads`. It also counts what this
    request has granted so far (`record`), so quotas and rates see the request's own grants."""

    workers: Sequence[Worker]  # the healthy ones
    reads: Reads
    limits: LimitsTable = field(default_factory=LimitsTable)
    granted: dict[str, int] = field(default_factory=dict)  # GPU grants planned in this request, per tenant
    planned_gpus: dict[str, float] = field(default_factory=dict)  # GPUs those grants hold, per tenant
    _views: dict[tuple[str, str, str, str], ClusterView] = field(default_factory=dict)
    _gpu_use: Mapping[str, float] | None = None
    _auto: profiles.Fleet | None = None
    _fleet: Fleet | None = None
    _serves: Mapping[str, str] | None = None
    _gpu_workers: frozenset[str] | None = None

    def cluster(self, task: Task) -> ClusterView:
        """What the workers that may serve the task's tenant could do for it: another tenant's private worker
        is no reason to wait for a GPU, nor to keep a task queued that none of its own can run."""
        key = (task.tenant, *view_key(task))
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = cluster_view(self.serving(task.tenant), task)
        return view

    def serving(self, tenant: str) -> Sequence[Worker]:
        """The healthy workers that may serve `tenant`."""
        serves = self.serves()
        return serving(self.workers, serves, tenant)

    def auto(self) -> profiles.Fleet:
        if self._auto is None:
            self._auto = self.reads.auto_fleet()
        return self._auto

    def fleet(self) -> Fleet:
        if self._fleet is None:
            self._fleet = self.reads.gpu_fleet()
        return self._fleet

    def other_gpu_workers(self, worker_id: str) -> bool:
        """Whether a healthy GPU worker other than `worker_id` could be the fleet's choice for a GPU task: with
        none, the choice is this worker or none, and the fleet (every GPU worker's tasks) is not read."""
        if self._gpu_workers is None:
            self._gpu_workers = frozenset(w.id for w in self.workers if gpu_worker(w))
        return len(self._gpu_workers) > (worker_id in self._gpu_workers)

    def serves(self) -> Mapping[str, str]:
        if self._serves is None:
            self._serves = self.reads.worker_tenants()
        return self._serves

    def gpu_refusal(self, tenant: str, share: float) -> str | None:
        """Why the tenant gets no GPU now though one fits (its `max_gpus`, its GPU allocation rate); None: it may."""
        quota = self.limits.of(tenant).max_gpus
        if quota is not None:
            if self._gpu_use is None:
                self._gpu_use = self.reads.gpu_use()
            held = self._gpu_use.get(tenant, 0.0) + self.planned_gpus.get(tenant, 0.0)
            if held + share > quota + 1e-9:
                return f"tenant {tenant} holds its max_gpus {quota:g}"
        if self.reads.gpu_rate_wait_s(tenant, 1 + self.granted.get(tenant, 0)) > 0:
            return f"tenant {tenant} is over its gpu_allocations_per_min"
        return None

    def record(self, task: Task, placed: Placement) -> None:
        """Count a placement's GPU grant against its tenant for the rest of this request."""
        if placed.grant is not None and placed.riding is None:
            self.granted[task.tenant] = self.granted.get(task.tenant, 0) + 1
            self.planned_gpus[task.tenant] = self.planned_gpus.get(task.tenant, 0.0) + (
                placed.gpu_share or 0.0
            )


class BatchRole(str, enum.Enum):
    SOLO = "solo"  # runs alone
    LEADER = "leader"  # opens a batch: later tasks of its tenant and capability may ride on its grant
    RIDER = "rider"  # rides on an open batch's grant and takes nothing of its own


@dataclass(frozen=True)
class Placement:
    """Where one task goes on the asking worker and what it holds there; the record the controller writes."""

    device: Device
    variant: Variant  # the variant that runs it
    resources: (
        Resources  # what it asks of the worker (a rider: its leader's variant's, held once by the leader)
    )
    reason: str  # routing.reason
    grant: GpuGrant | None = None  # its GPUs (a rider: its leader's)
    unit_memory_bytes: int | None = None  # the smallest granted unit's memory (the worker's memory fraction)
    gpu_share: float | None = None  # GPUs' worth the grant holds (what its cost and quota count)
    batch: BatchRole = BatchRole.SOLO
    riding: OpenBatch | None = None  # a rider's batch

    def gpus(self) -> GpuGrant | None:
        """The grant as the task row and the worker carry it: with its unit's whole memory."""
        if self.grant is None:
            return None
        return replace(self.grant, unit_memory_bytes=self.unit_memory_bytes)


def place(task: Task, worker: Worker, room: Room, facts: Facts, *, now: float,
          book: BatchBook | None = None) -> Placement | None:  # fmt: skip
    """Where `task` goes on `worker` now, or None to leave it queued (for another worker, or for later).

    In order: a ride on an open batch of its tenant and capability; the GPUs that fit here, withheld when the
    tenant is at its `max_gpus` or over its GPU allocation rate; the `gpu` field (`auto` by expected finish,
    else `routing.route`); warm affinity (a moment for a worker with the model loaded that may serve the
    tenant); the fleet's choice (a moment for the policy's best GPU worker). Nothing here changes `room` or
    `facts`: the caller applies a placement with `room.take` and `facts.record`.
    """
    offered = worker.offers(task.spec.capability)
    waited = now - (task.queued_at or task.created_at)
    cluster = facts.cluster(task)
    riding = book.joinable(task) if book is not None else None
    if riding is not None:
        ride = _ride(task, riding, offered, waited, cluster)
        if ride is not None:
            return ride
    if room.cpu + 1e-9 < smallest_cpu(worker):
        return None
    cpu_res = needs(offered.get(Device.CPU), task)
    gpu_res = needs(offered.get(Device.GPU), task)
    grant = try_gpu(room, gpu_res, task) if gpu_res else None
    share = gpu_units_of(grant, room.units) if grant is not None else 0.0
    no_gpu = facts.gpu_refusal(task.tenant, share) if grant is not None else None
    if no_gpu is not None:
        grant = None
    offer = WorkerOffer(
        cpu_variant=cpu_res is not None, gpu_variant=gpu_res is not None,
        cpu_fits=cpu_res is not None and fits(room, cpu_res), gpu_fits=grant is not None,
    )  # fmt: skip
    decision: Route | None = None
    if task.spec.gpu is GpuMode.AUTO and cluster.gpu_possible and cluster.cpu_possible:
        # earliest expected finish, once profiles exist (profiles.py); with one class possible there is
        # nothing to weigh, and `auto` routes as `prefer` does without reading the fleet
        # the slots and warm processes of the workers that may serve this tenant: another's private ones are
        # not there for it
        theirs = replace(facts.auto(), workers=tuple(facts.serving(task.tenant)))
        verdict = auto_route(theirs, task.spec.capability, offer, cluster)
        if isinstance(verdict, AutoRoute):
            if no_gpu is None:
                return None  # the other device class finishes it sooner: left for a worker that has it free
            # the GPU is sooner but not this tenant's now (quota, rate): the queue estimate knows nothing
            # of limits, so route as `prefer` does (wait gpu_wait_s, then the CPU)
        else:
            decision = verdict
    if decision is None:
        decision = route(task.spec.gpu, waited, task.spec.gpu_wait_s, offer, cluster)
    if decision is None or _leave_for_warm(task, worker, facts, decision.device, waited):
        return None
    if decision.device is Device.GPU and gpu_res is not None and facts.other_gpu_workers(worker.id):
        fleet = facts.fleet()
        fleet.update(worker.id, room)
        best = fleet.best(gpu_res, task)
        if best not in (None, worker.id) and waited < PLACEMENT_SETTLE_S:
            return None  # another worker fits it better: leave it to that worker for a moment
    reason = decision.reason
    if no_gpu is not None and decision.device is Device.CPU:
        reason = f"{no_gpu}; {reason}"
    last_error = (task.routing.last_error if task.routing else None) or {}
    avoided = task.routing.avoid_gpus if task.routing else ()  # none: the OOM came from a CPU run
    if last_error.get("type") == "gpu_oom" and decision.device is Device.CPU and avoided:
        reason = f"gpu out of memory on {', '.join(avoided)}; {reason}"
    res = gpu_res if decision.device is Device.GPU else cpu_res
    variant = offered.get(decision.device)
    if res is None or variant is None:  # route() only picks a device whose variant fits
        return None
    batch = BatchRole.LEADER if leads_batch(task, variant) else BatchRole.SOLO
    if decision.device is not Device.GPU or grant is None:
        return Placement(decision.device, variant, res, reason, batch=batch)
    unit_memory = min(u.memory_bytes for u in room.units if u.uuid in grant.uuids)
    return Placement(decision.device, variant, res, reason, grant, unit_memory, share, batch)


def _ride(task: Task, riding: OpenBatch, offered: Mapping[Device, Variant], waited: float,
          cluster: ClusterView) -> Placement | None:  # fmt: skip
    """The batch's grant is taken: the task fits exactly where its leader went, if its `gpu` value lets it."""
    ride = WorkerOffer(cpu_variant=Device.CPU in offered, gpu_variant=Device.GPU in offered,
                       cpu_fits=riding.device is Device.CPU, gpu_fits=riding.device is Device.GPU)  # fmt: skip
    routed = route(task.spec.gpu, waited, task.spec.gpu_wait_s, ride, cluster)
    if routed is None or routed.device is not riding.device:
        return None
    return Placement(riding.device, riding.variant, riding.variant.resources,
                     f"{routed.reason}; batched with {riding.leader.id}", riding.grant, riding.unit_memory_bytes,
                     riding.gpu_share, BatchRole.RIDER, riding)  # fmt: skip


def _leave_for_warm(task: Task, worker: Worker, facts: Facts, device: Device, waited: float) -> bool:
    """Warm affinity: a worker with the model loaded that may serve this tenant takes it after a moment.
    Whom workers serve is read only when a warm worker elsewhere could take it at all."""
    capability = task.spec.capability
    if not profiles.leave_for_warm(worker, facts.workers, capability, device, waited):
        return False
    return profiles.leave_for_warm(worker, facts.serving(task.tenant), capability, device, waited)


@dataclass(frozen=True)
class AutoRoute:
    """`auto`'s verdict for one task on the asking worker: a route, or device None (another class is sooner)."""

    device: Device | None
    reason: str = ""


def auto_route(
    fleet: profiles.Fleet, capability: str, offer: WorkerOffer, cluster: ClusterView
) -> Route | AutoRoute | None:
    """`auto` with history: the device class with the earliest expected finish, if this worker can run it now.
    None (no history for both classes, or the chosen class has no live worker): route as `prefer` does."""
    choice = profiles.choose(fleet.side(capability, Device.CPU), fleet.side(capability, Device.GPU))
    if choice is None:
        return None
    if (choice.device is Device.GPU and not cluster.gpu_possible) or (
        choice.device is Device.CPU and not cluster.cpu_possible
    ):
        return None
    fits = offer.gpu_fits if choice.device is Device.GPU else offer.cpu_fits
    return Route(choice.device, choice.reason) if fits else AutoRoute(None, choice.reason)
