"""The controller's orchestration: every state change goes through here, and nothing here decides alone.

Routing rules live in `routing.py`, GPU placement in `gpu/allocation.py`, durability in the store. This
module gathers the facts those need, calls them, and writes the outcome. All methods are synchronous and
run on the API's single database thread, so within one controller they never interleave; across
controllers (PostgreSQL) the store's conditional updates keep them honest.
"""

from __future__ import annotations

import collections
import contextlib
import difflib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, field, replace
from typing import Any

from turnout import placement, profiles
from turnout.access import ALL_TENANTS, worker_serves
from turnout.batching import BatchBook
from turnout.config import ControllerSettings
from turnout.errors import Conflict, IdempotencyConflict, InvalidInput, NotFound
from turnout.files import refs_in
from turnout.gpu.allocation import GpuGrant
from turnout.models import (
    ACTIVE_STATES,
    Allocation,
    Completion,
    Device,
    Lease,
    Routing,
    Task,
    TaskSpec,
    TaskState,
    Variant,
    Worker,
    WorkerState,
    new_id,
)
from turnout.routing import servable
from turnout.runs import Chains, RunView
from turnout.store import Store
from turnout.store.files import FileRecord
from turnout.store.replicas import hold_worker
from turnout.tenancy import (
    RecentTenants,
    Reservations,
    TenantBuckets,
    fair_order,
    gpu_allocation_rule,
    reservations,
    round_robin,
)

log = logging.getLogger("turnout.controller")

ACTIVE = tuple(ACTIVE_STATES)
LIVE_WORKER_STATES = (WorkerState.HEALTHY, WorkerState.DRAINING)
ENDED_KEPT = 20_000  # tasks whose ending result this controller remembers (`Controller._to_stop`)
RETRYABLE_ERRORS = frozenset({"gpu_oom", "worker_lost", "gpu_scrub_failed", "gpu_quarantined"})
# a retry goes to another GPU, not this one
AVOID_GPU_ERRORS = frozenset({"gpu_oom", "gpu_scrub_failed", "gpu_quarantined"})
WORKER_CACHE_S = 0.25  # how stale this controller's copy of the worker list may be
RUNNING_AFTER_S = 0.5  # a leased task the worker reports as running is marked so after this long
# A lease the worker does not list as held this long after it was given (at least; or one heartbeat period if
# longer) never reached it: its answer was lost. Longer than any lease round trip.
UNDELIVERED_AFTER_S = 3.0
# An unhealthy worker silent this long has left (an agent restarted under a new id, a host gone for good): it
# is marked gone, so the sweep, the worker list and the dashboard stop reading it twice a second for ever
WORKER_FORGOTTEN_S = 24 * 3600.0
UNDELIVERED_FREE = 5  # lost lease answers a task may have before they count against its max_retries
# what the audit log records (GET /v1/audit?kind=): append-only, one row per event
AUDIT_KINDS = frozenset({
    "gpu_allocated", "gpu_released", "gpu_scrubbed", "token_created", "token_revoked", "task_cancelled",
    "worker_registered", "worker_drained", "worker_lost", "worker_left",
})  # fmt: skip
QUEUED_TENANTS_CACHE_S = (
    0.5  # how stale the list of tenants with queued tasks may be (other controllers' submits)
)
Change = tuple[str, Sequence[TaskState], "int | None", dict[str, Any]]  # see SqlStore.update_tasks


@dataclass(frozen=True)
class LeaseResult:
    leases: list[Lease] = field(default_factory=list)
    cancel: list[str] = field(default_factory=list)  # task ids the worker must stop
    full: bool = False  # the worker has no room for anything it offers: only freed capacity changes that
    retry_in_s: float | None = None  # a batch is filling: ask again by then, even if nothing else changes
    backlog: bool = (
        False  # tasks it could serve stay queued (no room, or not its turn): its results should ask
    )
    # the worker's active tasks its list lacks (leased by its other request, or chained, after the list was
    # written): it may hold them unlisted, so a long poll watches them, and says so if they stop (`watching`)
    fresh: tuple[str, ...] = ()
    # listed tasks that ended here with their results in: a long poll lists them no more (nor looks them up)
    finished: tuple[str, ...] = ()
    offers: frozenset[str] | None = None  # the capabilities the worker offers (None: not looked at)
    looked: bool = False  # it read the queue for all it could take (not cut short: unhealthy, full, reserved)
    # tenants with work that may take nothing here now (what is free is kept for others' reserved_share): a
    # new task of theirs changes nothing until the worker's room, or who has work, changes
    barred: frozenset[str] = frozenset()


@dataclass(frozen=True)
class LeaseAsk:
    """A worker's request for work: how many tasks at most, and the tasks it holds (running, or finished
    with their results not yet sent), as listed when it wrote the request."""

    max_tasks: int
    running: Sequence[str] = ()
    tenant: str = ALL_TENANTS  # whom the worker serves
    # only for work the results it rides on queue themselves (a pipeline's next stage, a retry): the worker
    # asks because they may, and the controller alone knows whether they did
    if_queued: bool = False
    prefetch: int = 0  # tasks it would hold waiting beyond what runs (`Controller.lease`)
    prefetch_s: float | None = None  # only tasks known short, this many seconds of their work per core
    waiting: Sequence[str] = ()  # of `running`, those still waiting there for a free slot
    prefetch_gpu: bool = False  # GPU tasks may be held waiting too, each `after` a running one


@dataclass(frozen=True)
class Exchange:
    """What one report from a worker did: its results, the pipeline stages they queued, and its next lease."""

    accepted: list[str]
    refused: list[str]
    queued: Sequence[Task]  # tasks queued by these results (pipelines' next stages)
    lease: LeaseResult | None = None  # None: the worker asked for no work
    chains: Chains = field(default_factory=Chains)  # the next stages these results said were started
    runs: frozenset[str] = frozenset()  # pipeline runs whose stages these results ended
    # the tasks and runs these results ended that someone waits on, as committed (`Controller.exchange`)
    ended_tasks: Mapping[str, Task] = field(default_factory=dict)
    ended_runs: Mapping[str, RunView] = field(default_factory=dict)


@dataclass(frozen=True)
class Settled:
    """What became of a worker's results: accepted or refused, and the chained stages they named."""

    accepted: list[str]
    refused: list[str]
    chains: Chains
    runs: frozenset[str] = frozenset()  # pipeline runs whose stages these results ended
    # the tasks these results ended, and the runs they moved on, as this transaction wrote them
    ended: Mapping[str, Task] = field(default_factory=dict)
    views: Mapping[str, RunView] = field(default_factory=dict)


class Controller:
    def __init__(
        self, store: Store, settings: ControllerSettings, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.store = store
        self.settings = settings
        self.clock = clock
        self._fleet_cache: tuple[float, dict[str, Worker]] | None = None
        self._known: set[str] = set()  # capabilities known to be registered; re-read from the store on a miss
        self._known_for: dict[
            str, frozenset[str]
        ] = {}  # per tenant: those a worker that may serve it registered
        self._serves: Mapping[
            str, str
        ] = {}  # worker id -> whom it serves: a credential never changes once written
        self._serves_read: set[str] = set()  # the workers `_serves` was read with (some have no credential)
        # No worker is judged silent within three heartbeats of this moment: after a controller restart (or
        # an outage), workers get their full allowance to reach it again before their work is re-queued.
        self.started_at = clock()
        self.lease_expiries = 0  # tasks this controller took back from workers that died (a /metrics counter)
        self.gpu_allocations = TenantBuckets(gpu_allocation_rule(settings.tenant_limits), clock)
        self._queued_tenants: tuple[float, set[str]] | None = None
        self._turn = 0  # which tenant's queue a lease looks at first: rotates, so none is always first
        self._recent = RecentTenants()  # who submitted lately: they keep their reserved_share
        from turnout.runs import PipelineRuns

        self.runs = PipelineRuns(self)  # pipeline runs: advanced in the same call that ends a stage
        self._samples = profiles.PendingSamples()  # finished tasks' run times, written about once a second
        self._run_times = profiles.RecentRunTimes()  # what `--prefetch auto` weighs (`lease`)
        self._ended_by: dict[str, str] = {}  # task id -> the worker whose own result ended it (`_to_stop`)

    # ---- tasks -------------------------------------------------------------------------------

    def submit(
        self,
        tenant: str,
        specs: Sequence[TaskSpec],
        *,
        prefixes: Sequence[str] | None = None,
        waits_for_capacity: Sequence[bool] | None = None,
    ) -> list[Task]:
        """Queue tasks, all or none; a reused idempotency_key answers its first task (same request) or 409.

        A capability no worker ever registered is refused at once, naming close matches (a typo must not
        wait out placement_timeout_s), unless the spec `waits_for_capacity`: its client set the timeout
        itself, for workers yet to come. `prefixes` place each spec in the request (`"tasks.3."`), so an error
        names the field the client wrote.
        """
        where = list(prefixes) if prefixes is not None else [""] * len(specs)
        patient = list(waits_for_capacity) if waits_for_capacity is not None else [False] * len(specs)
        for spec, prefix, waits in zip(specs, where, patient, strict=True):
            if not waits:
                self.check_known(spec.capability, f"{prefix}capability", tenant)
        self.check_files(tenant, [(prefix, spec.input) for spec, prefix in zip(specs, where, strict=True)])
        now = self.clock()
        tasks = [
            Task(
                id=new_id("t_"), tenant=tenant, spec=s, state=TaskState.QUEUED, created_at=now, queued_at=now
            )
            for s in specs
        ]
        self.queued_for(tenant)
        try:
            return self.store.insert_tasks(tasks)
        except IdempotencyConflict as exc:
            field = f"{where[exc.index]}idempotency_key"
            earlier = None if exc.earlier is None else f"{where[exc.earlier]}idempotency_key"
            raise IdempotencyConflict(exc.key, exc.task_id, index=exc.index, field=field, earlier=exc.earlier,
                                      earlier_field=earlier) from None  # fmt: skip

    def queued_for(self, tenant: str) -> None:
        """A task of `tenant` is being queued: shared workers look at its queue from now on."""
        self._recent.saw(tenant, self.clock())
        if self._queued_tenants is not None:
            self._queued_tenants[1].add(tenant)

    def check_known(self, capability: str, field_name: str, tenant: str) -> None:
        """A capability some worker this tenant may use registered, or an InvalidInput naming `field_name`.
        One only another tenant's private workers registered is answered as one nobody did: the tenant learns
        nothing of it, and its task would wait for workers that never take it."""
        if capability in self._known_for.get(tenant, ()):
            return
        if capability not in self._known:
            self._known = self.store.known_capabilities()  # another controller may have met a new worker
        mine = self._known_for[tenant] = frozenset(self._capabilities_for(tenant) & self._known)
        if capability in mine:
            return
        names = sorted(mine)  # the hint names only what workers this tenant may use registered
        close = difflib.get_close_matches(capability, names, n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        known = f" (known: {', '.join(names[:20])})" if names and not close else ""
        raise InvalidInput(
            f"{field_name}: no worker has ever registered {capability!r}{hint}{known}. To queue it for workers "
            "that will register later, set placement_timeout_s",
            field=field_name,
        )

    def _capabilities_for(self, tenant: str) -> set[str]:
        """Capabilities registered by workers (gone ones included) that may serve `tenant`."""
        serves = self.store.worker_tenants()
        return {v.capability for w in self.store.list_workers(include_gone=True)
                if worker_serves(serves.get(w.id, ALL_TENANTS), tenant) for v in w.variants}  # fmt: skip

    def check_files(self, tenant: str, inputs: Sequence[tuple[str, Any]]) -> None:
        """Every `{"$file": ID}` in these inputs (each with the prefix of its field: `tasks.3.`) names a file of
        this tenant that has not expired (another tenant's is not there), or an InvalidInput naming where it is
        referred to."""
        refs = [(f"{prefix}{path}", file_id) for prefix, value in inputs
                for path, file_id in refs_in(value)]  # fmt: skip
        if not refs:
            return
        owned = self.store.files.owned({file_id for _, file_id in refs}, tenant, self.clock())
        for path, file_id in refs:
            if file_id not in owned:
                raise InvalidInput(f"{path}: no file {file_id!r} (upload it with POST /v1/files or "
                                   "`turnout file put`)", field=path)  # fmt: skip

    def _remember_capabilities(self, variants: Sequence[Variant], now: float) -> None:
        names = {v.capability for v in variants} - self._known
        if names:
            self.store.remember_capabilities(names, now)
            self._known = self._known | names

    def get_task(self, tenant: str | None, task_id: str) -> Task:
        task = self.store.get_task(task_id)
        if task is None or (tenant is not None and task.tenant != tenant):
            raise NotFound(f"task {task_id} not found", field="id")
        return task

    def list_tasks(self, tenant: str | None, **filters: Any) -> list[Task]:
        return self.store.list_tasks(tenant=tenant, **filters)

    def cancel(self, tenant: str | None, task_id: str, *, by: str | None = None) -> Task:
        task = self.get_task(tenant, task_id)
        if task.state.terminal:
            raise Conflict(f"task {task_id} already {task.state.value}", field="id")
        now = self.clock()
        changed = self.store.update_tasks(
            [(task_id, (TaskState.QUEUED, *ACTIVE), None,
              {"state": TaskState.CANCELLED, "finished_at": now, "error": {"type": "cancelled", "message": "cancelled by request"}})]
        )  # fmt: skip
        if changed:
            self.audit("task_cancelled", task.tenant, {"task": task_id, "worker": task.worker_id,
                                                        "state": task.state.value, "by": by})  # fmt: skip
            self._audit_releases([task], now)
            if task.pipeline_run_id:
                self.runs.advance(changed)
        return self.get_task(tenant, task_id)

    # ---- workers -----------------------------------------------------------------------------

    def register_worker(
        self,
        *,
        name: str,
        host: str,
        variants: Sequence[Variant],
        cpu: float,
        memory_bytes: int,
        gpus: Sequence[dict[str, Any]],
        strategy: str,
        heartbeat_s: float | None = None,
        worker_id: str | None = None,
        tenant: str = ALL_TENANTS,
    ) -> Worker:
        """Record a worker (new, or registering again under its id). `tenant`: whom it serves ("*": all)."""
        now = self.clock()
        worker = Worker(
            id=worker_id or new_id("w_"), name=name, host=host, state=WorkerState.HEALTHY, variants=tuple(variants),
            cpu=cpu, memory_bytes=memory_bytes, gpus=tuple(gpus), strategy=strategy, registered_at=now,
            last_heartbeat=now, heartbeat_s=heartbeat_s or self.settings.heartbeat_s,
        )  # fmt: skip
        self.store.upsert_worker(worker)
        self._remember_capabilities(variants, now)
        self._fleet_cache = None
        self.audit("worker_registered", _audit_tenant(tenant), {"worker": worker.id, "name": name, "host": host,
                                                                 "serves": tenant, "gpus": [g.get("uuid") for g in gpus]})  # fmt: skip
        return worker

    def heartbeat(
        self,
        worker_id: str,
        *,
        metrics: dict[str, Any] | None = None,
        quarantined: dict[str, str] | None = None,
        at: float | None = None,
    ) -> Worker:
        """Store a heartbeat that arrived `at` (default: now); a worker that was unhealthy is healthy again."""
        worker = self._worker(worker_id)
        if worker.state is WorkerState.GONE:
            raise NotFound(f"worker {worker_id} has left; register again", field="worker")
        arrived = at if at is not None else self.clock()
        values: dict[str, Any] = {"last_heartbeat": max(worker.last_heartbeat, arrived)}
        if metrics is not None:
            values["metrics"] = metrics
        if quarantined is not None:
            values["quarantined"] = quarantined
        if worker.state is WorkerState.UNHEALTHY:
            values["state"] = WorkerState.HEALTHY.value  # it came back; its old leases were already re-queued
        if "state" in values or (quarantined is not None and quarantined != worker.quarantined):
            self._fleet_cache = None
        self.store.update_worker(worker_id, **values)
        state = WorkerState(values.get("state", worker.state.value))
        return replace(worker, last_heartbeat=values["last_heartbeat"], state=state)

    def drain(self, worker_id: str, *, by: str | None = None) -> Worker:
        self._worker(worker_id)
        if self.store.update_worker(
            worker_id, (WorkerState.HEALTHY, WorkerState.UNHEALTHY), state=WorkerState.DRAINING.value
        ):
            self.audit("worker_drained", self.worker_tenant(worker_id), {"worker": worker_id, "by": by})
        self._fleet_cache = None
        return self._worker(worker_id)

    def deregister(self, worker_id: str) -> None:
        """A worker leaving cleanly: its unfinished tasks go back to the queue at once."""
        self._worker(worker_id)
        if self.store.update_worker(worker_id, state=WorkerState.GONE.value):
            self.audit("worker_left", self.worker_tenant(worker_id), {"worker": worker_id})
        self._fleet_cache = None
        self._requeue_lost(self.store.active_tasks([worker_id], inputs=False), "worker left")

    def serves_of(self, workers: Sequence[Worker]) -> Mapping[str, str]:
        """Whom each of these workers serves (one absent: every tenant). Read again only when one of them was
        not there at the last read: a lease asks for it far more often than a worker registers."""
        if any(w.id not in self._serves_read for w in workers):
            self._serves = self.store.worker_tenants()
            self._serves_read = set(self._serves) | {w.id for w in workers}
        return self._serves

    def worker_tenant(self, worker_id: str) -> str | None:
        """The tenant a worker serves, for its audit records; None for a shared pool (the operator's)."""
        cred = self.store.get_worker_credential(worker_id)
        return _audit_tenant(cred["tenant"]) if cred else None

    def connection_closed(self, worker_id: str, closed_at: float) -> bool:
        """The worker's held connection closed and it did not come back: its process is gone (a SIGKILL, a
        crash). Mark it unhealthy and re-queue its tasks now. A heartbeat stored since `closed_at` means it
        lives, and nothing happens; so does a worker already judged. Returns whether anything changed."""
        worker = self.store.get_worker(worker_id)
        if worker is None or worker.state not in LIVE_WORKER_STATES or worker.last_heartbeat > closed_at:
            return False
        if not self.store.update_worker(worker_id, LIVE_WORKER_STATES, state=WorkerState.UNHEALTHY.value):
            return False
        self._fleet_cache = None
        self.audit("worker_lost", self.worker_tenant(worker_id), {"worker": worker_id, "name": worker.name,
                                                                  "last_heartbeat": worker.last_heartbeat,
                                                                  "reason": "connection closed"})  # fmt: skip
        log.warning("worker %s closed its connection and did not come back: unhealthy", worker.name,
                    extra={"worker_id": worker_id})  # fmt: skip
        held = self.store.active_tasks([worker_id], inputs=False)
        taken = self._requeue_lost(held, "worker connection closed")
        self.lease_expiries += len(taken)
        return True

    def forget_cached(self) -> None:
        """Drop what was read inside a transaction that was then lost: it may describe rows that never were."""
        self._fleet_cache = None
        self._known = set()  # re-read on the next miss
        self._known_for = {}
        self._serves, self._serves_read = {}, set()
        self._queued_tenants = None
        self.runs.forget_kept()

    def workers(self) -> list[Worker]:
        return self.store.list_workers()

    def _fleet(self) -> dict[str, Worker]:
        """Live workers by id, re-read at most every WORKER_CACHE_S: a lease is asked for far more often than
        the fleet changes. A change made through this controller drops the copy at once."""
        now = time.monotonic()
        if self._fleet_cache is None or now - self._fleet_cache[0] > WORKER_CACHE_S:
            self._fleet_cache = (now, {w.id: w for w in self.store.list_workers()})
        return self._fleet_cache[1]

    def _worker(self, worker_id: str) -> Worker:
        worker = self.store.get_worker(worker_id)
        if worker is None:
            raise NotFound(f"worker {worker_id} not found", field="worker")
        return worker

    # ---- leasing -----------------------------------------------------------------------------

    def lease(
        self,
        worker_id: str,
        *,
        max_tasks: int,
        running: Sequence[str] = (),
        tenant: str = ALL_TENANTS,
        listed_at: float | None = None,
        watching: Sequence[str] = (),
        prefetch: int = 0,
        prefetch_s: float | None = None,
        waiting: Sequence[str] = (),
        prefetch_gpu: bool = False,
    ) -> LeaseResult:
        """Give the worker queued tasks that fit its free resources, routed per their `gpu` value.

        `running` is what the worker believes it runs: anything there that is no longer its active lease
        (cancelled, timed out, re-queued after it was thought lost) comes back in `cancel`. The reverse too:
        a task leased to it that it does not list, though the list was written (`listed_at`, default now) well
        after the lease was given, never reached it (the answer was lost on the way) and goes back to the
        queue, its capacity freed. A long poll's list is as old as the poll: a task leased since, through the
        worker's other request or chained after a stage it ran, is not missing from it; such tasks come back in
        `fresh`, and a poll that passes them as `watching` hears in `cancel` when they are stopped, as it would
        for tasks it listed. `tenant` is whom the worker serves ("*": every tenant,
        taken in turn). A tenant at its GPU quota (`max_gpus`) or over its GPU allocation rate gets no GPU now:
        its GPU-only tasks stay queued, the others route as if the GPUs were busy.

        `prefetch`: with its room full, the worker takes up to this many more tasks to hold waiting for a free
        slot (as smallest-variant slots' worth of CPU), so a slot that ends starts the next at once instead of
        idling through the round trip that reports it: a task routed to the CPU with no GPU and no batch, never
        where the room is kept for tenants (`reserved_share`). Those are `ahead` (Allocation.ahead); the worker
        lists the ones that have not started in `waiting`: they do not count against its room for what starts
        at once, nor as started. While a task waits there, and from the first one taken ahead, nothing more is
        leased for the room: the waiting tasks take it first, in the order they came, and none is overtaken by
        a smaller one that fits what is free. Taking ahead stops at a queued task that would run here once room
        frees but may not wait (a GPU, a batch): what is taken ahead of it would take that room first, for ever.
        A task held ahead that never said it started is, when its worker is lost or leaves, counted as a lease
        that never arrived (`_unstarted_counted`), not against its `max_retries`. `prefetch_s` (a worker's
        `--prefetch auto`): only tasks whose recent run time on the CPU this controller knows are held ahead, and
        only while the expected work waiting there stays within `prefetch_s` of the worker's cores
        (`placement.AheadBudget`): a task of unknown or too long a run time stops taking ahead, as a GPU does.
        `prefetch_gpu` (a worker that starts a lease's `after` task only when that task ends there): a GPU task
        may be held waiting too, each following a running GPU task on its share (`placement.Followers`); one
        that no running task may lead stops taking ahead.

        Room is computed from the store, after waiting for any other lease of this worker to commit
        (`hold_worker`): two requests at once, on one controller or two, never over-commit it.
        """
        now = self.clock()
        listed_at = now if listed_at is None else min(listed_at, now)
        fleet = self._fleet()
        worker = fleet.get(worker_id) or self._worker(worker_id)
        if worker.state is WorkerState.GONE:
            raise NotFound(f"worker {worker_id} has left; register again", field="worker")
        if worker.state is WorkerState.HEALTHY and max_tasks > 0:
            hold_worker(self.store, worker_id)  # before its tasks are read: they are what the room is made of
        active = self.store.active_tasks([worker_id], inputs=False)  # its room needs none of their inputs
        mine = {t.id: t for t in active if t.worker_id == worker_id}
        held = set(running)
        grace_s = max(UNDELIVERED_AFTER_S, worker.heartbeat_s)
        undelivered = [t for t in mine.values() if t.state is TaskState.LEASED and t.id not in held
                       and listed_at - (t.leased_at or now) > grace_s]  # fmt: skip
        for task_id in self._requeue_undelivered(undelivered, now):
            del mine[task_id]
        stale = [tid for tid in dict.fromkeys([*running, *watching]) if tid not in mine]
        cancel = self._to_stop(worker, stale)
        finished = tuple(tid for tid in stale if tid not in set(cancel))
        offers = frozenset(v.capability for v in worker.variants)
        fresh = tuple(tid for tid in mine if tid not in held)  # a chained one's lease dates from its start
        # a task shows `running` once it has run a moment: a short one goes leased -> succeeded with no extra
        # write (and fsync) on its path; its started_at comes with its result
        waits = set(waiting)
        started = [t for t in mine.values() if t.state is TaskState.LEASED and t.id in held
                   and t.id not in waits and now - (t.leased_at or now) >= RUNNING_AFTER_S]  # fmt: skip
        if started:
            self.store.update_tasks(
                [
                    (t.id, (TaskState.LEASED,), t.attempts, {"state": TaskState.RUNNING, "started_at": now})
                    for t in started
                ]
            )
        if worker.state is not WorkerState.HEALTHY or max_tasks <= 0:
            return LeaseResult([], cancel, fresh=fresh, finished=finished, offers=offers)
        # a task waiting with a GPU grant holds it already (its leader's share: `placement.Followers`)
        room = placement.room_of(worker, [t for t in mine.values() if t.id not in waits or t.gpus])
        smallest = placement.smallest_cpu(worker)
        shares = self._reservations(worker, mine.values(), tenant, now)  # tenancy.Reservations
        # what it may hold running and waiting together (None: no prefetch)
        ahead = placement.ahead_room(worker, list(mine.values()), prefetch) if shares is None else None
        followers = (placement.Followers.of(worker, list(mine.values()), held, waits, prefetch)
                     if shares is None and prefetch > 0 and prefetch_gpu else None)  # fmt: skip
        budget = None  # with `prefetch_s`: the expected work it may still hold waiting
        if (ahead is not None or followers is not None) and prefetch_s is not None:
            held_waiting = [(self._expected_run_s(t), t.alloc.cpu)
                            for t in mine.values() if t.id in waits and t.alloc is not None]  # fmt: skip
            budget = placement.AheadBudget.of(worker, held_waiting, prefetch_s)
        if (ahead is not None or followers is not None) and not waits.isdisjoint(mine):
            placement.close(room)  # tasks wait there for room: they take it first, in the order they came

        def may_lead() -> bool:  # a task held here may still have a task follow it
            return followers is not None and bool(followers.leaders) and followers.left > 0

        if room.cpu + 1e-9 < smallest and not placement.has_room(ahead, smallest) and not may_lead():
            # nothing it offers fits now
            return LeaseResult(
                [], cancel, full=True, backlog=True, fresh=fresh, finished=finished, offers=offers
            )
        healthy = [w for w in fleet.values() if w.state is WorkerState.HEALTHY]
        facts = placement.Facts(healthy, _LeaseReads(self, healthy), self.settings.tenant_limits)
        book = BatchBook()  # batched variants: tasks that ride on their leader's grant (batching.py)
        # read what fits and one more (to tell the worker more waits); further, in growing pages, only while
        # the head of the queue is not for us (store.base.queue_pages): each row read costs its decoding
        free_cpu = max(room.cpu, ahead.cpu if ahead is not None else 0.0) + (
            followers.cpu() if followers else 0.0
        )
        slots = min(max_tasks, int((free_cpu + 1e-9) / smallest) if smallest > 0 else max_tasks)
        window = min(self.settings.lease_window, slots + 1)
        if shares is not None and not shares.anyone_may_take(smallest, room.cpu):
            # what is free here is kept for tenants with none queued
            barred = shares.barred(smallest, room.cpu)
            return LeaseResult([], cancel, fresh=fresh, finished=finished, offers=offers, barred=barred)
        placed: list[tuple[Task, placement.Placement]] = []
        ahead_of: set[str] = set()  # the placed tasks that wait on the worker for room
        after: dict[str, str] = {}  # a placed GPU task held ahead -> the running task it follows
        seen = 0
        for task in self._queue({v.capability for v in worker.variants}, window, tenant):
            seen += 1
            if len(placed) >= max_tasks or (room.cpu + 1e-9 < smallest and not book.has_room()
                                            and not placement.has_room(ahead, smallest) and not may_lead()):  # fmt: skip
                break
            where = placement.place(task, worker, room, facts, now=now, book=book)
            leader = None
            if where is None and may_lead() and placement.may_run_on_gpu(task, worker):
                assert followers is not None
                found = followers.place(task, facts, now=now)
                if found is None:
                    followers = None  # no task after it may follow a GPU task ahead of it
                elif budget is not None and not budget.take(self._expected_run_s(task, Device.GPU),
                                                            found[0].resources.cpu):  # fmt: skip
                    followers, ahead = None, None  # not known short enough to wait: nothing more waits
                else:
                    where, leader = found
                    after[task.id] = leader.id
                    ahead_of.add(task.id)
                    placement.close(room)  # it waits for its leader: no task after it may take room first
            if where is None and ahead is not None and placement.has_room(ahead, smallest):
                where = placement.place(task, worker, ahead, facts, now=now)
                if where is not None and (not placement.may_wait(where) or (
                        budget is not None and not budget.take(self._expected_run_s(task), where.resources.cpu))):  # fmt: skip
                    # it would run here once room frees (a GPU, a batch, a task not known short enough to
                    # wait): what is taken ahead of it would take that room first, task after task, so nothing
                    # more is
                    where, ahead = None, None
                elif where is None and placement.may_run_on_gpu(task, worker):
                    ahead = None  # it waits for a GPU here: nothing after it is taken ahead of it
                elif where is not None:
                    ahead_of.add(task.id)
                    placement.close(room)  # it waits for room: no task after it may take room before it
            if where is None:
                continue
            if where.riding is not None:
                where.riding.members.append(task.id)
            elif shares is not None and not shares.take(task.tenant, where.resources.cpu, room.cpu):
                if not book.has_room() and not shares.anyone_may_take(smallest, room.cpu):
                    break  # the rest is kept for tenants with nothing queued: read no further
                continue  # the rest of this shared worker is another tenant's reserved_share
            else:
                if task.id not in ahead_of:
                    room.take(task, where)
                if ahead is not None:
                    ahead.take(task, where)
                if followers is not None:
                    followers.record(task, where, leader)
                facts.record(task, where)
                if where.batch is placement.BatchRole.LEADER:
                    book.start(task, where.device, where.variant, where.grant, where.gpu_share,
                               where.unit_memory_bytes)  # fmt: skip
            placed.append((task, where))
        retry_in_s = None
        backlog = seen > len(placed)
        filling = book.waiting(now)  # batches still filling: leased once full or their wait is over
        if filling:
            skip = {tid for b in filling for tid in b.members}
            placed = [(t, p) for t, p in placed if t.id not in skip]
            retry_in_s = min(b.wait_left_s(now) for b in filling)
        leases: list[Lease] = []
        if placed:
            leased = [_leased(task, where, worker_id, now, book, ahead=task.id in ahead_of, after=after.get(task.id))
                      for task, where in placed]  # fmt: skip
            won = set(self.store.update_tasks([change for change, _ in leased]))
            leases = [lease for _, lease in leased if lease.task.id in won]
            allocated = [lease for lease in leases if lease.grant and lease.batch in (None, lease.task.id)]
            for lease in allocated:  # a batch still filling or a lost race allocated nothing: no token taken
                self.gpu_allocations.take(lease.task.tenant)
            self._audit_allocations(worker_id, allocated, now)
        # what it was given filled it
        full = (
            bool(leases)
            and room.cpu + 1e-9 < smallest
            and not placement.has_room(ahead, smallest)
            and not may_lead()
        )
        return LeaseResult(leases, cancel, full=full, retry_in_s=retry_in_s, backlog=backlog, fresh=fresh,
                           finished=finished, offers=offers, looked=True)  # fmt: skip

    def _expected_run_s(self, task: Task, device: Device | None = None) -> float | None:
        """How long a task of this capability likely runs on `device` (default: where it was leased, else a
        CPU), as results here said (`--prefetch auto`)."""
        return self._run_times.expected(task.spec.capability, (device or task.device or Device.CPU).value)

    def _reservations(
        self, worker: Worker, mine: Iterable[Task], tenant: str, now: float
    ) -> Reservations | None:
        """What a shared worker keeps for each tenant with work (`tenancy.reservations`); None: nothing."""
        if tenant != ALL_TENANTS or not self.settings.tenant_limits.any_reserved_share:
            return None
        held: dict[str, float] = {}
        for t in mine:
            held[t.tenant] = held.get(t.tenant, 0.0) + (t.alloc.cpu if t.alloc else 0.0)
        queued = self.store.queued_tenants()  # fresh: who may take decides whether the queue is read at all
        return reservations(self.settings.tenant_limits, worker.cpu, held, queued, self._recent.within(now))

    def _requeue_undelivered(self, tasks: Sequence[Task], now: float) -> list[str]:
        """Put back leases whose answer never reached their worker; returns the ids that changed.

        The attempt number stays spent (it is the fencing token a result must carry, never handed out twice),
        but the attempt does not count against `max_retries`, since nothing ran: `routing.undelivered` counts
        these. Past UNDELIVERED_FREE of them they do count, so a task whose lease can never be delivered
        still ends (`worker_lost`) instead of going round for ever.
        """
        updates: list[Change] = []
        for t in tasks:
            routing = replace(t.routing or Routing(), undelivered=_undelivered(t) + 1)
            if t.attempts - min(routing.undelivered, UNDELIVERED_FREE) > t.spec.max_retries:
                error = {"type": "worker_lost", "message": "its leases never reached a worker"}
                values: dict[str, Any] = {"state": TaskState.FAILED, "error": error, "finished_at": now,
                                          "routing": routing}  # fmt: skip
            else:
                values = {"state": TaskState.QUEUED, "worker_id": None, "device": None, "gpus": None,
                          "gpu_model": None, "queued_at": now, "routing": routing, "alloc": None}  # fmt: skip
            updates.append((t.id, (TaskState.LEASED,), t.attempts, values))
        done = self.store.update_tasks(updates) if updates else []
        for t in tasks:
            if t.id in done:
                self.queued_for(t.tenant)
                log.warning("task %s: its lease never reached worker %s; taken back", t.id, t.worker_id)
        self._audit_releases([t for t in tasks if t.id in done], now)
        return done

    def queued_fairly(self, caps: set[str], limit: int) -> Iterator[Task]:
        """Queued tasks of these capabilities, every tenant's in the fair order shared workers lease in."""
        return self._queue(caps, limit, ALL_TENANTS)

    def _queue(self, caps: set[str], window: int, tenant: str) -> Iterator[Task]:
        """Queued tasks a worker serving `tenant` may take: that tenant's in order, or, for a shared worker,
        every tenant's in turn (round-robin), the tenant holding the fewest running tasks first, so a flood
        from one tenant does not starve the others: a calm tenant's task takes the next free slot."""
        widen = self.settings.lease_window
        if tenant != ALL_TENANTS:
            return self.store.queued_tasks(caps, limit=window, widen_to=widen, tenant=tenant)
        tenants = self._tenants_queued()
        if len(tenants) <= 1:
            return self.store.queued_tasks(caps, limit=window, widen_to=widen)
        self._turn += 1
        order = fair_order(tenants, self.store.active_by_tenant(), self._turn)
        per = max(2, -(-window // len(order)))  # each tenant's share of the first look, read on as needed
        return round_robin(
            [self.store.queued_tasks(caps, limit=per, widen_to=widen, tenant=t) for t in order]
        )

    def _tenants_queued(self) -> set[str]:
        now = time.monotonic()
        if self._queued_tenants is None or now - self._queued_tenants[0] > QUEUED_TENANTS_CACHE_S:
            self._queued_tenants = (now, set(self.store.queued_tenants()))
        return self._queued_tenants[1]

    def _to_stop(self, worker: Worker, stale: Sequence[str]) -> list[str]:
        """Of the tasks a worker runs that are no longer its active leases, those it must kill.

        A task it finished itself (its own result is in) is not among them: the worker is merely behind. Nor
        is a task of a tenant it does not serve: it never ran one, and naming it would tell a tenant's private
        worker that another tenant's task id exists (answered as for an id that never did).
        """
        # most ended here by their own results, which this controller remembers: only the others are read
        unknown = [tid for tid in stale if self._ended_by.get(tid) != worker.id]
        serves = self.serves_of([worker]).get(worker.id, ALL_TENANTS)
        return [t.id for t in self.store.get_tasks(unknown)
                if worker_serves(serves, t.tenant) and not _ended_by_its_result(t, worker.id)]  # fmt: skip

    def _remember_ended(self, worker_id: str, ended: Sequence[Task]) -> None:
        """Keep which worker's own result ended these tasks, for `_to_stop` (a terminal task never changes):
        a worker lists a task it finished until its report's answer comes, and under load most leases name
        some, which are then not read again. The oldest go first; another replica's results are read."""
        for t in ended:
            if _ended_by_its_result(t, worker_id):
                self._ended_by[t.id] = worker_id
        while len(self._ended_by) > ENDED_KEPT:
            with contextlib.suppress(KeyError, RuntimeError, StopIteration):
                del self._ended_by[next(iter(self._ended_by))]

    # ---- results -----------------------------------------------------------------------------

    def exchange(
        self,
        worker_id: str,
        completions: Sequence[Completion],
        ask: LeaseAsk | None = None,
        *,
        watched: Callable[[str], bool] | None = None,
    ) -> Exchange:
        """Commit a worker's results and, if it `ask`s, lease it work for the room they freed: in one call, so
        in one transaction (one fsync), and a pipeline's next stage, queued by its last stage's result, can go
        straight back to the worker that ran it. With nothing queued anywhere (as this controller last looked,
        at most QUEUED_TENANTS_CACHE_S ago; what it queues itself it knows at once) the lease is not tried: the
        results' commit waits for no queries that would find nothing, and the worker's long poll, which waits
        for new tasks whenever it has room, takes what comes next. Neither is it tried for an `ask.if_queued`
        whose results queued nothing (a pipeline's last stage, a chained stage's: their next is leased already).

        `watched(id)`: whether a client waits on that task or run: those that ended here are read back in this
        call (`Exchange.ended_tasks`, `ended_runs`), so the waits answer without one more read each, a hop to
        a reader thread and its queries, while the client is on the clock."""
        settled = self.settle(worker_id, completions)
        accepted, refused = settled.accepted, settled.refused
        queued = self.runs.take_queued()
        ended_tasks, ended_runs = self._ended(settled, watched) if watched else ({}, {})
        got: LeaseResult | None = None
        if ask is not None:
            got = LeaseResult()
            done = set(accepted)
            running = [tid for tid in ask.running if tid not in done]
            # a failure may have been queued again (a retry): worth a look, rare enough not to tell apart
            queued_here = bool(queued) or any(not c.succeeded for c in completions if c.task_id in done)
            try:
                if (queued_here or not ask.if_queued) and self._tenants_queued():
                    got = self.offer(worker_id, max_tasks=ask.max_tasks, running=running, tenant=ask.tenant,
                                     prefetch=ask.prefetch, prefetch_s=ask.prefetch_s,
                                     waiting=ask.waiting, prefetch_gpu=ask.prefetch_gpu)  # fmt: skip
            except NotFound:  # it left (or was never here): its verdicts stand, and it gets no work
                pass
        return Exchange(accepted, refused, queued, got, settled.chains, settled.runs, ended_tasks, ended_runs)

    def _ended(
        self, settled: Settled, watched: Callable[[str], bool]
    ) -> tuple[dict[str, Task], dict[str, RunView]]:
        """The watched tasks and runs these results ended, as they stand after the results' writes: as the
        writes left them, read again only where the settling did not see the end (another controller moved a
        run on)."""
        tasks = {tid: t for tid, t in settled.ended.items() if watched(tid)}
        runs = {rid: v for rid, v in settled.views.items() if v[0].state.terminal and watched(rid)}
        unseen = sorted(r for r in settled.runs if r not in settled.views and watched(r))
        for run in self.store.runs.get_runs(unseen) if unseen else ():
            if run.state.terminal:
                runs[run.id] = (run, self.runs.tasks_of(run))
        return tasks, runs

    def offer(self, worker_id: str, **ask: Any) -> LeaseResult:
        """`lease`, with each pipeline stage's lease telling the stages that may run right after it there."""
        got = self.lease(worker_id, **ask)
        if not any(le.task.pipeline_run_id for le in got.leases):
            return got
        worker = self._fleet().get(worker_id) or self._worker(worker_id)  # as `lease` saw it
        return replace(got, leases=list(self.runs.chain_hints(worker, got.leases)))

    def complete(self, worker_id: str, completions: Sequence[Completion]) -> tuple[list[str], list[str]]:
        """Commit results; returns (accepted, refused). See `settle`."""
        settled = self.settle(worker_id, completions)
        return settled.accepted, settled.refused

    def settle(self, worker_id: str, completions: Sequence[Completion]) -> Settled:
        """Commit results. Only the current attempt's report counts.

        Idempotent: the same report sent again (its answer was lost on the way, and the worker re-sent it
        after reconnecting) is accepted again, changing nothing. A result may name the next pipeline stage its
        worker already started (`Completion.chain`): that stage's task is created leased to the worker, or the
        chain is refused (runs.py); a later result in the same report may be that stage's own, so results whose
        task does not exist yet are settled after the chains before them.
        """
        chains = Chains()
        accepted: list[str] = []
        ended: list[Task] = []
        views: dict[str, RunView] = {}
        left = list(completions)
        chains.reports = {c.task_id: c for c in completions}
        # one look for the report's tasks and every chained id it names (most are its later results' tasks)
        named = {c.chain for c in completions if c.chain}
        looked = {c.task_id for c in completions} | named
        found = {t.id: t for t in self.store.get_tasks(looked)}
        chains.taken = (named & found.keys()) | _named_twice(completions)
        while left:
            chained_before = len(chains.accepted)
            done, left = self._settle_round(worker_id, left, chains, ended, views, found, looked)
            found, looked = {}, set()
            accepted += done
            settled_by_runs = [c.task_id for c in left if c.task_id in chains.settled]
            accepted += settled_by_runs  # chained stages recorded, with their results, as they were created
            ended += [chains.created[tid] for tid in settled_by_runs]
            left = [c for c in left if c.task_id not in chains.settled]
            if len(chains.accepted) == chained_before:
                break  # what is left names tasks that do not exist (or not here): refused
        self._learn(ended, {c.task_id: c for c in completions}, self.clock())
        self._remember_ended(worker_id, ended)
        finished = set(accepted)
        refused = [c.task_id for c in completions if c.task_id not in finished]
        runs = frozenset(t.pipeline_run_id for t in ended if t.pipeline_run_id)
        return Settled(accepted, refused, chains, runs, {t.id: t for t in ended}, views)

    def _settle_round(
        self,
        worker_id: str,
        completions: Sequence[Completion],
        chains: Chains,
        ended_so_far: list[Task],
        views: dict[str, RunView],
        found: Mapping[str, Task],
        looked: Set[str],
    ) -> tuple[list[str], list[Completion]]:
        """Settle the results whose tasks exist; returns what was accepted and the results whose tasks do not
        exist (yet: a chain this round accepted may have created them). `found`: tasks already read for it,
        out of the ids `looked` for (those not found do not exist: a chained stage's task, before its chain is
        settled, is not read again); `ended_so_far` and `views` gather the tasks it ends and the runs it moves
        on, as written."""
        now = self.clock()
        known = {c.task_id: chains.created[c.task_id] for c in completions if c.task_id in chains.created}
        known.update((c.task_id, found[c.task_id]) for c in completions if c.task_id in found)
        fetched = self.store.get_tasks(
            c.task_id for c in completions if c.task_id not in known and c.task_id not in looked
        )
        tasks = {**known, **{t.id: t for t in fetched}}
        updates = []
        finished: list[Task] = []
        requeue: list[tuple[Task, dict[str, Any]]] = []
        repeated: list[str] = []
        for c in completions:
            t = tasks.get(c.task_id)
            if t is not None and _already_committed(t, worker_id, c):
                repeated.append(t.id)
                if c.chain:  # its answer was lost: say again whether the stage after it was chained
                    chains.claimed[t.id] = c.chain
                    if any(k.worker_id == worker_id for k in self.store.get_tasks([c.chain])):
                        chains.accepted.append(c.chain)
                continue
            if (
                t is None
                or t.worker_id != worker_id
                or t.attempts != c.attempt
                or t.state not in ACTIVE_STATES
            ):
                continue
            values = self.result_values(t, c, now)
            if c.succeeded:
                chains.claim(t, c, values)
            else:
                error = dict(c.error or {"type": "error", "message": "failed"})
                if error.get("type") in RETRYABLE_ERRORS and t.attempts <= t.spec.max_retries:
                    requeue.append((t, error))
                    continue
                values.update(state=TaskState.FAILED, error=error)
            updates.append((t.id, ACTIVE, c.attempt, values))
            finished.append(replace(t, **values))  # as written: the update changes only these values
        accepted = self.store.update_tasks(updates)
        took = set(accepted)
        ended = [t for t in finished if t.id in took]
        for t in finished:
            if t.id not in took:
                chains.claimed.pop(t.id, None)  # its result lost a race: the stage after it is not chained
        self._audit_releases(ended, now)  # before the re-queue's: a batch's last change releases its grant
        accepted += self._requeue(requeue, now)
        accepted += repeated
        ended_so_far += ended
        run_ids = {t.pipeline_run_id for t in ended if t.pipeline_run_id}
        if run_ids:  # the next stage, in this commit
            written = {t.id: t for t in ended}
            views.update(
                (run.id, (run, stages)) for run, stages in self.runs.advance_runs(run_ids, chains, written)
            )
        return accepted, [c for c in completions if c.task_id not in tasks]

    def result_values(self, t: Task, c: Completion, now: float) -> dict[str, Any]:
        """The task's fields once its result `c` is recorded (a failure's state and error are the caller's)."""
        started = _started(t, c, now)
        run_s = c.run_s if c.run_s is not None else (now - started if started else None)
        billed = None if run_s is None else run_s + (c.cold_start_s or 0.0)
        values: dict[str, Any] = {"finished_at": now, "run_s": run_s, "started_at": started,
                                  "cost_usd": self._cost(t, billed), "isolation": c.isolation,
                                  "cold_start_s": c.cold_start_s, "usage": c.usage}  # fmt: skip
        if c.succeeded:
            values.update(state=TaskState.SUCCEEDED, output=c.output, error=None)
        return values

    def _learn(self, ended: Sequence[Task], by_id: Mapping[str, Completion], now: float) -> None:
        """Note each success for its (capability, device class, GPU model) profile, for `gpu: auto`; the notes
        are written together about once a second (`profiles.PendingSamples`), not in every result's commit.

        Only what shared workers report: profiles are every tenant's (`auto` routes on them, `--prefetch
        auto` holds tasks by them, `GET /v1/capabilities` shows them), and a tenant's private worker says what
        it likes about its own tasks; to every other tenant it is not there."""
        fleet: dict[str, Worker] | None = None
        for t in ended:
            c = by_id[t.id]
            if not c.succeeded or c.run_s is None or t.device is None or t.worker_id is None:
                continue
            if t.worker_id.startswith("cloud:"):
                continue  # a cloud endpoint's time says nothing about local devices
            fleet = self._fleet() if fleet is None else fleet
            worker = fleet.get(t.worker_id)
            if worker is None or self.serves_of([worker]).get(worker.id, ALL_TENANTS) != ALL_TENANTS:
                continue
            self._run_times.note(t.spec.capability, t.device.value, c.run_s)
            usage = c.usage or {}
            sample = profiles.RunSample(c.run_s, c.cold_start_s, usage.get("peak_gpu_memory_bytes"),
                               usage.get("peak_rss_bytes"))  # fmt: skip
            self._samples.add((t.spec.capability, t.device.value, t.gpu_model or None), sample, now)
        self.fold_samples(now, only_if_due=True)

    def fold_samples(self, now: float, *, only_if_due: bool = False) -> None:
        """Write the samples waiting in memory into their profiles (one write per profile); `only_if_due`: only
        once the oldest has waited `profiles.FOLD_EVERY_S`."""
        if only_if_due and not self._samples.due(now):
            return
        for (capability, device, gpu_model), samples in self._samples.take().items():
            self.runs.store.record_profiles(capability, device, gpu_model, samples, now)

    def _cost(self, task: Task, run_s: float | None) -> float | None:
        if run_s is None or task.device is None:
            return None
        holder = task.worker_id or ""
        if holder.startswith("cloud:") and self.settings.escalation:  # at the endpoint's price
            from turnout.escalation import cloud_cost

            return cloud_cost(self.settings.escalation.by_name(holder[len("cloud:") :]), run_s)
        price = self.settings.prices.per_second(task.device.value, task.gpu_model)
        if price is None:
            return None
        share = _gpu_share(task) if task.device is Device.GPU else 1.0
        return round(run_s * price * share, 8)

    def _requeue(self, items: Sequence[tuple[Task, dict[str, Any]]], now: float) -> list[str]:
        updates = []
        for t, error in items:
            routing = replace(t.routing or Routing(), last_error=error)
            if error.get("type") in AVOID_GPU_ERRORS and t.gpus:
                # never blindly the same GPU again: another one (whose free memory is its own), or the CPU
                routing = replace(routing, avoid_gpus=tuple(sorted({*routing.avoid_gpus, *t.gpus.uuids})))
            values = {"state": TaskState.QUEUED, "worker_id": None, "device": None, "gpus": None, "gpu_model": None,
                      "queued_at": now, "routing": routing, "alloc": None}  # fmt: skip
            updates.append((t.id, ACTIVE, t.attempts, values))
        done = self.store.update_tasks(updates)
        for t, _ in items:
            self.queued_for(t.tenant)
        self._audit_releases([t for t, _ in items if t.id in done], now)
        return done

    def _requeue_lost(self, tasks: Sequence[Task], why: str) -> list[str]:
        now = self.clock()
        tasks = [_unstarted_counted(t) for t in tasks]
        retry = [t for t in tasks if _charged(t) <= t.spec.max_retries]
        give_up = [t for t in tasks if _charged(t) > t.spec.max_retries]
        error = {"type": "worker_lost", "message": f"{why}; attempts used up"}
        done = self._requeue([(t, {"type": "worker_lost", "message": why}) for t in retry], now)
        failed = self.store.update_tasks(
            [
                (t.id, ACTIVE, t.attempts, {"state": TaskState.FAILED, "error": error, "finished_at": now})
                for t in give_up
            ]
        )
        self._audit_releases([t for t in give_up if t.id in failed], now)
        return done + failed

    # ---- the periodic sweep ------------------------------------------------------------------

    def reap(self, heard: Mapping[str, float] | None = None) -> bool:
        """Mark silent workers unhealthy, re-queue their tasks, time out overdue tasks, fail unplaceable ones.

        A worker is judged on when its last heartbeat arrived: `heard` (stamped by the API as heartbeats
        arrive, so one waiting behind a slow write counts) or the stored time (written by any controller
        sharing the database), whichever is later; and never within three heartbeats of this controller's
        start. Returns whether anything changed (so waiting clients and workers should look again).
        """
        now = self.clock()
        heard = dict(heard or {})  # a copy: the API adds to it from another thread
        changed = False
        workers = self.store.list_workers()
        # the workers not gone, as this sweep leaves them: a gone one holds nothing
        by_id: dict[str, Worker] = {}
        for w in workers:
            last = max(w.last_heartbeat, heard.get(w.id, 0.0))
            silent = w.state in LIVE_WORKER_STATES and now - max(last, self.started_at) > 3 * w.heartbeat_s
            if silent and self.store.update_worker(
                w.id, LIVE_WORKER_STATES, state=WorkerState.UNHEALTHY.value
            ):
                self._fleet_cache = None
                self.audit("worker_lost", self.worker_tenant(w.id), {"worker": w.id, "name": w.name,
                                                                      "last_heartbeat": w.last_heartbeat,
                                                                      "reason": "missed three heartbeats"})  # fmt: skip
                log.warning("worker %s missed three heartbeats: unhealthy", w.name, extra={"worker_id": w.id})
                changed = True
                w = replace(w, state=WorkerState.UNHEALTHY)
            elif self._forget_silent(w, now - last):
                self._fleet_cache = None  # its tasks went back to the queue when it fell silent
                changed = True
                continue
            by_id[w.id] = w
        lost: list[Task] = []
        overdue: list[Change] = []
        overdue_tasks: list[Task] = []
        for t in self.store.active_tasks(inputs=False):  # twice a second: their inputs are not read
            if (t.worker_id or "").startswith("cloud:"):
                continue  # held by an escalation endpoint: escalation.py watches it
            holder = by_id.get(t.worker_id or "")
            if holder is None or holder.state in (WorkerState.UNHEALTHY, WorkerState.GONE):
                lost.append(t)
                continue
            since = t.started_at or t.leased_at
            if t.alloc is not None and t.alloc.ahead and t.started_at is None:
                since = None  # it waits on its worker for a free slot: its time starts when it does
            if (
                t.spec.timeout_s is not None
                and since is not None
                and now - since > t.spec.timeout_s + holder.heartbeat_s
            ):
                error = {"type": "timeout", "message": f"ran longer than timeout_s={t.spec.timeout_s:g}"}
                overdue.append((t.id, ACTIVE, t.attempts, {"state": TaskState.FAILED, "error": error,
                                                            "finished_at": now, "run_s": now - since}))  # fmt: skip
                overdue_tasks.append(t)
        if lost:
            expired = self._requeue_lost(lost, "worker stopped heartbeating")
            self.lease_expiries += len(expired)
            changed |= bool(expired)
        if overdue:
            timed_out = set(self.store.update_tasks(overdue))
            self._audit_releases([t for t in overdue_tasks if t.id in timed_out], now)
            changed |= bool(timed_out)
        changed |= self._expire_unplaceable(now, [w for w in workers if w.state is WorkerState.HEALTHY])
        changed |= self.runs.sweep()  # stages that ended by timeout, lost workers, no capacity
        return changed

    def _forget_silent(self, worker: Worker, silent_s: float) -> bool:
        """Mark an unhealthy worker silent for WORKER_FORGOTTEN_S gone; whether it was."""
        if worker.state is not WorkerState.UNHEALTHY or silent_s <= WORKER_FORGOTTEN_S:
            return False
        if not self.store.update_worker(worker.id, (WorkerState.UNHEALTHY,), state=WorkerState.GONE.value):
            return False
        record = {"worker": worker.id, "reason": "silent for a day"}
        self.audit("worker_left", self.worker_tenant(worker.id), record)
        return True

    def _expire_unplaceable(self, now: float, healthy: Sequence[Worker]) -> bool:
        """Fail tasks no live worker could serve for their whole `placement_timeout_s` (`no_capacity`).

        Tasks of one kind (capability, gpu value and resource overrides: `QueuedKind`) share one verdict,
        applied in SQL, so a deep queue costs a few statements, also one of 10,000 tasks asking `gpu: 0.25`;
        only tasks with a retry history (a routing record: GPUs to avoid) are judged one by one.
        """
        failed: list[str] = []
        serves = self.serves_of(healthy)
        for kind in self.store.queued_kinds():
            sample = self.store.get_task(kind.sample_id)
            if sample is None:
                continue
            view = placement.cluster_view(placement.serving(healthy, serves, kind.tenant), sample)
            failed += self.store.mark_servable(
                kind, servable(sample.spec.gpu, view), now, _no_capacity(sample)
            )
        updates: list[Change] = []
        for t in self.store.queued_unusual():
            ok = servable(t.spec.gpu, placement.cluster_view(placement.serving(healthy, serves, t.tenant), t))
            since = t.unservable_since
            if ok and since is not None:
                updates.append((t.id, (TaskState.QUEUED,), t.attempts, {"unservable_since": None}))
            elif not ok and since is None:
                updates.append((t.id, (TaskState.QUEUED,), t.attempts, {"unservable_since": now}))
            elif not ok and since is not None and now - since >= t.spec.placement_timeout_s:
                updates.append((t.id, (TaskState.QUEUED,), t.attempts,
                                {"state": TaskState.FAILED, "error": _no_capacity(t), "finished_at": now}))  # fmt: skip
        done = set(self.store.update_tasks(updates)) if updates else set()
        return bool(failed) or any(u[3].get("state") is TaskState.FAILED for u in updates if u[0] in done)

    # ---- events and audit --------------------------------------------------------------------

    def append_events(
        self, worker_id: str, items: Sequence[tuple[str, int, dict[str, Any]]]
    ) -> dict[str, int]:
        """Store events a worker sent for its current attempts; events for stale attempts are dropped."""
        now = self.clock()
        tasks = {t.id: t for t in self.store.get_tasks({tid for tid, _, _ in items})}
        keep = [(tid, now, body) for tid, attempt, body in items
                if (t := tasks.get(tid)) and t.worker_id == worker_id and t.attempts == attempt]  # fmt: skip
        started = [t for t in tasks.values() if t.state is TaskState.LEASED and t.worker_id == worker_id]
        if started:
            self.store.update_tasks(
                [
                    (t.id, (TaskState.LEASED,), t.attempts, {"state": TaskState.RUNNING, "started_at": now})
                    for t in started
                ]
            )
        return self.store.append_events(keep) if keep else {}

    def audit(self, kind: str, tenant: str | None, body: dict[str, Any]) -> None:
        self.store.append_audit([(self.clock(), kind, tenant, body)])

    def record_scrubs(self, worker_id: str, scrubs: Sequence[dict[str, Any]]) -> int:
        """Audit the GPU scrubs a worker ran between tenants (`gpu_scrubbed`), each under the tenant scrubbed
        away (None: unknown, the worker had just started); the tenant the GPU goes to is `next_tenant` (a
        record's own `tenant` is its envelope's)."""
        self._worker(worker_id)
        now = self.clock()
        records = []
        for s in scrubs:
            body = {k: v for k, v in s.items() if k != "tenant"}
            records.append((now, "gpu_scrubbed", s.get("previous_tenant"),
                            {**body, "next_tenant": s.get("tenant"), "worker": worker_id}))  # fmt: skip
        self.store.append_audit(records)
        return len(scrubs)

    def _audit_allocations(self, worker_id: str, leases: Sequence[Lease], now: float) -> None:
        """One `gpu_allocated` per GPU grant; the same (task, attempt) gets exactly one `gpu_released`. A task
        held ahead on another's share names it (`after`): it holds the share from that task's end."""
        self.store.append_audit(
            [(now, "gpu_allocated", lease.task.tenant,
              {"task": lease.task.id, "attempt": lease.task.attempts, "worker": worker_id,
               "gpus": list(lease.grant.uuids) if lease.grant else [],
               "memory_bytes": lease.grant.memory_bytes if lease.grant else None, "start": now,
               **({"after": lease.after} if lease.after else {})})
             for lease in leases]
        )  # fmt: skip

    def _audit_releases(self, tasks: Sequence[Task], now: float) -> None:
        """One `gpu_released` per attempt that held GPUs, by whichever change ended it (its conditional update
        won): `tasks` are those one change ended. A batch holds its leader's one grant (batching.py) until
        its last task ends, whichever that is: the record names the leader's allocation (task and attempt)."""
        # (a task that ended, the grant it held, the allocation's task id and attempt)
        held: list[tuple[Task, GpuGrant, str, int]] = []
        batches: dict[str, tuple[Task, GpuGrant]] = {}
        for t in tasks:
            batch = placement.batch_of(t)
            if not t.gpus:
                continue
            if batch is None:
                held.append((t, t.gpus, t.id, t.attempts))
            else:
                batches.setdefault(batch, (t, t.gpus))
        if batches:
            ended = {t.id for t in tasks}
            workers = sorted({t.worker_id for t, _ in batches.values() if t.worker_id})
            on = self.store.active_tasks(workers, inputs=False)
            riding = {placement.batch_of(t) for t in on if t.id not in ended}
            for batch, (t, grant) in batches.items():
                if batch not in riding:  # nothing of the batch runs on: its grant is free
                    rode = t.alloc.batch_attempt if t.alloc else None
                    attempt = t.attempts if batch == t.id or rode is None else rode
                    held.append((t, grant, batch, attempt))
        records = []
        for t, grant, task_id, attempt in held:
            start = t.leased_at  # a batch's tasks were leased together
            records.append((now, "gpu_released", t.tenant,
                            {"task": task_id, "attempt": attempt, "worker": t.worker_id, "gpus": list(grant.uuids),
                             "memory_bytes": grant.memory_bytes, "start": start, "end": now,
                             "seconds": round(now - start, 6) if start else None}))  # fmt: skip
        self.store.append_audit(records)

    # ---- reads for the API ----
    # What the routes, the dashboard and /metrics read: nothing above the controller holds the store.

    def find_task(self, task_id: str) -> Task | None:
        """Any tenant's task, or None: for callers that judge who may see it themselves (worker transfers)."""
        return self.store.get_task(task_id)

    def find_worker(self, worker_id: str) -> Worker | None:
        return self.store.get_worker(worker_id)

    def all_workers(self) -> list[Worker]:
        """Every worker registered, those gone included (`workers()` lists the live ones)."""
        return self.store.list_workers(include_gone=True)

    def worker_tenants(self) -> dict[str, str]:
        """Worker id -> the tenant it serves (`"*"`: every tenant)."""
        return self.store.worker_tenants()

    def active_tasks(self) -> list[Task]:
        return self.store.active_tasks()

    def queue_depths(self, tenant: str | None) -> dict[str, dict[str, int]]:
        """Capability -> {state: count} of unfinished tasks; `tenant` None: every tenant's."""
        return self.store.queue_depths(tenant)

    def task_stats(
        self,
        states: Iterable[TaskState] | None = None,
        run_s_buckets: Sequence[float] = (),
        *,
        tenant: str | None = None,
    ) -> list[dict[str, Any]]:
        """Tasks grouped by capability, state, device and gpu value, with run-seconds sums (store.task_stats)."""
        return self.store.task_stats(states, run_s_buckets, tenant=tenant)

    def events(self, task_id: str, after: int, limit: int) -> list[tuple[int, float, dict[str, Any]]]:
        """A task's stored events with seq > `after`, oldest first: (seq, ts, body)."""
        return self.store.read_events(task_id, after, limit)

    def last_event_seq(self, task_id: str) -> int:
        return self.store.last_event_seq(task_id)

    def list_audit(
        self, since: float | None, limit: int, *, tenant: str | None, kind: str | None, after_id: int | None
    ) -> list[dict[str, Any]]:
        return self.store.list_audit(since, limit, tenant=tenant, kind=kind, after_id=after_id)

    def learned_profiles(self) -> list[profiles.Profile]:
        """Observed run times and peaks per (capability, device, GPU model): what `gpu: auto` routes on, with
        the samples not yet written folded in."""
        return self._samples.overlay(self.store.runs.profiles())

    def cost_by_tenant(self) -> list[tuple[str, str, float]]:
        """(capability, tenant, USD) of every priced task."""
        return self.store.runs.cost_by_tenant()

    def run_counts(self) -> list[tuple[str, str, int]]:
        """(pipeline, state, count) of pipeline runs."""
        return self.store.runs.run_counts()

    def file_record(self, file_id: str) -> FileRecord | None:
        return self.store.files.get(file_id)

    def record_file(self, record: FileRecord) -> None:
        """Commit a file's record; its bytes are already fsync'd in place (api/files.py)."""
        self.store.files.insert(record)

    def delete_file(self, file_id: str) -> bool:
        return self.store.files.delete(file_id)

    def expire_files(self, replica_id: str, interval_s: float) -> list[str]:
        """Delete expired files' records, if this replica claims this round of the files sweep; their ids."""
        from turnout.store.replicas import claim_sweep

        now = self.clock()
        if not claim_sweep(self.store, "files", replica_id, now, interval_s):
            return []
        return self.store.files.expire(now)


def _audit_tenant(tenant: str) -> str | None:
    return None if tenant == ALL_TENANTS else tenant


def _named_twice(completions: Sequence[Completion]) -> set[str]:
    """The chained ids more than one result of a report names: no worker starts two stages under one id, and
    creating both would break the report's commit (a 500, for ever, as the worker sends it again): refused."""
    counts = collections.Counter(c.chain for c in completions if c.chain)
    return {tid for tid, n in counts.items() if n > 1}


def _started(task: Task, c: Completion, now: float) -> float | None:
    """When the attempt `c` reports began: its worker's word, held between the lease and now. A start in the
    future gave a negative run_s (and cost); one before the lease, a run longer than the task's time here."""
    stated = c.started_at
    if not stated:
        return task.started_at or task.leased_at
    return min(max(stated, task.leased_at or task.created_at), now)


def _ended_by_its_result(task: Task, worker_id: str) -> bool:
    """Whether `task` ended on `worker_id` by its own result (the worker is merely behind if it still lists
    it), not stopped from here (cancelled, queued again, timed out, lost, unplaceable) nor still active."""
    error_type = (task.error or {}).get("type")
    stopped_here = task.state in (TaskState.CANCELLED, TaskState.QUEUED) or (
        task.state is TaskState.FAILED and error_type in ("timeout", "worker_lost", "no_capacity")
    )
    return task.worker_id == worker_id and not stopped_here and task.state not in ACTIVE_STATES


def _already_committed(task: Task, worker_id: str, c: Completion) -> bool:
    """Whether `c` repeats the report that ended `task`: same worker, same attempt, same outcome."""
    if task.worker_id != worker_id or task.attempts != c.attempt:
        return False
    return task.state is (TaskState.SUCCEEDED if c.succeeded else TaskState.FAILED)


def _undelivered(task: Task) -> int:
    """How many of the task's leases never reached their worker (their answer was lost)."""
    return task.routing.undelivered if task.routing else 0


def _gpu_share(task: Task) -> float:
    """The share of its GPU a task holds (a whole one unless it said otherwise)."""
    share = task.alloc.gpu_share if task.alloc else None
    return 1.0 if share is None else share


def _unstarted_counted(task: Task) -> Task:
    """A task held ahead on a worker that never said it started (it waited there for a free slot) ran nothing
    known: counted as a lease that never arrived (`routing.undelivered`), not against `max_retries`, for the
    first few times, like one."""
    if task.alloc is None or not task.alloc.ahead or task.started_at is not None:
        return task
    return replace(task, routing=replace(task.routing or Routing(), undelivered=_undelivered(task) + 1))


def _charged(task: Task) -> int:
    """Attempts that count against `max_retries`: all but the (first few) leases that never arrived."""
    return task.attempts - min(_undelivered(task), UNDELIVERED_FREE)


def _no_capacity(task: Task) -> dict[str, Any]:
    """Why a task nobody could place failed. A retry that had to avoid the GPUs it ran out of memory on fails
    with that cause, the thing to fix (a larger `gpu_memory`, a smaller batch), and
    says why the retry found no other place, instead of a bare `no_capacity` that hides the out-of-memory."""
    why = (f"no live worker offers a variant of {task.spec.capability!r} that gpu={task.spec.gpu.value} "
           "allows and that fits, for the task's whole placement_timeout_s")  # fmt: skip
    routing = task.routing or Routing()
    last = routing.last_error or {}
    if (
        last.get("type") == "gpu_oom" and routing.avoid_gpus
    ):  # a scrub that failed is the GPU's fault, not the task's
        avoided = ", ".join(routing.avoid_gpus)
        return {**last, "message": f"{last.get('message') or last['type']}; its retry found no other place: {why}, "
                                   f"other than the GPUs it failed on ({avoided})"}  # fmt: skip
    return {"type": "no_capacity", "message": why}


def _leased(task: Task, where: placement.Placement, worker_id: str, now: float,
            book: BatchBook, *, ahead: bool = False, after: str | None = None) -> tuple[Change, Lease]:  # fmt: skip
    """The row change that leases `task` as placed, and what the worker receives for it."""
    gpus = where.gpus()
    kept = task.routing.carried() if task.routing else Routing()
    routing = replace(kept, requested=task.spec.gpu.value, device=where.device.value, reason=where.reason)
    if where.riding is not None:
        alloc: Allocation = book.rider_alloc(where.riding)
        lease_batch: str | None = where.riding.leader.id
    else:
        lease_batch = task.id if where.batch is placement.BatchRole.LEADER else None
        alloc = Allocation(cpu=where.resources.cpu, memory=where.resources.memory_bytes,
                           gpu_share=where.gpu_share if where.grant is not None else None, batch=lease_batch,
                           ahead=ahead, after=after)  # fmt: skip
    values = {"state": TaskState.LEASED, "worker_id": worker_id, "device": where.device, "gpus": gpus,
              "gpu_model": where.grant.model if where.grant else None, "routing": routing, "leased_at": now,
              "attempts": task.attempts + 1, "unservable_since": None, "alloc": alloc}  # fmt: skip
    leased = replace(task, state=TaskState.LEASED, worker_id=worker_id, device=where.device, gpus=gpus,
                     routing=routing, attempts=task.attempts + 1, leased_at=now)  # fmt: skip
    return (task.id, (TaskState.QUEUED,), task.attempts, values), Lease(
        leased, where.device, where.resources, gpus, lease_batch, ahead=ahead, after=after
    )


class _LeaseReads:
    """`placement.Reads` from this controller's store, for one lease request (`placement.Facts` keeps each)."""

    def __init__(self, ctrl: Controller, healthy: Sequence[Worker]) -> None:
        self.ctrl = ctrl
        self.healthy = healthy

    def gpu_use(self) -> Mapping[str, float]:
        return self.ctrl.store.gpu_use_by_tenant()

    def gpu_rate_wait_s(self, tenant: str, n: int) -> float:
        return self.ctrl.gpu_allocations.wait_s(tenant, n)

    def worker_tenants(self) -> Mapping[str, str]:
        return self.ctrl.serves_of(self.healthy)

    def auto_fleet(self) -> profiles.Fleet:
        stats = self.ctrl.store.task_stats((TaskState.QUEUED, *ACTIVE))
        active = tuple(
            (r["capability"], r["device"], r["count"])
            for r in stats
            if r["state"] != "queued" and r["device"]
        )
        queued = tuple((r["capability"], r["gpu_mode"], r["count"]) for r in stats if r["state"] == "queued")
        self.ctrl.fold_samples(self.ctrl.clock())  # auto routes on every finished task's sample
        return profiles.Fleet(tuple(self.ctrl.runs.store.profiles()), tuple(self.healthy), active, queued)

    def gpu_fleet(self) -> placement.Fleet:
        gpu_workers = [w for w in self.healthy if placement.gpu_worker(w)]
        active: dict[str, list[Task]] = {}
        for t in self.ctrl.store.active_tasks([w.id for w in gpu_workers], inputs=False):
            active.setdefault(t.worker_id or "", []).append(t)
        return placement.Fleet(self.ctrl.settings.placement_policy, gpu_workers, active)
