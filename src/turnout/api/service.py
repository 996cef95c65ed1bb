"""The asynchronous shell around the synchronous controller: one database thread, wake-ups, the sweep.

Every controller call runs on a single thread, so SQLite sees one writer and the controller's methods
never interleave. That thread commits in groups: it takes the calls that queued up while the last
commit was on disk, runs each in its own savepoint, and commits them together, so a burst of requests
costs one fsync, and no caller hears back before its change is durable. Which calls make a group, and in
what order, is `lanes.Lanes`: workers' calls first, then tenants' submissions in turn, at most
`PER_TENANT` of one tenant in a group, so a tenant flooding submissions does not hold back another
tenant's call or a worker's result behind its backlog. A database failure inside a group
(disk full, an I/O error, a dropped connection) can end its transaction early, so such a group is thrown
away whole and each call runs again alone: a caller hears success only for a change that is on disk, and
`StorageUnavailable` (503, Retry-After) otherwise.

Liveness is judged on the event loop, not the database thread: a heartbeat is stamped when it arrives
(`heard`) and answered without waiting behind slow writes, and a worker's held connection (`lifeline`)
going away without coming back within `RECONNECT_GRACE_S` re-queues its tasks at once. A worker whose host
vanishes without closing its socket is still judged by its heartbeats.

Long polls (lease, result, events) wait on `Signal`s that fire when something they care about changes.
Where several controllers share one PostgreSQL database, each signal fired here is also published to the
other replicas (LISTEN/NOTIFY, `store/notify.py`) and theirs fire here, so a task submitted on one replica
wakes a worker's lease poll held by another at once. Waiters still re-check every `recheck_s`, so a lost
wake-up (the bus reconnecting) costs latency, never a stuck task. The periodic sweep runs on one replica
per round (`store/replicas.py`, `claim_sweep`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from turnout.access import ALL_TENANTS
from turnout.auth import UNKNOWN_TOKEN, TokenBook, WorkerKeys
from turnout.controller import Controller, LeaseResult
from turnout.errors import NotFound, RateLimited, StorageUnavailable, Unauthorized
from turnout.lanes import WORKER_LANE, Lanes
from turnout.models import GpuMode, Task, TaskSpec, Worker, WorkerState
from turnout.runs import RunView
from turnout.store.notify import ALL, ANY_WORKER, ReplicaBus
from turnout.store.replicas import claim_sweep, refresh_statistics
from turnout.store.sql import is_storage_failure
from turnout.tenancy import RefusalPace, TenantBuckets, admit_submission, gpu_allocation_rule, submit_rule

log = logging.getLogger("turnout.api")
R = TypeVar("R")
POLL_S = 1.0
MAX_GROUP = 512  # calls committed together at most
PER_TENANT = 16  # one tenant's submissions in one group at most (lanes.Lanes)
HANDED_KEPT_S = 90.0  # how long a hand-over is remembered for the polls under way (a poll lasts <= 60 s)
HANDED_KEPT = 256  # hand-overs remembered per worker at most
HEARTBEAT_ANSWER_S = 0.5  # a heartbeat is answered by then even when its write still waits for the database
ANALYZE_EVERY_S = 2.0  # how often one replica checks whether the tasks table's statistics went stale
RECONNECT_GRACE_S = 1.0  # a worker whose held connection dropped has this long to open a new one
STORAGE_RETRY_AFTER_S = 5.0
TOKENS = "tokens"  # the signal name a revocation publishes to the other replicas: they forget cached tokens
STORAGE_MESSAGE = (
    "the database cannot take changes now (disk full or unreachable); nothing was changed, try again"
)


@dataclass
class _Job(Generic[R]):
    fn: Callable[[], R]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[R]
    result: Any = None
    error: BaseException | None = None
    # calls that run right after this one, in the same group, each in its own savepoint: the looks of the
    # lease polls a submission leases its new tasks to in its own commit (`Service.submit`)
    then: list[_Job[Any]] = field(default_factory=list)

    def settle(self) -> None:
        if self.future.cancelled():
            return
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            self.future.set_result(self.result)


def _unless_ended(poll: QueuePoll, look: Callable[[], LeaseResult], tokens: TokenBook) -> LeaseResult:
    """A poll's look that a submission runs for it, unless the poll's request ended before the database
    thread came to it: its worker would never hear of what it leased (read across threads: a flag); nor when
    the token its worker registered with was revoked meanwhile: the worker may no longer take tasks."""
    if poll.ended or (poll.token_id is not None and not tokens.alive(poll.token_id)):
        return LeaseResult()
    return look()


def _seen(future: asyncio.Future[Any]) -> None:
    """Mark a future's error as seen: a look whose poll went away meanwhile is nobody's to raise."""
    if not future.cancelled():
        future.exception()


class _JobQueue:
    """`Lanes` behind a lock, for the event loop's threads to fill and the database thread to drain."""

    def __init__(self) -> None:
        self._lanes: Lanes[_Job[Any]] = Lanes(MAX_GROUP, PER_TENANT)
        self._ready = threading.Condition()
        self._closed = False

    def put(self, job: _Job[Any], tenant: str | None) -> None:
        with self._ready:
            self._lanes.put(job, tenant)
            self._ready.notify()

    def close(self) -> None:
        """No more calls: `take` answers what is left, then an empty group."""
        with self._ready:
            self._closed = True
            self._ready.notify()

    def take(self) -> list[_Job[Any]]:
        """The next group, waiting for one; empty once closed and drained."""
        with self._ready:
            while not self._lanes and not self._closed:
                self._ready.wait()
            return self._lanes.take()


class _GroupLost(Exception):
    """A call in the group hit a database failure: the group's transaction cannot be trusted."""


class _CallFailed(Exception):
    """A group's only call raised: its transaction is rolled back, and the call's error is its answer."""


def storage_unavailable(exc: BaseException) -> StorageUnavailable:
    """What a caller hears for a database failure; the driver's text (and any SQL) stays in the log."""
    log.error("storage failure: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return StorageUnavailable(STORAGE_MESSAGE, retry_after_s=STORAGE_RETRY_AFTER_S)


NewTasks = tuple[str, str, int]  # (capability, tenant, the epoch count once they were queued)


@contextlib.contextmanager
def _counted(counts: dict[str, int], key: str, when: bool) -> Iterator[None]:
    """`counts[key]` one higher while the block runs (if `when`); the key is gone once it is back to none."""
    if when:
        counts[key] = counts.get(key, 0) + 1
    try:
        yield
    finally:
        if when:
            left = counts.get(key, 1) - 1
            if left > 0:
                counts[key] = left
            else:
                counts.pop(key, None)


class Epoch:
    """How many times a lease poll's wake-ups have fired on this controller since it started, as a token.

    A poll answered with tasks and nothing left queued for its worker gets the token (`since`); the worker's
    next poll sends it back, and if nothing fired in between (no new task, no freed room, no cancel, nothing
    from another replica) that poll parks at once instead of looking at the queue for nothing: most polls
    follow an answer. The boot id keeps a restarted controller's count from matching an old token."""

    def __init__(self) -> None:
        self._boot = secrets.token_hex(6)
        self._count = 0

    def bump(self) -> None:
        self._count += 1

    @property
    def count(self) -> int:
        return self._count

    def token(self) -> str:
        return f"{self._boot}.{self._count}"


class Signal:
    """A broadcast wake-up: take `current()` before checking, then `wait()` on it; no wake-up is lost.

    `notify()` wakes this replica's waiters and tells `publish` (the other replicas, if any); `fire()` wakes
    only this replica's, for a wake-up that came from another replica.
    """

    def __init__(self, publish: Callable[[], None] | None = None, epoch: Epoch | None = None) -> None:
        self._event = asyncio.Event()
        self._publish = publish
        self._epoch = epoch

    def current(self) -> asyncio.Event:
        return self._event

    def notify(self) -> None:
        self.fire()
        if self._publish is not None:
            self._publish()

    def fire(self) -> None:
        self._event.set()
        self._event = asyncio.Event()
        if self._epoch is not None:
            self._epoch.bump()

    @staticmethod
    async def wait(event: asyncio.Event, timeout_s: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), timeout=max(0.0, timeout_s))

    @staticmethod
    async def wait_any(events: list[asyncio.Event], timeout_s: float) -> None:
        waiters = [asyncio.ensure_future(e.wait()) for e in events]
        try:
            await asyncio.wait(waiters, timeout=max(0.0, timeout_s), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()


@dataclass(frozen=True)
class Delivery:
    """A lease poll's look that a submission ran for it in the submission's own commit (`Service.submit`):
    its answer, settled with the submission's, and the poll epoch's token as of before it ran (what fired
    since, the look may not have seen)."""

    answer: asyncio.Future[LeaseResult]
    epoch: str


@dataclass(eq=False)
class QueuePoll:
    """A worker's lease poll, from its request to its answer, as the wake-ups for new tasks see it."""

    worker_id: str
    tenant: str  # whom the worker serves (ALL_TENANTS: every tenant)
    token_id: str | None = None  # the token its worker registered with (None: not known here)
    event: asyncio.Event = field(default_factory=asyncio.Event)  # set: look at the queue again
    offers: frozenset[str] | None = None  # its capabilities; None until its first look: anything may fit
    full: bool = False  # parked for freed room only: a new task is nothing to it
    woken_for: list[NewTasks] = field(default_factory=list)  # new tasks it was woken for, not yet looked at
    looked_at: int = -1  # the epoch count when its last look began: tasks queued before that, it has seen
    # tenants its last look found may take nothing there (its room kept for other tenants' reserved_share):
    # a flooding tenant's every new task would otherwise wake it, and each shared worker's poll in turn, to
    # find the same; freed room, a recheck, or another tenant's task wakes it instead
    barred: frozenset[str] = frozenset()
    # while it is parked waiting for new tasks: its next look, as a call for the database thread, for a
    # submission to run in its own commit (`Service.submit`); None otherwise
    ask: Callable[[], Callable[[], LeaseResult]] | None = None
    delivery: Delivery | None = None  # a look a submission ran for it, not taken yet
    ended: bool = False  # its request is over (answered, or cancelled: its worker's connection closed)

    def take_delivery(self) -> Delivery | None:
        delivery, self.delivery = self.delivery, None
        return delivery

    def may_take(self, capability: str, tenant: str) -> bool:
        return (
            not self.full
            and (self.offers is None or capability in self.offers)
            and self.tenant in (ALL_TENANTS, tenant)
            and tenant not in self.barred
        )

    def look(self, epoch: Epoch) -> list[NewTasks]:
        """Before a look at the queue: what it was woken for since the last, and a fresh event for after."""
        woken_for, self.woken_for, self.event = self.woken_for, [], asyncio.Event()
        self.looked_at = epoch.count
        return woken_for

    def looked(self, result: LeaseResult, woken_for: list[NewTasks]) -> list[NewTasks]:
        """After a look: what to wake another poll for. Nothing where it looked at all it could take and left
        nothing queued (it took the new tasks, or they were gone already); else what it was woken for."""
        self.offers = result.offers if result.offers is not None else self.offers
        self.full = result.full
        self.barred = result.barred
        if result.looked and not result.backlog:
            return [new for new in woken_for if not self.may_take(new[0], new[1])]
        return woken_for


class Service:
    def __init__(
        self,
        controller: Controller,
        tokens: TokenBook,
        *,
        auth: bool = True,
        heartbeat_answer_s: float = HEARTBEAT_ANSWER_S,
        reconnect_grace_s: float = RECONNECT_GRACE_S,
        bus: ReplicaBus | None = None,
        recheck_s: float = POLL_S,
    ) -> None:
        self.controller = controller
        self.tokens = tokens
        self.workers = WorkerKeys(controller.store)
        self.auth = auth
        self.heartbeat_answer_s = heartbeat_answer_s
        self.reconnect_grace_s = reconnect_grace_s
        limits = controller.settings.tenant_limits
        self.submissions = TenantBuckets(submit_rule(limits))
        self.gpu_submissions = TenantBuckets(gpu_allocation_rule(limits))  # GPU-only tasks, at the door
        self.pace = RefusalPace(limits)  # how long a tenant's 429s are held (`paced`)
        self.bus = bus  # the other replicas on this database, if it is PostgreSQL (store/notify.py)
        self.recheck_s = recheck_s  # how often a parked long poll looks again without a wake-up
        self.replica_id = bus.sender if bus is not None else "local"
        self._jobs = _JobQueue()
        self._db = threading.Thread(target=self._run_jobs, name="turnout-db", daemon=True)
        self._db.start()
        self._readers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="turnout-read")
        self.polls_epoch = Epoch()  # bumped by whatever may wake a lease poll
        # retries and pipeline stages queued, freed room, cancels: wakes every poll with room (new tasks wake one)
        self.queue_changed = Signal(self._publisher("queue"), self.polls_epoch)
        # cancellations, timeouts, workers coming and going: what `changed()` says (wakes full workers' polls)
        self.changes = Signal(self._publisher("changes"), self.polls_epoch)
        # a task reached a terminal state by any way other than its worker's result (cancel, timeout, loss),
        # or another replica says one did: every result wait looks again
        self.tasks_changed = Signal(self._publisher("tasks"))
        self._task_waits: dict[str, set[asyncio.Event]] = {}  # task id -> result waits on it (`watch_tasks`)
        # what a result's commit read back for the waits on a task or run it ended (`results_in`), kept while
        # they wait; keyed like `_task_waits`
        self._ended_tasks: dict[str, Task] = {}
        self._ended_runs: dict[str, RunView] = {}
        # worker id -> {task id: (number, when)} of tasks it got outside its lease polls and has not reported
        # on yet (`handed`), oldest first
        self._handed: dict[str, dict[str, tuple[int, float]]] = {}
        self._handed_count = 0
        self.events_added = Signal(self._publisher("events"))
        self._worker_signals: dict[
            str, Signal
        ] = {}  # capacity freed on one worker: wakes only its lease poll
        self._full_polls: dict[str, int] = {}  # worker id -> its lease polls parked here as full
        self._polls: dict[QueuePoll, None] = {}  # lease polls under way here, oldest first (`tasks_queued`)
        # worker id -> its lease polls that freed room could answer: parked full or with work left queued that
        # did not fit, or still deciding (a lease under way sees the room as it was before a result commits)
        self._room_polls: dict[str, int] = {}
        self._reaper: asyncio.Task[None] | None = None
        # worker id -> when its last heartbeat arrived (controller clock), stamped on the event loop: the
        # reaper judges on this, so a heartbeat waiting behind a slow write still counts when it arrived
        self.heard: dict[str, float] = {}
        self._known: dict[str, tuple[str, float]] = {}  # worker id -> (state, heartbeat_s) last written
        self._lifelines: dict[str, int] = {}  # worker id -> held connections open now
        self._lifeline_epoch: dict[str, int] = {}  # worker id -> connections ever opened
        self._background: set[asyncio.Task[Any]] = set()
        self._later: list[Callable[[], Coroutine[Any, Any, None]]] = []  # started with the service
        self.closing = asyncio.Event()  # set when the controller begins to stop: held connections end cleanly

    # ---- the database thread -------------------------------------------------------------------

    async def read(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """Run a read-only `fn` beside the writer: it sees committed state and waits for no commit."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._readers, functools.partial(fn, *args, **kwargs))
        except Exception as exc:
            if is_storage_failure(exc):
                raise storage_unavailable(exc) from None
            raise

    async def call(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """Run `fn` on the database thread; returns once its writes are committed (durable), and only then.

        In the workers' lane, which goes first (`lanes.Lanes`); a submission goes through `submit`, in its
        tenant's lane. Raises `StorageUnavailable` when the database could not keep them: nothing of `fn` is
        stored then.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._jobs.put(_Job(functools.partial(fn, *args, **kwargs), loop, future), WORKER_LANE)
        return await future

    async def submit(
        self,
        tenant: str,
        fn: Callable[[], R],
        new: Iterable[tuple[str, str]],
        queued: Callable[[R], Sequence[Task]],
    ) -> R:
        """Run a submission `fn` of `tenant`, queuing tasks of these (capability, tenant), in the tenant's lane
        as `call` does; and in the same group, right after it, the look of each lease poll parked here for new
        tasks that `tasks_queued` would wake for them. A task an idle worker waits for is then leased in its
        submission's commit: one fsync where there were two, and no hop from the commit to the wake-up to the
        look. The tasks those looks left (`queued(result)`, less what they leased) wake other polls, not
        theirs: they saw them. A look that fails is its poll's to raise, as its own look's would be."""
        loop = asyncio.get_running_loop()
        job: _Job[R] = _Job(fn, loop, loop.create_future())
        epoch = self.polls_epoch.token()
        parked = self._parked_for(new)
        looking = [poll for poll, _ in parked]
        for poll, ask in parked:
            poll.ask = None  # one look per park
            look: _Job[LeaseResult] = _Job(
                functools.partial(_unless_ended, poll, ask(), self.tokens), loop, loop.create_future()
            )
            look.future.add_done_callback(_seen)
            job.then.append(look)
            poll.delivery = Delivery(look.future, epoch)
            poll.event.set()
        self._jobs.put(job, tenant)
        result = await job.future
        looks = [look.future for look in job.then]
        if not all(f.done() for f in looks):  # `_run_jobs` settles them before the submission: never, so far
            await asyncio.wait(looks)
        taken = {le.task.id for f in looks if not f.cancelled() and f.exception() is None
                 for le in f.result().leases}  # fmt: skip
        if rest := [t for t in queued(result) if t.id not in taken]:
            self.tasks_queued(rest, seen_by=looking)
        return result

    def _parked_for(
        self, new: Iterable[tuple[str, str]]
    ) -> list[tuple[QueuePoll, Callable[[], Callable[[], LeaseResult]]]]:
        """For n new tasks of one (capability, tenant), the n longest-parked polls waiting for new tasks that
        could take them, as `tasks_queued` would wake them; each with its `ask`."""
        chosen: dict[QueuePoll, Callable[[], Callable[[], LeaseResult]]] = {}
        for (capability, tenant), n in Counter(new).items():
            fits = ((p, p.ask) for p in self._polls
                    if p.ask is not None and p not in chosen and p.may_take(capability, tenant))  # fmt: skip
            chosen.update(itertools.islice(fits, n))
        return list(chosen.items())

    def _run_jobs(self) -> None:
        while taken := self._jobs.take():
            batch = [job for lead in taken for job in (lead, *lead.then)]
            if not self._run_group(batch):
                # Nothing of the group is on disk (SQLite may even have run later calls outside the
                # transaction). Forget what was read inside it, and run every call again on its own.
                self.controller.forget_cached()
                for job in batch:
                    job.result = job.error = None
                    self._run_alone(job)
            for lead in taken:  # a poll's look first: its worker waits for the task, the submitter for less
                for job in (*lead.then, lead):
                    job.loop.call_soon_threadsafe(job.settle)

    def _run_group(self, batch: list[_Job[Any]]) -> bool:
        """Run the calls in one transaction, each in a savepoint; False if the transaction was lost.

        A lone call runs in the transaction itself: its failure rolls back all the transaction holds, which
        is its own writes, and it saves the SAVEPOINT/RELEASE pair (most of a lone call's overhead)."""
        store = self.controller.store
        alone = len(batch) == 1
        try:
            with store.group() as conn:
                for job in batch:
                    try:
                        with contextlib.nullcontext() if alone else store.savepoint(conn):
                            job.result = job.fn()  # a failing call undoes only its own writes
                    except BaseException as exc:
                        job.error = exc
                        if is_storage_failure(exc) or not store.intact(conn):
                            raise _GroupLost from exc
                        if alone:
                            raise _CallFailed from None  # out of the transaction: its writes are rolled back
                    # checked after every call, not only failed ones: a call that swallowed a database
                    # error leaves SQLite outside the transaction, where the next call must not run
                    if not store.intact(conn):
                        raise _GroupLost
        except _CallFailed:
            return True  # the call's own error stands; nothing of it was kept
        except _GroupLost as lost:
            log.warning("a group of %d calls was lost to a database failure (%s); running each alone",
                        len(batch), lost.__cause__ or "transaction ended early")  # fmt: skip
            return False
        except Exception as exc:  # the commit (or the rollback) failed: nobody's change is durable
            log.warning("commit of %d calls failed (%s); running each alone", len(batch), exc)
            return False
        return True

    def _run_alone(self, job: _Job[Any]) -> None:
        """Run one call in a transaction of its own, after its group was lost; a database failure is a 503."""
        store = self.controller.store
        try:
            with store.group() as conn:
                job.result = job.fn()
                if not store.intact(conn):
                    raise _GroupLost
        except BaseException as exc:
            job.result = None
            lost = isinstance(exc, _GroupLost) or is_storage_failure(exc)
            job.error = storage_unavailable(exc) if lost else exc
            if lost:
                self.controller.forget_cached()

    async def admit(self, tenant: str, specs: list[TaskSpec]) -> None:
        """Rate limits at the door, before the database: see `tenancy.admit_submission`."""
        await self.admit_counts(tenant, len(specs), sum(1 for s in specs if s.gpu is GpuMode.REQUIRE))

    async def admit_counts(self, tenant: str, n: int, n_gpu_only: int) -> None:
        """`admit` for n submissions that are not (yet) task specs: a pipeline run counts as one. A refusal
        is answered as `paced` says."""
        try:
            admit_submission(self.submissions, self.gpu_submissions, tenant, n, n_gpu_only)
        except RateLimited as refusal:
            raise await self.paced(tenant, refusal) from None

    async def still_valid(self, token_id: str) -> None:
        """Unauthorized (401) once the token `token_id` is revoked: a request held open after its token was
        checked (a wait for a result, an event stream, a lease poll) asks between its waits, so a revoked
        token stops there as the very next request would. A memory lookup but once per `TokenBook.CACHE_S`."""
        if not self.auth:
            return
        alive = self.tokens.alive_cached(token_id)
        if alive is None:
            alive = await self.read(self.tokens.alive, token_id)
        if not alive:
            raise Unauthorized(UNKNOWN_TOKEN)

    def tokens_revoked(self) -> None:
        """A revocation committed: forget cached token lookups here, and on the other replicas."""
        self.tokens.forget()
        publish = self._publisher(TOKENS)
        if publish is not None:
            publish()

    async def paced(self, tenant: str, refusal: RateLimited) -> RateLimited:
        """`refusal`, once the hold `tenancy.RefusalPace` gives it is over (none for a tenant whose clients wait
        out their 429s): a client that keeps sending regardless hears its refusals a second apart."""
        hold_s = self.pace.refused(tenant, time.monotonic())
        if not hold_s:
            return refusal
        try:
            with contextlib.suppress(TimeoutError):  # a controller that stops answers at once
                await asyncio.wait_for(self.closing.wait(), hold_s)
        finally:
            self.pace.released(tenant)
        return refusal.after(hold_s)

    # ---- wake-ups ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def watch_tasks(self, task_ids: Iterable[str]) -> Iterator[asyncio.Event]:
        """An event set when a worker's result ends one of these tasks, or a stage of these pipeline runs
        (`results_in`). A result wakes only the waits on its own task and run: with every wait woken by every
        result, each one re-read its task at every completion in the cluster. Waiters also wait on
        `tasks_changed`, for the other ways a task ends."""
        event = asyncio.Event()
        ids = list(task_ids)
        for task_id in ids:
            self._task_waits.setdefault(task_id, set()).add(event)
        try:
            yield event
        finally:
            for task_id in ids:
                waits = self._task_waits.get(task_id)
                if waits is not None:
                    waits.discard(event)
                    if not waits:
                        del self._task_waits[task_id]
                        self._ended_tasks.pop(task_id, None)
                        self._ended_runs.pop(task_id, None)

    def watched(self, task_id: str) -> bool:
        """Whether a wait here watches this task or run (asked from the database thread: a dict lookup)."""
        return task_id in self._task_waits

    def results_in(
        self,
        task_ids: Iterable[str],
        tasks: Mapping[str, Task] | None = None,
        runs: Mapping[str, RunView] | None = None,
    ) -> None:
        """Workers' results ended these tasks (or stages of these runs): wake the waits on them here, and every
        replica's waits. `tasks`, `runs`: those ended, as the results' commit read them back, for the waits
        to answer with (`ended_task`, `ended_run`)."""
        for task_id, task in (tasks or {}).items():
            if task_id in self._task_waits:
                self._ended_tasks[task_id] = task
        for run_id, view in (runs or {}).items():
            if run_id in self._task_waits:
                self._ended_runs[run_id] = view
        for task_id in task_ids:
            for event in self._task_waits.get(task_id, ()):
                event.set()
        if self.bus is not None:
            self.bus.publish("tasks")

    def ended_task(self, task_id: str, scope: str | None) -> Task | None:
        """The task as the result's commit that ended it left it, for a wait on it in tenant `scope` (None:
        every tenant); None when there is none to give (read it)."""
        task = self._ended_tasks.get(task_id)
        return task if task is not None and scope in (None, task.tenant) else None

    def ended_run(self, run_id: str, scope: str | None) -> RunView | None:
        """`ended_task` for a pipeline run: the run and its task per stage."""
        view = self._ended_runs.get(run_id)
        return view if view is not None and scope in (None, view[0].tenant) else None

    def handed(self, worker_id: str, task_ids: Iterable[str]) -> None:
        """These tasks went to the worker outside its lease polls (an exchange's lease, a stage it chained). A
        poll under way lists what its worker ran when it was sent, and is not woken for them (the worker knows
        them from the exchange's answer); it watches them from its next look (`handed_since`), so a cancel
        of one reaches the worker at once, even where the poll never looked since the hand-over."""
        now = time.monotonic()
        kept = self._handed.get(worker_id)
        for task_id in task_ids:
            if kept is None:
                kept = self._handed[worker_id] = {}
            self._handed_count += 1
            kept[task_id] = (self._handed_count, now)
        while kept and len(kept) > HANDED_KEPT:
            del kept[next(iter(kept))]

    def reported(self, worker_id: str, task_ids: Iterable[str]) -> None:
        """The worker's results ended these tasks: no poll of its needs to watch them any more."""
        kept = self._handed.get(worker_id)
        if kept:
            for task_id in task_ids:
                kept.pop(task_id, None)
            if not kept:
                del self._handed[worker_id]  # a worker that leaves for good leaves nothing behind

    def handed_since(self, worker_id: str, since: float, after: int) -> tuple[list[str], int]:
        """The tasks handed to the worker outside its polls since `since` (monotonic seconds), after the
        hand-over numbered `after`, not yet reported on; and the number of the last: a poll takes each
        hand-over once."""
        kept = self._handed.get(worker_id)
        if not kept:
            return [], after
        old = time.monotonic() - HANDED_KEPT_S
        while kept and next(iter(kept.values()))[1] < old:
            del kept[next(iter(kept))]
        new = [(n, task_id) for task_id, (n, at) in kept.items() if n > after and at >= since]
        return [task_id for _, task_id in new], max((n for n, _ in new), default=after)

    def worker_signal(self, worker_id: str) -> Signal:
        signal = self._worker_signals.get(worker_id)
        if signal is None:
            signal = self._worker_signals[worker_id] = Signal(
                self._publisher(f"w={worker_id}"), self.polls_epoch
            )
        return signal

    @contextlib.contextmanager
    def leasing(self, worker_id: str) -> Iterator[None]:
        """A lease poll of this worker is deciding (its lease is under way): freed room may change its answer."""
        with _counted(self._room_polls, worker_id, True):
            yield

    @contextlib.contextmanager
    def parked(self, worker_id: str, result: LeaseResult) -> Iterator[None]:
        """A lease poll of this worker waits here with what its last look found: `full`, it waits for freed
        capacity, not for new tasks; `backlog` (or a look cut short: its room kept for other tenants), queued
        work it did not take could be taken once room is freed."""
        with (
            _counted(self._full_polls, worker_id, result.full),
            _counted(self._room_polls, worker_id, result.full or result.backlog or not result.looked),
        ):
            yield

    @contextlib.contextmanager
    def queue_poll(self, worker_id: str, tenant: str) -> Iterator[QueuePoll]:
        """A lease poll of this worker, for as long as its request lasts, for `tasks_queued` to wake."""
        cred = self.workers.cached(worker_id)  # its route checked the worker's credential: cached then
        poll = QueuePoll(worker_id, tenant, None if cred is None or not self.auth else cred.token_id)
        self._polls[poll] = None
        try:
            yield poll
        finally:
            poll.ended = True
            del self._polls[poll]
            if poll.woken_for:  # woken while it was answering (or giving up): it will not look, the next may
                self._wake(poll.woken_for, poll)

    def tasks_queued(self, tasks: Sequence[Task], seen_by: Sequence[QueuePoll] = ()) -> None:
        """Submissions queued these tasks: wake, for each, the longest-waiting lease poll that could take it,
        not all of them: with every poll woken by every task, every idle worker looked at the queue for each new
        task though only one could take it. A woken poll that leaves work queued, or could not look, wakes the
        next (`pass_on`). Other replicas' polls all wake, as for any change to the queue. `seen_by`: polls that
        looked after the tasks were queued (`submit`): as for a poll that looked since it was woken for them,
        no wake-up for them comes to those, passed on or not."""
        self.polls_epoch.bump()
        publish = self._publisher("queue")
        if publish is not None:
            publish()
        count = self.polls_epoch.count
        for poll in seen_by:
            poll.looked_at = max(poll.looked_at, count)
        self._wake([(t.spec.capability, t.tenant, count) for t in tasks], None)

    def pass_on(self, woken_for: list[NewTasks], poll: QueuePoll) -> None:
        """A poll woken for these new tasks did not take them all: the next poll that could take them looks."""
        self._wake(woken_for, poll)

    def _wake(self, woken_for: list[NewTasks], skip: QueuePoll | None) -> None:
        """For n new tasks of one (capability, tenant), the n longest-waiting polls that could take them and
        have not looked since they were queued (fewer if fewer wait): a wake-up passed on never comes back to a
        poll that saw the tasks, so tasks nobody can take yet cost each poll one look, not a game of ping-pong.
        Each woken poll carries the triple once, however many tasks it stands for."""
        for new, n in Counter(woken_for).items():
            cap, tenant, queued_at = new
            fits = (p for p in self._polls
                    if p is not skip and p.looked_at < queued_at and p.may_take(cap, tenant))  # fmt: skip
            for poll in itertools.islice(fits, n):
                if new not in poll.woken_for:
                    poll.woken_for.append(new)
                poll.event.set()

    def capacity_freed(self, worker_id: str, offered: LeaseResult | None) -> None:
        """Results freed room on a worker: wake its own lease poll to fill it, where freed room could change its
        answer. Not when the same exchange already leased for that room (`offered`), unless it left room and the
        poll waits only for capacity (it must go back to waiting for new tasks); not for a poll parked with
        room to spare and nothing queued that did not fit (the worker asked for no work: it saw room too), which
        new tasks wake. Another replica may hold the poll: tell it, to be safe."""
        if self.bus is not None:
            wake = offered is None or not offered.full
        elif offered is None:
            wake = worker_id in self._room_polls
        else:
            wake = not offered.full and worker_id in self._full_polls
        if wake:
            self.worker_signal(worker_id).notify()

    def _publisher(self, name: str) -> Callable[[], None] | None:
        bus = self.bus
        return None if bus is None else functools.partial(bus.publish, name)

    def _remote(self, names: set[str]) -> None:
        """Another replica fired these signals (on the event loop): wake our waiters, publish nothing back."""
        every = ALL in names
        if every or TOKENS in names:
            self.tokens.forget()
        for name, signal in (("queue", self.queue_changed), ("changes", self.changes),
                             ("tasks", self.tasks_changed), ("events", self.events_added)):  # fmt: skip
            if every or name in names:
                signal.fire()
        for worker_id, signal in list(self._worker_signals.items()):
            if every or ANY_WORKER in names or f"w={worker_id}" in names:
                signal.fire()

    def changed(self) -> None:
        self.changes.notify()
        self.queue_changed.notify()
        self.tasks_changed.notify()

    # ---- liveness ------------------------------------------------------------------------------

    async def heartbeat(
        self, worker_id: str, *, metrics: dict[str, Any] | None, quarantined: dict[str, str] | None
    ) -> tuple[str, float]:
        """Record a heartbeat as arrived now; answer (state, heartbeat_s) without waiting on a slow database.

        The write (metrics, and `last_heartbeat` for other controllers on the same PostgreSQL) goes on the
        database thread; if it has not finished within `heartbeat_answer_s`, the answer is the last known
        state and the write finishes on its own. A worker that left (404) hears so once the write says it.
        """
        at = self.controller.clock()
        self.heard[worker_id] = at
        write = asyncio.ensure_future(
            self.call(self.controller.heartbeat, worker_id, metrics=metrics, quarantined=quarantined, at=at)
        )
        write.add_done_callback(functools.partial(self._heartbeat_written, worker_id))
        done, _ = await asyncio.wait({write}, timeout=self.heartbeat_answer_s)
        if write in done:
            worker: Worker = write.result()  # raises NotFound for a worker that left
            return worker.state.value, worker.heartbeat_s
        known = self._known.get(worker_id)
        if known is not None and known[0] == WorkerState.GONE.value:
            raise NotFound(f"worker {worker_id} has left; register again", field="worker")
        return known or (WorkerState.HEALTHY.value, self.controller.settings.heartbeat_s)

    def _heartbeat_written(self, worker_id: str, write: asyncio.Future[Worker]) -> None:
        if write.cancelled():
            return
        exc = write.exception()
        if isinstance(exc, NotFound):
            self._known[worker_id] = (WorkerState.GONE.value, self.controller.settings.heartbeat_s)
            self.heard.pop(worker_id, None)
        elif exc is None:
            worker = write.result()
            self._known[worker_id] = (worker.state.value, worker.heartbeat_s)

    def registered(self, worker: Worker) -> None:
        """A worker (re-)registered: it counts as heard now, and whatever was known of it is stale."""
        self.heard[worker.id] = worker.last_heartbeat
        self._known[worker.id] = (worker.state.value, worker.heartbeat_s)

    def lifeline_opened(self, worker_id: str) -> None:
        self._lifelines[worker_id] = self._lifelines.get(worker_id, 0) + 1
        self._lifeline_epoch[worker_id] = self._lifeline_epoch.get(worker_id, 0) + 1

    def lifeline_closed(self, worker_id: str, *, by_peer: bool) -> None:
        """A held connection ended. If the worker closed it (`by_peer`) and opens no new one within the
        grace, its process is taken to be gone: its tasks go back to the queue now, not three heartbeats on."""
        self._lifelines[worker_id] = max(0, self._lifelines.get(worker_id, 0) - 1)
        if not by_peer or self.closing.is_set():
            return
        epoch = self._lifeline_epoch.get(worker_id, 0)
        closed_at = self.controller.clock()
        loop = asyncio.get_running_loop()
        loop.call_later(
            self.reconnect_grace_s,
            lambda: self._spawn(self._judge_closed(worker_id, epoch, closed_at)),
        )

    async def _judge_closed(self, worker_id: str, epoch: int, closed_at: float) -> None:
        if self.closing.is_set() or self._lifelines.get(worker_id, 0) > 0:
            return
        if self._lifeline_epoch.get(worker_id, 0) != epoch:
            return  # it reconnected (and maybe dropped again: that drop is judged on its own)
        if self.heard.get(worker_id, 0.0) > closed_at:
            return  # it heartbeats: alive, only the connection was cut (a proxy, another controller)
        try:
            if await self.call(self.controller.connection_closed, worker_id, closed_at):
                self.changed()
        except Exception:  # the heartbeat judgement still applies later
            log.exception("re-queueing the tasks of worker %s (connection closed) failed", worker_id)

    def run_in_background(self, start: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run `start()` from `start()` of the service until it stops (e.g. the files' retention sweep)."""
        self._later.append(start)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- start and stop ------------------------------------------------------------------------

    async def start(self) -> None:
        self._reaper = asyncio.create_task(self._sweep_forever())
        for start in self._later:
            self._spawn(start())
        if self.bus is not None:
            loop = asyncio.get_running_loop()

            def deliver(names: set[str]) -> None:
                loop.call_soon_threadsafe(self._remote, names)

            self.bus.deliver = deliver
            self.bus.start()

    def begin_shutdown(self) -> None:
        """The server is going down (a signal): end held connections cleanly, and judge no worker by them.

        Safe to call from a signal handler in the loop's thread, or from another thread."""
        with contextlib.suppress(RuntimeError):  # no loop running: nothing is held
            self._loop().call_soon_threadsafe(self.closing.set)

    def _loop(self) -> asyncio.AbstractEventLoop:
        if self._reaper is None:
            raise RuntimeError("not started")
        return self._reaper.get_loop()

    async def stop(self) -> None:
        self.closing.set()
        if self._reaper:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.bus is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.bus.close)
        with contextlib.suppress(Exception):  # a database that fails now loses a second of run-time samples
            await self.call(self.controller.fold_samples, self.controller.clock())
        self._jobs.close()
        await asyncio.get_running_loop().run_in_executor(None, self._db.join)
        self._readers.shutdown(wait=True)
        self.controller.store.close()

    def _sweep(self, interval_s: float) -> bool:
        """One round of the sweep, if this replica claims it (one replica per round; the claim rides in the
        sweep's transaction). Returns whether anything changed."""
        ctrl = self.controller
        ctrl.fold_samples(ctrl.clock(), only_if_due=True)  # each replica writes the run times it heard
        if not claim_sweep(ctrl.store, "reap", self.replica_id, ctrl.clock(), interval_s):
            return False
        return ctrl.reap(self.heard)

    async def _sweep_forever(self) -> None:
        interval = self.controller.settings.reap_interval_s
        failing = False
        while True:
            try:
                if await self.call(self._sweep, interval):
                    self.changed()
                store = self.controller.store
                if store.dialect == "postgresql" and await self.call(
                    claim_sweep, store, "analyze", self.replica_id, self.controller.clock(), ANALYZE_EVERY_S
                ):
                    await self.read(
                        refresh_statistics, store
                    )  # a connection of its own, off the database thread
                if failing:
                    log.warning("sweep works again")
                failing = False
            except Exception:  # the sweep must outlive a bad moment (a full disk, a dropped connection)
                if not failing:
                    log.exception("sweep failed; retrying every %g s", interval)
                failing = True
            await asyncio.sleep(interval)
