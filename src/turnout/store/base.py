"""The one port for state: what the controller, pipeline runs, credentials, files and the API ask of a store.

Three implementations keep one contract (tests/contract runs every test over each): `SqlStore` on SQLite
(embedded) or PostgreSQL (replicas), and `MemoryStore` (tests and demos: nothing survives a restart).

The contract, whatever the backend:

- Every method is one transaction, all or nothing; inside `group()` the calls of one thread share one
  transaction, and a `savepoint()` in it undoes only its own writes when its body raises.
- Task state changes only through `update_tasks`: conditional updates (still in one of the expected states,
  still at the expected attempt), so a late or duplicate report changes nothing.
- Records come back as fresh values: changing what a read returned never changes the store.
- Ids, a token's hash, a worker's credential and an idempotency key (per tenant) are unique: a second
  insert raises `sqlalchemy.exc.IntegrityError` (the memory store raises the same, so callers meet one error).

Split by what each caller needs, so a reader sees which part of the state a module touches.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from turnout.models import Task, TaskState, Worker, WorkerState

if TYPE_CHECKING:
    from turnout.pipelines import PipelineRun
    from turnout.profiles import Profile, RunSample
    from turnout.store.files import FileRecord

# (task id, the states it may be in, the attempt it must be at or None for any, the column values to set)
TaskChange = tuple[str, Sequence[TaskState], "int | None", dict[str, Any]]


class QueuedKind(NamedTuple):
    """Queued tasks that share one verdict on whether any live worker could serve them (the sweep's
    `no_capacity` clock): one tenant (whom the workers that may serve them depend on), capability, gpu value
    and set of resource overrides, never retried (no routing history). `resources` is the overrides as stored
    (JSON text; None for none), `sample_id` one such task."""

    tenant: str
    capability: str
    gpu_mode: str
    resources: str | None
    sample_id: str


def queue_pages(limit: int, widen_to: int | None) -> Iterator[tuple[int, int]]:
    """(offset, rows) of each page a read of the queue takes (`TaskStore.queued_tasks`): `limit` rows first,
    then each page four times the last, up to `widen_to` rows in all. A lease reads what fits and one more;
    only a caller whose head of the queue does not fit reads on, and a deep queue is never read whole."""
    total = max(limit, widen_to or 0)
    offset, rows = 0, max(1, limit)
    while offset < total:
        rows = min(rows, total - offset)
        yield offset, rows
        offset += rows
        rows *= 4


class TaskStore(Protocol):
    """Tasks, their queue, and the capabilities workers ever registered."""

    def insert_tasks(self, tasks: Sequence[Task]) -> list[Task]:
        """All or none; a taken (tenant, idempotency_key) answers the stored task for the same request and
        raises IdempotencyConflict (naming its index) for another."""
        ...

    def known_capabilities(self) -> set[str]: ...

    def remember_capabilities(self, names: Iterable[str], now: float) -> None: ...

    def get_task(self, task_id: str) -> Task | None: ...

    def get_tasks(self, task_ids: Iterable[str], *, bare: bool = False) -> list[Task]:
        """The tasks that exist, each once, in no promised order. `bare`: without their input and output (None
        in their place), for an answer that shows neither: a pipeline's stages carry every output before them."""
        ...

    def list_tasks(
        self,
        *,
        tenant: str | None,
        state: str | None = None,
        capability: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> list[Task]:
        """Newest first (ids are time-ordered); `cursor`: the last id of the previous page."""
        ...

    def queued_tasks(
        self,
        capabilities: Iterable[str] | None = None,
        limit: int = 500,
        *,
        widen_to: int | None = None,
        tenant: str | None = None,
    ) -> Iterator[Task]:
        """Queued tasks, highest priority first, then oldest; `limit` first, up to `widen_to` if read on, in
        pages that grow (`queue_pages`)."""
        ...

    def queued_tenants(self) -> list[str]:
        """Tenants with queued tasks, in name order."""
        ...

    def active_by_tenant(self) -> dict[str, int]: ...

    def gpu_use_by_tenant(self) -> dict[str, float]: ...

    def queued_kinds(self) -> list[QueuedKind]: ...

    def queued_unusual(self, limit: int = 10_000) -> list[Task]:
        """Queued tasks with a routing history (a retry): each needs its own verdict."""
        ...

    def mark_servable(self, kind: QueuedKind, servable: bool, now: float, error: dict[str, Any]) -> list[str]:
        """Start, clear, or act on the placement-timeout clock of one kind's tasks; the ids that failed."""
        ...

    def active_tasks(self, worker_ids: Iterable[str] | None = None, *, inputs: bool = True) -> list[Task]:
        """Leased and running tasks (of these workers). `inputs=False`: each with `spec.input` None, not read
        (a lease weighs what its worker holds, up to 64 tasks with `--prefetch auto`, and needs none of it)."""
        ...

    def queue_depths(self, tenant: str | None = None) -> dict[str, dict[str, int]]: ...

    def task_stats(
        self,
        states: Iterable[TaskState] | None = None,
        run_s_buckets: Sequence[float] = (),
        *,
        tenant: str | None = None,
    ) -> list[dict[str, Any]]: ...

    def update_tasks(self, changes: Sequence[TaskChange]) -> list[str]:
        """Apply conditional changes in order, in one transaction; returns the ids whose condition held."""
        ...


class WorkerStore(Protocol):
    """Workers as registered, and the credential each got at its first registration."""

    def upsert_worker(self, worker: Worker) -> None: ...

    def get_worker(self, worker_id: str) -> Worker | None: ...

    def list_workers(self, *, include_gone: bool = False) -> list[Worker]:
        """In registration order."""
        ...

    def update_worker(
        self, worker_id: str, states: Sequence[WorkerState] | None = None, **values: Any
    ) -> bool:
        """Set columns of a worker that is in one of `states` (any, if None); whether it was."""
        ...

    def insert_worker_credential(
        self, worker_id: str, secret_hash: str, token_id: str, tenant: str, created_at: float
    ) -> None: ...

    def get_worker_credential(self, worker_id: str) -> dict[str, Any] | None: ...

    def worker_tenants(self) -> dict[str, str]: ...


class TokenStore(Protocol):
    """Bearer tokens, by their SHA-256 hashes."""

    def insert_token(
        self, token_id: str, token_hash: str, role: str, tenant: str, created_at: float
    ) -> None: ...

    def find_token(self, token_hash: str) -> dict[str, Any] | None: ...

    def get_token(self, token_id: str) -> dict[str, Any] | None: ...

    def revoke_token(self, token_id: str, now: float) -> bool:
        """Whether it was live (a second revocation changes nothing)."""
        ...

    def list_tokens(self, tenant: str | None = None) -> list[dict[str, Any]]: ...

    def count_tokens(self) -> int: ...


class EventStore(Protocol):
    """Tasks' events (seq 1, 2, ... per task) and the append-only audit log."""

    def append_events(self, items: Sequence[tuple[str, float, dict[str, Any]]]) -> dict[str, int]: ...

    def last_event_seq(self, task_id: str) -> int: ...

    def read_events(
        self, task_id: str, after: int = 0, limit: int = 1000
    ) -> list[tuple[int, float, dict[str, Any]]]: ...

    def append_audit(self, records: Sequence[tuple[float, str, str | None, dict[str, Any]]]) -> None: ...

    def list_audit(
        self,
        since: float | None = None,
        limit: int = 1000,
        *,
        tenant: str | None = None,
        kind: str | None = None,
        after_id: int | None = None,
    ) -> list[dict[str, Any]]: ...


class RunRecords(Protocol):
    """Pipeline runs and routing profiles (`store/runs.py` on SQL), in the same transactions as tasks."""

    def insert_run(self, run: PipelineRun) -> None: ...

    def get_run(self, run_id: str) -> PipelineRun | None: ...

    def get_runs(self, run_ids: Sequence[str]) -> list[PipelineRun]: ...

    def list_runs(
        self, *, tenant: str | None, state: str | None = None, limit: int = 50, cursor: str | None = None
    ) -> list[PipelineRun]: ...

    def runs_to_move_on(self, limit: int = 1000) -> list[PipelineRun]:
        """Running runs with no stage queued or in flight (the sweep moves them on)."""
        ...

    def update_run(self, run_id: str, expect_tasks: int, values: dict[str, Any]) -> bool:
        """Change a running run whose task list still has `expect_tasks` entries; whether it did."""
        ...

    def cost_by_tenant(self) -> list[tuple[str, str, float]]: ...

    def run_counts(self) -> list[tuple[str, str, int]]: ...

    def record_profile(
        self,
        capability: str,
        device: str,
        gpu_model: str | None,
        *,
        run_s: float,
        cold_start_s: float | None,
        peak_gpu_memory_bytes: int | None,
        peak_rss_bytes: int | None,
        now: float,
    ) -> None: ...

    def record_profiles(
        self, capability: str, device: str, gpu_model: str | None, samples: Sequence[RunSample], now: float
    ) -> bool:
        """Fold finished tasks, oldest first, into one profile; whether they were (a replica may skip)."""
        ...

    def profiles(self) -> list[Profile]: ...


class FileRecordStore(Protocol):
    """Records of uploaded files (`store/files.py` on SQL); their bytes live in a directory, not here."""

    def insert(self, record: FileRecord) -> None: ...

    def get(self, file_id: str) -> FileRecord | None: ...

    def owned(self, file_ids: set[str], tenant: str, now: float) -> set[str]:
        """Which of `file_ids` exist, belong to `tenant` and have not expired by `now` (the sweep deletes an
        expired file's record a while later: until then it is gone all the same)."""
        ...

    def delete(self, file_id: str) -> bool: ...

    def expire(self, now: float, limit: int = 1000) -> list[str]: ...


class Store(TaskStore, WorkerStore, TokenStore, EventStore, Protocol):
    """All the state of one controller (or of several replicas sharing one PostgreSQL database)."""

    url: str
    dialect: str  # "sqlite", "postgresql" or "memory": replicas.py and notify.py act on PostgreSQL only

    @property
    def runs(self) -> RunRecords: ...

    @property
    def files(self) -> FileRecordStore: ...

    def group(self) -> AbstractContextManager[Any]:
        """One transaction for everything this thread does inside, committed (durably) on exit; it yields the
        transaction, for `savepoint` and `intact`."""
        ...

    def savepoint(self, conn: Any) -> AbstractContextManager[None]:
        """A savepoint in `group()`'s transaction `conn`: if the body raises, its writes are undone and the rest
        of the group stands."""
        ...

    def intact(self, conn: Any) -> bool:
        """Whether `group()`'s transaction `conn` still holds all it was given (a database failure may end
        it early); committing one that is not would keep only part of the group."""
        ...

    def close(self) -> None: ...
