"""The one I/O port for state: tasks, workers, tokens, events and audit records.

Every method is one transaction, committed before it returns (SQLite: WAL with synchronous=FULL, so a
commit is fsync'd; PostgreSQL: its own durable commit). State changes are conditional updates
(`WHERE state IN (...) AND attempts = ...`), which is what makes a late or duplicate report harmless,
and what lets several controllers share one PostgreSQL database.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from turnout.errors import IdempotencyConflict, InvalidInput, StorageFull, TurnoutError, Unavailable
from turnout.gpu.allocation import GpuGrant
from turnout.models import (
    Allocation,
    Device,
    GpuMode,
    Routing,
    Task,
    TaskSpec,
    TaskState,
    Variant,
    Worker,
    WorkerState,
)
from turnout.resources import Resources, parse_resources
from turnout.store import schema
from turnout.store.base import QueuedKind, queue_pages
from turnout.store.migrations import migrate

if TYPE_CHECKING:
    from turnout.store.files import FileRecords
    from turnout.store.runs import RunStore

T = schema.tasks
W = schema.workers


def normalise_url(url: str) -> str:
    """Accept `postgresql://` and `sqlite:///path` as users write them; pick the psycopg 3 driver."""
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    if url.startswith(("sqlite://", "postgresql+psycopg://")):
        return url
    raise InvalidInput(f"db: {url!r} is not a sqlite:///PATH or postgresql:// URL", field="db")


def open_store(url: str) -> SqlStore:
    url = normalise_url(url)
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        if not url[len("sqlite:///") :].strip():
            raise InvalidInput(f"db: {url!r} names no file (sqlite:///PATH)", field="db")
        private_sqlite_file(Path(url[len("sqlite:///") :]).expanduser())
    return SqlStore(url)


SQLITE_HEADER = b"SQLite format 3\x00"  # the first bytes of every SQLite database file


def private_sqlite_file(path: Path) -> None:
    """Make the database file (and its -wal and -shm) readable by this user only, before SQLite opens it.

    Tasks' inputs and outputs, token hashes and the audit log live there. SQLite gives the -wal and -shm it
    creates the main file's mode, so creating the main file 0600 covers them; files left by an older
    version are tightened too. A directory made here is 0700; one that exists is left as it is.
    """
    try:
        if not path.parent.exists():
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            head = os.read(fd, len(SQLITE_HEADER))
        finally:
            os.close(fd)
    except OSError as exc:  # a directory, a path under a file, no permission, a full disk
        raise InvalidInput(f"db: cannot use {path} as the SQLite database file ({exc.strerror or exc})",
                           field="db") from None  # fmt: skip
    if head and head != SQLITE_HEADER:
        return  # another kind of file: SQLite refuses it as a database, and its mode is left as it was
    for name in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        with contextlib.suppress(FileNotFoundError):
            if name.stat().st_mode & 0o077:
                name.chmod(0o600)


def unopenable(url: str, exc: BaseException) -> TurnoutError:
    """What to tell the operator whose `--db` names a database that cannot be opened: which one (no password),
    the driver's reason, in one line. A SQLite file that is not a database (damaged, or another file) is the
    operator's input; a server that does not answer may be back in a moment; a SQLite file whose disk has no
    room (opening it may migrate it, which writes: the migration is then undone whole) is `StorageFull`."""
    cause = exc.orig if isinstance(exc, sa.exc.DBAPIError) and exc.orig is not None else exc
    reason = " ".join(str(cause).split()) or type(cause).__name__
    parsed = sa.engine.make_url(url)
    where = parsed.render_as_string(hide_password=True)
    if url.startswith("sqlite") and _disk_full(cause, parsed.database):  # opening may write
        return StorageFull(f"db: {where}: its disk is full ({reason}); nothing in the database was changed",
                           field="db")  # fmt: skip
    if url.startswith("sqlite"):
        return InvalidInput(f"db: cannot open {where} as a SQLite database ({reason})", field="db")
    return Unavailable(f"db: cannot open the database at {where} ({reason})", field="db")


SQLITE_FULL = 13  # SQLite's result code for a full disk (`sqlite3.SQLITE_FULL` from Python 3.11)
DISK_FULL_BYTES = 64 * 1024  # less room than this left on the database's disk: it is full


def _disk_full(cause: BaseException, path: str | None) -> bool:
    """Whether SQLite failed for want of room: it says so (SQLITE_FULL), or the disk that holds the database
    has none left (a full disk may fail SQLite's shared-memory file first, as a plain I/O error)."""
    code = getattr(cause, "sqlite_errorcode", None)  # Python 3.11+
    if code == SQLITE_FULL or "database or disk is full" in str(cause):
        return True
    try:
        room = os.statvfs(Path(path).parent) if path else None
    except OSError:
        return False
    return room is not None and room.f_bavail * room.f_frsize < DISK_FULL_BYTES


# Driver errors that mean the database itself failed (full, I/O error, gone, locked past the busy timeout),
# as opposed to a statement the database refused (a constraint): a transaction they hit may be gone whole.
_STORAGE_ERRORS: tuple[type[BaseException], ...] = (
    sa.exc.OperationalError,
    sa.exc.InterfaceError,
    sa.exc.InternalError,
    sqlite3.OperationalError,
    sqlite3.InterfaceError,
    sqlite3.InternalError,
)


def is_storage_failure(exc: BaseException) -> bool:
    """Whether `exc`, or an error it was raised from, is the database failing rather than refusing a statement."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, _STORAGE_ERRORS) or (
            isinstance(cur, sa.exc.DBAPIError) and cur.connection_invalidated
        ):
            return True
        if type(cur).__module__.startswith("psycopg") and type(cur).__name__ in (
            "OperationalError",
            "InterfaceError",
            "InternalError",
        ):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


class SqlStore:
    """State on SQLite or PostgreSQL. Outside `group()` every method is its own transaction; inside, all the
    calls of one thread share one transaction, so many small writes cost one commit (one fsync)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.dialect = url.split(":", 1)[0].split("+", 1)[0]
        if self.dialect == "sqlite":
            self.engine = sa.create_engine(url, connect_args={"check_same_thread": False, "timeout": 30},
                                           json_serializer=sqlite_json, json_deserializer=sqlite_json_value)  # fmt: skip
            sa.event.listen(self.engine, "connect", _sqlite_pragmas)
            sa.event.listen(self.engine, "begin", _sqlite_begin)
        else:
            self.engine = sa.create_engine(url, pool_size=8, max_overflow=8, pool_pre_ping=True)
        self._local = threading.local()
        try:
            self.schema_version = migrate(self.engine)
        except (sa.exc.DBAPIError, sqlite3.DatabaseError) as exc:
            self.engine.dispose()
            raise unopenable(url, exc) from None

    def close(self) -> None:
        self.engine.dispose()

    @functools.cached_property
    def runs(self) -> RunStore:
        """Pipeline runs and routing profiles, in this store's transactions (`store/runs.py`)."""
        from turnout.store.runs import RunStore

        return RunStore(self)

    @functools.cached_property
    def files(self) -> FileRecords:
        """File records, in this store's transactions (`store/files.py`)."""
        from turnout.store.files import FileRecords

        return FileRecords(self)

    @contextlib.contextmanager
    def group(self) -> Iterator[sa.Connection]:
        """One transaction for everything this thread does inside; committed (durably) on exit.

        A database failure inside (disk full, I/O error, a dropped connection) may end the transaction
        early, and SQLite then runs later statements outside it: check `intact(conn)` after each step,
        and treat a group that is not intact as wholly lost.
        """
        with self.engine.begin() as conn:
            self._local.conn = conn
            try:
                yield conn
            finally:
                self._local.conn = None

    @contextlib.contextmanager
    def savepoint(self, conn: sa.Connection) -> Iterator[None]:
        """A savepoint in `group()`'s transaction: if the body raises, its writes are undone and the rest of
        the group stands. Three statements straight to the driver, as SQLAlchemy's `begin_nested()` would send
        them, at a fortieth of its CPU (about 75 against 2 us a savepoint on SQLite here): the API's database
        thread opens one for every call it groups with another. A rollback that fails raises its own error
        (from the body's), which is the database failing (`is_storage_failure`): the group is lost."""
        raw = conn.connection.dbapi_connection
        assert raw is not None
        raw.execute("SAVEPOINT turnout_call")
        try:
            yield
        except BaseException:
            raw.execute("ROLLBACK TO SAVEPOINT turnout_call")
            raw.execute("RELEASE SAVEPOINT turnout_call")
            raise
        raw.execute("RELEASE SAVEPOINT turnout_call")

    def intact(self, conn: sa.Connection) -> bool:
        """Whether the group's transaction is still open, so that committing it would keep all it holds."""
        if conn.invalidated or conn.closed:
            return False
        try:
            raw = conn.connection.dbapi_connection
        except sa.exc.SQLAlchemyError:
            return False
        if self.dialect == "sqlite":
            return bool(getattr(raw, "in_transaction", False))
        # psycopg 3: INERROR (a failed statement outside any savepoint) or UNKNOWN (a broken connection) lose
        # the transaction; IDLE is a transaction that has not started, as when nothing was written yet
        info = getattr(raw, "info", None)
        status = getattr(getattr(info, "transaction_status", None), "name", "INTRANS")
        return status in ("INTRANS", "ACTIVE", "IDLE")

    def _write(self) -> contextlib.AbstractContextManager[sa.Connection]:
        return self._connection(write=True)

    def _read(self) -> contextlib.AbstractContextManager[sa.Connection]:
        return self._connection(write=False)

    @contextlib.contextmanager
    def _connection(self, *, write: bool) -> Iterator[sa.Connection]:
        """Inside `group()`, the group's connection; else a transaction of our own (committed if `write`)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            yield conn
            return
        with self.engine.begin() if write else self.engine.connect() as own:
            yield own

    # ---- tasks -------------------------------------------------------------------------------

    def insert_tasks(self, tasks: Sequence[Task]) -> list[Task]:
        """Insert new tasks, all or none. A task whose (tenant, idempotency_key) is taken yields the stored task
        when it asks for the same thing, and raises IdempotencyConflict (naming its index) when it does not.

        Two controllers may race on one key (PostgreSQL): the loser's insert meets the unique index and waits
        for the winner's commit; it then reads the winner's task and decides as if it had come second.
        """
        keyed = [t for t in tasks if t.spec.idempotency_key]
        races_left = 3
        with self._write() as conn:
            while True:
                out, fresh = _dedupe(tasks, self._tasks_by_key(conn, keyed) if keyed else {})
                if not fresh:
                    return out
                if not keyed and self.dialect == "sqlite":
                    TASKS.insert_rows(conn, fresh)
                    return out
                if not keyed:
                    conn.execute(T.insert(), fresh)
                    return out
                try:  # in a savepoint: a lost race undoes only this insert, not the caller's transaction
                    with conn.begin_nested():
                        conn.execute(T.insert(), fresh)
                    return out
                except sa.exc.IntegrityError:
                    races_left -= 1
                    if not races_left:
                        raise

    def _tasks_by_key(self, conn: sa.Connection, keyed: Sequence[Task]) -> dict[tuple[str, str], Task]:
        rows = conn.execute(
            sa.select(T).where(
                T.c.tenant.in_({t.tenant for t in keyed}),
                T.c.idempotency_key.in_({t.spec.idempotency_key for t in keyed}),
            )
        )
        return {(r.tenant, r.idempotency_key): _task(r) for r in rows}

    # ---- capabilities ------------------------------------------------------------------------

    def known_capabilities(self) -> set[str]:
        """Every capability a worker ever registered (workers that left included)."""
        with self._read() as conn:
            return {name for (name,) in conn.execute(sa.select(schema.capabilities.c.name))}

    def remember_capabilities(self, names: Iterable[str], now: float) -> None:
        """Record capabilities as known, once each; safe when several controllers record the same name."""
        rows = [{"name": n, "first_seen_at": now} for n in sorted(set(names))]
        if not rows:
            return
        insert = (sqlite_insert if self.dialect == "sqlite" else pg_insert)(schema.capabilities)
        with self._write() as conn:
            conn.execute(insert.on_conflict_do_nothing(index_elements=["name"]), rows)

    def get_task(self, task_id: str) -> Task | None:
        with self._read() as conn:
            if self.dialect == "sqlite":
                found = _sqlite_tasks(conn, TASKS.select("id = ?"), (task_id,))
                return found[0] if found else None
            row = conn.execute(_GET_TASK, {"id": task_id}).first()
        return _task(row) if row else None

    def get_tasks(self, task_ids: Iterable[str], *, bare: bool = False) -> list[Task]:
        ids = list(task_ids)
        if not ids:
            return []
        with self._read() as conn:
            if self.dialect == "sqlite":
                return _sqlite_tasks(conn, TASKS.by_ids(len(ids), blank=BARE if bare else ()), ids)
            return [_task(r) for r in conn.execute(_GET_TASKS_BARE if bare else _GET_TASKS, {"ids": ids})]

    def list_tasks(
        self,
        *,
        tenant: str | None,
        state: str | None = None,
        capability: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> list[Task]:
        query = sa.select(T).order_by(T.c.id.desc()).limit(limit)
        if tenant is not None:
            query = query.where(T.c.tenant == tenant)
        if state:
            query = query.where(T.c.state == state)
        if capability:
            query = query.where(T.c.capability == capability)
        if cursor:
            query = query.where(T.c.id < cursor)
        with self._read() as conn:
            return [_task(r) for r in conn.execute(query)]

    def queued_tasks(
        self,
        capabilities: Iterable[str] | None = None,
        limit: int = 500,
        *,
        widen_to: int | None = None,
        tenant: str | None = None,
    ) -> Iterator[Task]:
        """Queued tasks (of one tenant, or of all), highest priority first, then oldest first, decoded as the
        caller reads.

        Reads `limit` rows first; a caller that reads past them gets more, up to `widen_to` in all, in pages
        that grow (`queue_pages`): a row costs its decoding, and most callers stop after the first few.
        """
        if capabilities is None:
            capabilities = [name for (name,) in self._capabilities_queued()]
        caps = list(capabilities)
        if not caps:
            return
        for offset, rows in queue_pages(limit, widen_to):
            page = self._queued_page(caps, tenant, rows, offset)
            yield from page
            if len(page) < rows:
                return

    def _queued_page(self, caps: list[str], tenant: str | None, count: int, offset: int) -> list[Task]:
        with self._read() as conn:
            if self.dialect == "sqlite":
                of = "" if tenant is None else "tenant = ? AND "
                where = f"state = 'queued' AND {of}capability IN ({_marks(len(caps))}) {_QUEUE_ORDER}"
                bound = [*([] if tenant is None else [tenant]), *caps, count, offset]
                return _sqlite_tasks(conn, TASKS.select(where), bound)
            # PostgreSQL: rows another replica's lease holds are skipped, not waited for (replicas take
            # different tasks instead of queueing behind each other); the conditional update still makes each
            # claim once
            postgres = self.dialect == "postgresql"
            params: dict[str, Any] = {"caps": caps, "limit": count, "offset": offset}
            if tenant is None:
                query = _QUEUED_SKIP_LOCKED if postgres else _QUEUED
            else:
                query = _QUEUED_OF_SKIP_LOCKED if postgres else _QUEUED_OF
                params["tenant"] = tenant
            return [_task(r) for r in conn.execute(query, params)]

    def queued_tenants(self) -> list[str]:
        """The tenants with queued tasks, by index seeks (one per tenant), not a scan of a deep queue."""
        with self._read() as conn:
            return [r[0] for r in conn.execute(_QUEUED_TENANTS) if r[0] is not None]

    def active_by_tenant(self) -> dict[str, int]:
        """Leased or running tasks per tenant: who holds the most of the cluster now."""
        query = sa.select(T.c.tenant, sa.func.count()).where(T.c.state.in_(_ACTIVE)).group_by(T.c.tenant)
        with self._read() as conn:
            return {tenant: int(n) for tenant, n in conn.execute(query)}

    def gpu_use_by_tenant(self) -> dict[str, float]:
        """GPUs each tenant holds now (leased or running tasks; a share counts its fraction). A batch's tasks
        share their leader's grant (batching.py): it counts once, however many ride on it. A task an
        escalation endpoint holds (worker `cloud:NAME`) counts one GPU."""
        held = sa.or_(T.c.gpus.is_not(None), T.c.worker_id.like("cloud:%"))
        query = sa.select(T.c.id, T.c.tenant, T.c.alloc).where(T.c.state.in_(_ACTIVE), held)
        with self._read() as conn:
            return gpus_held(
                [(tenant, Allocation.from_dict(alloc)) for _id, tenant, alloc in conn.execute(query)]
            )

    def _capabilities_queued(self) -> list[Any]:
        with self._read() as conn:
            query = sa.select(T.c.capability).where(T.c.state == TaskState.QUEUED.value).distinct()
            return list(conn.execute(query).all())

    def queued_kinds(self) -> list[QueuedKind]:
        """One per kind of queued task never retried (`QueuedKind`): a deep queue of tasks with the same
        overrides (`gpu: 0.25`) is judged once, not task by task."""
        query = (
            sa.select(T.c.tenant, T.c.capability, T.c.gpu_mode, _RESOURCES_TEXT, sa.func.min(T.c.id))
            .where(T.c.state == TaskState.QUEUED.value, T.c.routing.is_(None))
            .group_by(T.c.tenant, T.c.capability, T.c.gpu_mode, _RESOURCES_TEXT)
        )
        with self._read() as conn:
            return [QueuedKind(t, c, m, r, i) for t, c, m, r, i in conn.execute(query)]

    def queued_unusual(self, limit: int = 10_000) -> list[Task]:
        """Queued tasks with a routing history (a retry): each needs its own verdict."""
        query = sa.select(T).where(T.c.state == TaskState.QUEUED.value, T.c.routing.is_not(None)).limit(limit)
        with self._read() as conn:
            return [_task(r) for r in conn.execute(query)]

    def mark_servable(self, kind: QueuedKind, servable: bool, now: float, error: dict[str, Any]) -> list[str]:
        """For the queued tasks of one kind: start, clear, or act on the placement-timeout clock, in SQL.

        Returns the ids that failed `no_capacity` (unservable for their whole `placement_timeout_s`).
        """
        same = _RESOURCES_TEXT.is_not_distinct_from(kind.resources)  # NULL: no overrides
        where = (T.c.state == TaskState.QUEUED.value, T.c.tenant == kind.tenant, T.c.capability == kind.capability,
                 T.c.gpu_mode == kind.gpu_mode, same, T.c.routing.is_(None))  # fmt: skip
        failed: list[str] = []
        with self._write() as conn:
            if servable:
                conn.execute(
                    T.update().where(*where, T.c.unservable_since.is_not(None)).values(unservable_since=None)
                )
                return failed
            conn.execute(
                T.update().where(*where, T.c.unservable_since.is_(None)).values(unservable_since=now)
            )
            due = (*where, T.c.unservable_since + T.c.placement_timeout_s <= now)
            failed = [r[0] for r in conn.execute(sa.select(T.c.id).where(*due))]
            if failed:
                conn.execute(T.update().where(T.c.id.in_(failed), *where)
                             .values(state=TaskState.FAILED.value, error=error, finished_at=now))  # fmt: skip
        return failed

    def active_tasks(self, worker_ids: Iterable[str] | None = None, *, inputs: bool = True) -> list[Task]:
        with self._read() as conn:
            if worker_ids is None:
                return [_task(r) for r in conn.execute(_ACTIVE_ALL if inputs else _ACTIVE_ALL_BARE)]
            workers = list(worker_ids)
            if self.dialect == "sqlite":
                where = f"state IN ('{_ACTIVE[0]}', '{_ACTIVE[1]}') AND worker_id IN ({_marks(len(workers))})"
                sql = TASKS.select(where) if inputs else TASKS.select(where, blank="input")
                return _sqlite_tasks(conn, sql, workers) if workers else []
            query = _ACTIVE_OF if inputs else _ACTIVE_OF_BARE
            return [_task(r) for r in conn.execute(query, {"workers": workers})]

    def queue_depths(self, tenant: str | None = None) -> dict[str, dict[str, int]]:
        """capability -> state -> count, over the non-terminal states (of one tenant, or of all)."""
        query = (
            sa.select(T.c.capability, T.c.state, sa.func.count())
            .where(T.c.state.in_([s.value for s in (TaskState.QUEUED, TaskState.LEASED, TaskState.RUNNING)]))
            .group_by(T.c.capability, T.c.state)
        )
        if tenant is not None:
            query = query.where(T.c.tenant == tenant)
        out: dict[str, dict[str, int]] = {}
        with self._read() as conn:
            for cap, state, n in conn.execute(query):
                out.setdefault(cap, {})[state] = n
        return out

    def task_stats(
        self,
        states: Iterable[TaskState] | None = None,
        run_s_buckets: Sequence[float] = (),
        *,
        tenant: str | None = None,
    ) -> list[dict[str, Any]]:
        """Counts per (capability, state, device, gpu_mode), in one grouped scan, for metrics and the dashboard
        (`tenant`: only that tenant's tasks).

        Each row: those four keys, `count`, `run_s_count` and `run_s_sum` (tasks with a run time), `cost_usd`
        (their summed cost), and `run_s_buckets`: how many ran at most each of `run_s_buckets` seconds.
        """
        keys = (T.c.capability, T.c.state, T.c.device, T.c.gpu_mode)
        aggs = [sa.func.count(), sa.func.count(T.c.run_s), sa.func.coalesce(sa.func.sum(T.c.run_s), 0.0),
                sa.func.coalesce(sa.func.sum(T.c.cost_usd), 0.0),
                *(sa.func.sum(sa.case((T.c.run_s <= b, 1), else_=0)) for b in run_s_buckets)]  # fmt: skip
        query = sa.select(*keys, *aggs).group_by(*keys)
        if states is not None:
            query = query.where(T.c.state.in_([s.value for s in states]))
        if tenant is not None:
            query = query.where(T.c.tenant == tenant)
        with self._read() as conn:
            return [
                {"capability": r[0], "state": r[1], "device": r[2], "gpu_mode": r[3], "count": int(r[4]),
                 "run_s_count": int(r[5]), "run_s_sum": float(r[6]), "cost_usd": float(r[7]),
                 "run_s_buckets": [int(n or 0) for n in r[8:]]}
                for r in conn.execute(query)
            ]  # fmt: skip

    def update_tasks(
        self, changes: Sequence[tuple[str, Sequence[TaskState], int | None, dict[str, Any]]]
    ) -> list[str]:
        """Apply conditional updates in one transaction: (task id, allowed states, attempts or None, values).

        Returns the ids whose condition held. This is the only way task state changes.

        On PostgreSQL, changes of one shape (same allowed states, same columns) to distinct tasks go as one
        `UPDATE ... FROM (VALUES ...)`: a lease or a report of many tasks costs one round trip, not one
        per task, and round trips are most of what a replica's database thread waits on.
        """
        if self.dialect == "postgresql" and 1 < len({c[0] for c in changes}) == len(changes):
            return self._update_tasks_together(changes)
        done: list[str] = []
        with self._write() as conn:
            if self.dialect == "sqlite":
                return _sqlite_update_tasks(conn, changes)
            for task_id, states, attempts, values in changes:
                query = _task_update(tuple(s.value for s in states), attempts is not None, tuple(values))
                params = {f"v_{k}": v for k, v in _encode(values).items()}
                params["_id"] = task_id
                if attempts is not None:
                    params["_attempts"] = attempts
                if conn.execute(query, params).rowcount:
                    done.append(task_id)
        return done

    def _update_tasks_together(
        self, changes: Sequence[tuple[str, Sequence[TaskState], int | None, dict[str, Any]]]
    ) -> list[str]:
        """`update_tasks` for distinct tasks on PostgreSQL: one statement per shape, each column's values
        sent as one array (`_task_update_many`)."""
        Shape = tuple[tuple[str, ...], bool, tuple[str, ...]]  # allowed states, attempts checked, columns
        shapes: dict[Shape, list[tuple[str, int | None, dict[str, Any]]]] = {}
        for task_id, allowed, attempts, values in changes:
            shape = (tuple(s.value for s in allowed), attempts is not None, tuple(values))
            shapes.setdefault(shape, []).append((task_id, attempts, _encode(values)))
        won: set[str] = set()
        with self._write() as conn:
            for (states, with_attempts, keys), rows in shapes.items():
                arrays: list[list[Any]] = [[r[0] for r in rows]]
                if with_attempts:
                    arrays.append([r[1] for r in rows])
                for k in keys:
                    as_json = k in TASKS.json  # written as SQLAlchemy's JSON type writes it (None is NULL)
                    arrays.append([_json_text(r[2][k]) if as_json else r[2][k] for r in rows])
                sql = _task_update_many(states, with_attempts, keys)
                won.update(
                    r[0] for r in conn.exec_driver_sql(sql, {f"p{i}": a for i, a in enumerate(arrays)})
                )
        return [c[0] for c in changes if c[0] in won]

    # ---- workers -----------------------------------------------------------------------------

    def upsert_worker(self, worker: Worker) -> None:
        row = _worker_row(worker)
        with self._write() as conn:
            if conn.execute(W.update().where(W.c.id == worker.id).values(**row)).rowcount == 0:
                conn.execute(W.insert().values(id=worker.id, **row))

    def get_worker(self, worker_id: str) -> Worker | None:
        with self._read() as conn:
            row = conn.execute(_GET_WORKER, {"id": worker_id}).first()
        return _worker(row) if row else None

    def list_workers(self, *, include_gone: bool = False) -> list[Worker]:
        with self._read() as conn:
            return [_worker(r) for r in conn.execute(_ALL_WORKERS if include_gone else _LIVE_WORKERS)]

    def update_worker(
        self, worker_id: str, states: Sequence[WorkerState] | None = None, **values: Any
    ) -> bool:
        query = W.update().where(W.c.id == worker_id)
        if states is not None:
            query = query.where(W.c.state.in_([s.value for s in states]))
        with self._write() as conn:
            return bool(conn.execute(query.values(**values)).rowcount)

    # ---- tokens ------------------------------------------------------------------------------

    def insert_token(self, token_id: str, token_hash: str, role: str, tenant: str, created_at: float) -> None:
        with self._write() as conn:
            conn.execute(
                schema.tokens.insert().values(
                    id=token_id, hash=token_hash, role=role, tenant=tenant, created_at=created_at
                )
            )

    def find_token(self, token_hash: str) -> dict[str, Any] | None:
        with self._read() as conn:
            row = conn.execute(sa.select(schema.tokens).where(schema.tokens.c.hash == token_hash)).first()
        return dict(row._mapping) if row else None

    def get_token(self, token_id: str) -> dict[str, Any] | None:
        with self._read() as conn:
            row = conn.execute(sa.select(schema.tokens).where(schema.tokens.c.id == token_id)).first()
        return dict(row._mapping) if row else None

    def revoke_token(self, token_id: str, now: float) -> bool:
        tok = schema.tokens
        with self._write() as conn:
            query = (
                tok.update().where(tok.c.id == token_id, tok.c.revoked_at.is_(None)).values(revoked_at=now)
            )
            return bool(conn.execute(query).rowcount)

    def list_tokens(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """Tokens (of one tenant, or all), oldest first, without their hashes."""
        tok = schema.tokens
        query = sa.select(tok.c.id, tok.c.role, tok.c.tenant, tok.c.created_at, tok.c.revoked_at).order_by(
            tok.c.created_at, tok.c.id
        )
        if tenant is not None:
            query = query.where(tok.c.tenant == tenant)
        with self._read() as conn:
            return [dict(r._mapping) for r in conn.execute(query)]

    # ---- worker credentials ------------------------------------------------------------------

    def insert_worker_credential(
        self, worker_id: str, secret_hash: str, token_id: str, tenant: str, created_at: float
    ) -> None:
        with self._write() as conn:
            values = {"worker_id": worker_id, "secret_hash": secret_hash, "token_id": token_id,
                      "tenant": tenant, "created_at": created_at}  # fmt: skip
            conn.execute(schema.worker_credentials.insert().values(**values))

    def get_worker_credential(self, worker_id: str) -> dict[str, Any] | None:
        wc = schema.worker_credentials
        with self._read() as conn:
            row = conn.execute(sa.select(wc).where(wc.c.worker_id == worker_id)).first()
        return dict(row._mapping) if row else None

    def worker_tenants(self) -> dict[str, str]:
        """worker id -> the tenant it serves ("*": every tenant)."""
        wc = schema.worker_credentials
        with self._read() as conn:
            return {r.worker_id: r.tenant for r in conn.execute(sa.select(wc.c.worker_id, wc.c.tenant))}

    def count_tokens(self) -> int:
        with self._read() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(schema.tokens)).scalar_one())

    # ---- events ------------------------------------------------------------------------------

    def append_events(self, items: Sequence[tuple[str, float, dict[str, Any]]]) -> dict[str, int]:
        """Append (task id, ts, body) in order; seq is per task, 1, 2, ... Returns the last seq per task."""
        ev = schema.events
        last: dict[str, int] = {}
        with self._write() as conn:
            for task_id in dict.fromkeys(t for t, _, _ in items):
                last[task_id] = conn.execute(
                    sa.select(sa.func.coalesce(sa.func.max(ev.c.seq), 0)).where(ev.c.task_id == task_id)
                ).scalar_one()
            rows = []
            for task_id, ts, body in items:
                last[task_id] += 1
                rows.append({"task_id": task_id, "seq": last[task_id], "ts": ts, "body": body})
            if rows:
                conn.execute(ev.insert(), rows)
        return last

    def last_event_seq(self, task_id: str) -> int:
        ev = schema.events
        with self._read() as conn:
            query = sa.select(sa.func.coalesce(sa.func.max(ev.c.seq), 0)).where(ev.c.task_id == task_id)
            return int(conn.execute(query).scalar_one())

    def read_events(
        self, task_id: str, after: int = 0, limit: int = 1000
    ) -> list[tuple[int, float, dict[str, Any]]]:
        ev = schema.events
        query = (
            sa.select(ev.c.seq, ev.c.ts, ev.c.body)
            .where(ev.c.task_id == task_id, ev.c.seq > after)
            .order_by(ev.c.seq)
            .limit(limit)
        )
        with self._read() as conn:
            return [(r.seq, r.ts, r.body) for r in conn.execute(query)]

    # ---- audit -------------------------------------------------------------------------------

    def append_audit(self, records: Sequence[tuple[float, str, str | None, dict[str, Any]]]) -> None:
        if not records:
            return
        rows = [{"ts": ts, "kind": k, "tenant": tn, "body": b} for ts, k, tn, b in records]
        with self._write() as conn:
            if self.dialect == "sqlite":  # a GPU task's path writes two: through the driver (RawTable)
                AUDIT.insert_rows(conn, rows)
            else:
                conn.execute(schema.audit.insert(), rows)

    def list_audit(
        self,
        since: float | None = None,
        limit: int = 1000,
        *,
        tenant: str | None = None,
        kind: str | None = None,
        after_id: int | None = None,
    ) -> list[dict[str, Any]]:
        """Audit records in the order written; `after_id` pages (the last id seen)."""
        a = schema.audit
        query = sa.select(a).order_by(a.c.id).limit(limit)
        if since is not None:
            query = query.where(a.c.ts >= since)
        if tenant is not None:
            query = query.where(a.c.tenant == tenant)
        if kind is not None:
            query = query.where(a.c.kind == kind)
        if after_id is not None:
            query = query.where(a.c.id > after_id)
        with self._read() as conn:
            return [dict(r._mapping) for r in conn.execute(query)]


# Hot statements, built once: building SQLAlchemy expressions costs more than running them on SQLite.
_GET_TASK = sa.select(T).where(T.c.id == sa.bindparam("id"))
_GET_TASKS = sa.select(T).where(T.c.id.in_(sa.bindparam("ids", expanding=True)))
BARE = ("input", "output")  # the columns a bare read leaves out (`get_tasks(bare=True)`)
_GET_TASKS_BARE = sa.select(*(sa.null().label(c.name) if c.name in BARE else c for c in T.c)).where(
    T.c.id.in_(sa.bindparam("ids", expanding=True))
)
_ACTIVE = (TaskState.LEASED.value, TaskState.RUNNING.value)
_ACTIVE_ALL = sa.select(T).where(T.c.state.in_(_ACTIVE))
_ACTIVE_OF = _ACTIVE_ALL.where(T.c.worker_id.in_(sa.bindparam("workers", expanding=True)))
# the same without the inputs (NULL in their place): what a lease weighs needs none of them
_ACTIVE_ALL_BARE = sa.select(*(sa.null().label("input") if c.name == "input" else c for c in T.c)).where(
    T.c.state.in_(_ACTIVE)
)
_ACTIVE_OF_BARE = _ACTIVE_ALL_BARE.where(T.c.worker_id.in_(sa.bindparam("workers", expanding=True)))
# a task's resource overrides as stored: tasks with equal text share a kind (`QueuedKind`); PostgreSQL's json
# keeps the text as written, and has no equality of its own
_RESOURCES_TEXT = sa.cast(T.c.resources, sa.Text)
_QUEUE_ORDER = "ORDER BY priority DESC, created_at, id LIMIT ? OFFSET ?"  # _QUEUED's, as SQLite text
_QUEUED = (
    sa.select(T)
    .where(T.c.state == TaskState.QUEUED.value, T.c.capability.in_(sa.bindparam("caps", expanding=True)))
    .order_by(T.c.priority.desc(), T.c.created_at, T.c.id)
    .limit(sa.bindparam("limit"))
    .offset(sa.bindparam("offset"))
)
_QUEUED_OF = (
    sa.select(T)
    .where(
        T.c.state == TaskState.QUEUED.value,
        T.c.tenant == sa.bindparam("tenant"),
        T.c.capability.in_(sa.bindparam("caps", expanding=True)),
    )
    .order_by(T.c.priority.desc(), T.c.created_at, T.c.id)
    .limit(sa.bindparam("limit"))
    .offset(sa.bindparam("offset"))
)
# a loose index scan: the next tenant after the last, one seek each (works on SQLite and PostgreSQL alike)
_QUEUED_TENANTS = sa.text(
    "WITH RECURSIVE q(tenant) AS ("
    " SELECT MIN(tenant) FROM tasks WHERE state = 'queued'"
    " UNION ALL"
    " SELECT (SELECT MIN(tenant) FROM tasks WHERE state = 'queued' AND tenant > q.tenant) FROM q"
    " WHERE q.tenant IS NOT NULL"
    ") SELECT tenant FROM q"
)
_QUEUED_SKIP_LOCKED = _QUEUED.with_for_update(skip_locked=True)
_QUEUED_OF_SKIP_LOCKED = _QUEUED_OF.with_for_update(skip_locked=True)
_GET_WORKER = sa.select(W).where(W.c.id == sa.bindparam("id"))
_LIVE_WORKERS = sa.select(W).where(W.c.state != WorkerState.GONE.value).order_by(W.c.registered_at)
_ALL_WORKERS = sa.select(W).order_by(W.c.registered_at)


@functools.lru_cache(maxsize=256)
def _task_update(states: tuple[str, ...], with_attempts: bool, keys: tuple[str, ...]) -> sa.Update:
    """UPDATE tasks SET <keys> WHERE id = :_id AND state IN <states> [AND attempts = :_attempts], built once per shape."""
    query = T.update().where(T.c.id == sa.bindparam("_id"), T.c.state.in_(states))
    if with_attempts:
        query = query.where(T.c.attempts == sa.bindparam("_attempts"))
    return query.values({k: sa.bindparam(f"v_{k}", type_=T.c[k].type) for k in keys})


class RawTable:
    """A table as the SQLite fast paths read and write it through the driver itself, in the connection's
    transaction: rows decoded as SQLAlchemy decodes them (JSON columns parsed, the rest as stored), values
    bound as it binds them (JSON columns as JSON text, None as NULL).

    The hottest statements (tasks by id, a worker's active tasks, the lease's queue read, a pipeline run's
    read, insert and conditional update) go this way:
    SQLAlchemy's per-statement machinery (execution context, expanding the IN list, result processing) took
    about 40 us a statement where SQLite itself took 13, and a task's path makes about ten of them."""

    def __init__(self, table: sa.Table, *, as_text: Iterable[str] = ()) -> None:
        """`as_text`: JSON columns `rows` leaves as stored, for a reader that decodes them itself."""
        self.name = table.name
        self.columns = tuple(c.name for c in table.c)
        self.json = frozenset(c.name for c in table.c if isinstance(c.type, sa.JSON))
        self._json_at = tuple(i for i, name in enumerate(self.columns) if name in self.json)
        kept_as_text = frozenset(as_text)
        self._decoded_at = tuple(i for i in self._json_at if self.columns[i] not in kept_as_text)
        self.row = collections.namedtuple(f"_{table.name}_row", self.columns)  # type: ignore[misc]
        self.insert = (
            f"INSERT INTO {self.name} ({', '.join(self.columns)}) VALUES ({_marks(len(self.columns))})"
        )
        self._selects: dict[str, str] = {}

    def select(self, where: str, *, blank: str | tuple[str, ...] = ()) -> str:
        """SELECT every column WHERE `where` (our own text, a few shapes per table: each built once); `blank`:
        columns read as NULL, not from the table (those whose values the reader does not need)."""
        blanks = (blank,) if isinstance(blank, str) else blank
        key = f"{','.join(blanks)}|{where}"
        sql = self._selects.get(key)
        if sql is None:
            names = ", ".join("NULL" if c in blanks else c for c in self.columns)
            sql = self._selects[key] = f"SELECT {names} FROM {self.name} WHERE {where}"
        return sql

    def by_ids(self, n: int, *, blank: tuple[str, ...] = ()) -> str:
        """SELECT the rows of `n` ids (`blank`: as `select`)."""
        return self.select(f"id IN ({_marks(n)})", blank=blank)

    def rows(self, conn: sa.Connection, sql: str, params: Sequence[Any]) -> list[Any]:
        out = []
        for values in sqlite_of(conn).execute(sql, params).fetchall():
            row = list(values)
            for i in self._decoded_at:
                if row[i] is not None:
                    row[i] = sqlite_json_value(row[i])
            out.append(self.row(*row))
        return out

    def value(self, name: str, value: Any) -> Any:
        return sqlite_json(value) if name in self.json and value is not None else value

    def insert_rows(self, conn: sa.Connection, rows: Sequence[dict[str, Any]]) -> None:
        sqlite_of(conn).executemany(self.insert, [self._bound(row) for row in rows])

    def _bound(self, row: dict[str, Any]) -> list[Any]:
        values = [row.get(n) for n in self.columns]
        for i in self._json_at:
            if values[i] is not None:
                values[i] = sqlite_json(values[i])
        return values


def sqlite_json(value: Any) -> str | bytes:
    """A JSON value as a SQLite JSON column keeps it exactly. Such a column has NUMERIC affinity: the text of a
    bare number would be stored as a number (`12345678901234567890` as the REAL 1.2345678901234567e19, `1e5` as
    the integer 100000, which JSON then reads back as neither). A bare number goes as a BLOB of its text, which
    no affinity converts; everything else as text, as before."""
    text = json.dumps(value)
    return text.encode() if isinstance(value, int | float) and not isinstance(value, bool) else text


def sqlite_json_value(stored: Any) -> Any:
    """A JSON column's value as `sqlite_json` stored it (text or BLOB); a bare number an older version stored as
    text, which the column's affinity made a number, as that number."""
    return stored if isinstance(stored, int | float) else json.loads(stored)


@functools.lru_cache(maxsize=64)
def _marks(n: int) -> str:
    return ", ".join("?" * n)


def sqlite_of(conn: sa.Connection) -> sqlite3.Connection:
    raw = conn.connection.dbapi_connection
    assert isinstance(raw, sqlite3.Connection)
    return raw


# a task's records, read on SQLite as their JSON text: decoded through `_records_of_text`
TASKS = RawTable(T, as_text=("resources", "routing", "alloc", "gpus"))
AUDIT = RawTable(schema.audit)  # its id: NULL in the insert, so SQLite numbers the row


def _sqlite_tasks(conn: sa.Connection, sql: str, params: Sequence[Any]) -> list[Task]:
    return [_task(r, _records_of_text(r)) for r in TASKS.rows(conn, sql, params)]


# Decoded records by their stored text. A lease reads every task its worker holds (up to `prefetch` + slots
# rows, each lease), and nearly all of them carry the same few resources, allocations and routings: decoding
# each again (JSON, then the record's checks) was most of a row's read. Only immutable records are kept, so a
# read stays a copy: a routing that carries an error (a dict) is decoded afresh.
RECORDS_KEPT = 4096


@functools.lru_cache(maxsize=RECORDS_KEPT)
def _resources_of_text(text: str | bytes) -> tuple[Resources | None, frozenset[str]]:
    return _resources_of(sqlite_json_value(text))


def _resources_of(stored: Mapping[str, Any] | None) -> tuple[Resources | None, frozenset[str]]:
    """A task's own resources as stored (the keys it gave; none, or an empty object: none), and those keys."""
    return parse_resources(stored) if stored else None, frozenset(stored or ())


@functools.lru_cache(maxsize=RECORDS_KEPT)
def _alloc_of_text(text: str | bytes) -> Allocation | None:
    return Allocation.from_dict(sqlite_json_value(text))


@functools.lru_cache(maxsize=RECORDS_KEPT)
def _grant_of_text(text: str | bytes) -> GpuGrant:
    return GpuGrant.from_dict(sqlite_json_value(text))


@functools.lru_cache(maxsize=RECORDS_KEPT)
def _routing_of_text(text: str | bytes) -> Routing | None:
    return Routing.from_dict(sqlite_json_value(text))


def _records_of_text(r: Any) -> _Records:
    resources, keys = _resources_of_text(r.resources) if r.resources else (None, frozenset())
    routing = _routing_of_text(r.routing) if r.routing is not None else None
    if routing is not None and routing.last_error is not None:  # never handed out: its error is a dict
        routing = Routing.from_dict(sqlite_json_value(r.routing))
    alloc = _alloc_of_text(r.alloc) if r.alloc is not None else None
    return _Records(resources, keys, routing, alloc, _grant_of_text(r.gpus) if r.gpus else None)


@functools.lru_cache(maxsize=256)
def _sqlite_task_update(states: tuple[str, ...], with_attempts: bool, keys: tuple[str, ...]) -> str:
    """`_task_update` as SQLite text: UPDATE tasks SET <keys> WHERE id = ? AND state IN <states> [AND
    attempts = ?]."""
    sets = ", ".join(f"{k} = ?" for k in keys)
    listed = ", ".join(f"'{s}'" for s in states)  # TaskState values: our own words, never a client's
    return f"UPDATE tasks SET {sets} WHERE id = ? AND state IN ({listed})" + (
        " AND attempts = ?" if with_attempts else ""
    )


def _sqlite_update_tasks(
    conn: sa.Connection, changes: Sequence[tuple[str, Sequence[TaskState], int | None, dict[str, Any]]]
) -> list[str]:
    raw = sqlite_of(conn)
    done: list[str] = []
    for task_id, states, attempts, values in changes:
        sql = _sqlite_task_update(tuple(s.value for s in states), attempts is not None, tuple(values))
        encoded = _encode(values)
        params = [TASKS.value(k, encoded[k]) for k in values]
        params.append(task_id)
        if attempts is not None:
            params.append(attempts)
        if raw.execute(sql, params).rowcount:
            done.append(task_id)
    return done


def _json_text(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


@functools.lru_cache(maxsize=256)
def _task_update_many(states: tuple[str, ...], with_attempts: bool, keys: tuple[str, ...]) -> str:
    """PostgreSQL's `_task_update` for any number of tasks: UPDATE tasks SET <keys> FROM unnest(<an array
    per column>) AS v WHERE id = v._id AND state IN <states> [AND attempts = v._attempts] RETURNING id.
    One text per shape whatever the number of tasks, so psycopg prepares it once and reuses it."""
    dialect = postgresql.dialect()
    columns = [T.c.id, *([T.c.attempts] if with_attempts else []), *(T.c[k] for k in keys)]
    names = ["_id", *(["_attempts"] if with_attempts else []), *(f'"{k}"' for k in keys)]
    arrays = ", ".join(
        f"CAST(%(p{i})s AS {c.type.compile(dialect=dialect)}[])" for i, c in enumerate(columns)
    )
    allowed = ", ".join(f"'{TaskState(s).value}'" for s in states)  # the states' own names, never input
    sets = ", ".join(f'"{k}" = v."{k}"' for k in keys)
    sql = (f"UPDATE tasks SET {sets} FROM unnest({arrays}) AS v({', '.join(names)}) "
           f"WHERE tasks.id = v._id AND tasks.state IN ({allowed})")  # fmt: skip
    return sql + (" AND tasks.attempts = v._attempts" if with_attempts else "") + " RETURNING tasks.id"


def _sqlite_begin(conn: sa.Connection) -> None:
    """Begin SQLite's transaction where SQLAlchemy begins its own (see `_sqlite_pragmas`), straight to the
    driver: half the CPU of an empty transaction through `exec_driver_sql` (26 against 51 us here), and every
    read and write of the store opens one. A failure is the driver's error, which `is_storage_failure` knows."""
    sqlite_of(conn).execute("BEGIN")


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # let SQLAlchemy, not pysqlite, decide where transactions begin: needed for SAVEPOINTs (group commit)
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=FULL")  # fsync the WAL on every commit: accepted means on disk
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


# ---- row <-> record, one translator each way -----------------------------------------------------

_TASK_ENUMS = {"state": TaskState, "device": Device}


def _encode(values: dict[str, Any]) -> dict[str, Any]:
    """A task update's values as its columns take them: enums as their text, records as JSON objects."""
    return {
        k: (v.value if isinstance(v, TaskState | Device | GpuMode) else _dict_of(v))
        for k, v in values.items()
    }


def _dict_of(value: Any) -> Any:
    """A record (`Routing`, `Allocation`, `GpuGrant`) as its JSON object; anything else as it is."""
    return value.to_dict() if isinstance(value, Routing | Allocation | GpuGrant) else value


def gpus_held(holds: Iterable[tuple[str, Allocation | None]]) -> dict[str, float]:
    """GPUs per tenant from (tenant, allocation) of the tasks holding GPUs: a share counts its fraction, and
    a batch (its tasks share their leader's grant) counts once."""
    out: dict[str, float] = {}
    counted: set[str] = set()
    for tenant, alloc in holds:
        if alloc is not None and alloc.batch is not None:
            if alloc.batch in counted:
                continue
            counted.add(alloc.batch)
        share = alloc.gpu_share if alloc is not None else None
        out[tenant] = out.get(tenant, 0.0) + (1.0 if share is None else share)
    return out


def _dedupe(
    tasks: Sequence[Task], taken: dict[tuple[str, str], Task]
) -> tuple[list[Task], list[dict[str, Any]]]:
    """(what to answer per task, the rows to insert): a taken key answers its task when the request is the
    same, else IdempotencyConflict. Keys repeated within one batch follow the same rule."""
    taken = dict(taken)
    in_batch: dict[tuple[str, str], int] = {}  # keys first met in this batch: where
    out: list[Task] = []
    fresh: list[dict[str, Any]] = []
    for i, t in enumerate(tasks):
        key = t.spec.idempotency_key
        if key:
            first = taken.get((t.tenant, key))
            if first is not None:
                if first.spec != t.spec:
                    raise IdempotencyConflict(key, first.id, index=i, earlier=in_batch.get((t.tenant, key)))
                out.append(first)
                continue
            taken[(t.tenant, key)] = t
            in_batch[(t.tenant, key)] = i
        fresh.append(_task_row(t))
        out.append(t)
    return out, fresh


def _task_row(t: Task) -> dict[str, Any]:
    s = t.spec
    return {
        "id": t.id, "tenant": t.tenant, "capability": s.capability, "state": t.state.value, "input": s.input,
        "output": t.output, "error": t.error, "gpu_mode": s.gpu.value, "gpu_wait_s": s.gpu_wait_s,
        "resources": ({k: v for k, v in s.resources.to_dict().items() if k in s.resource_keys} if s.resources else None),
        "priority": s.priority, "timeout_s": s.timeout_s, "placement_timeout_s": s.placement_timeout_s,
        "max_retries": s.max_retries, "idempotency_key": s.idempotency_key, "labels": s.labels or None,
        "attempts": t.attempts, "worker_id": t.worker_id, "device": t.device.value if t.device else None,
        "gpus": _dict_of(t.gpus), "gpu_model": t.gpu_model, "routing": _dict_of(t.routing), "created_at": t.created_at,
        "queued_at": t.queued_at, "leased_at": t.leased_at, "started_at": t.started_at,
        "finished_at": t.finished_at, "run_s": t.run_s, "cost_usd": t.cost_usd,
        "unservable_since": t.unservable_since, "pipeline_run_id": t.pipeline_run_id, "alloc": _dict_of(t.alloc),
        "isolation": t.isolation, "cold_start_s": t.cold_start_s, "usage": t.usage,
    }  # fmt: skip


class _Records(NamedTuple):
    """A task row's records, decoded."""

    resources: Resources | None
    resource_keys: frozenset[str]
    routing: Routing | None
    alloc: Allocation | None
    gpus: GpuGrant | None

    @classmethod
    def of(cls, r: Any) -> _Records:
        """From a row whose JSON columns are decoded (SQLAlchemy's, PostgreSQL's, the memory store's)."""
        return cls(*_resources_of(r.resources), Routing.from_dict(r.routing), Allocation.from_dict(r.alloc),
                   GpuGrant.from_dict(r.gpus) if r.gpus else None)  # fmt: skip


def _task(r: Any, records: _Records | None = None) -> Task:
    resources, resource_keys, routing, alloc, gpus = records if records is not None else _Records.of(r)
    spec = TaskSpec(
        capability=r.capability, input=r.input, gpu=GpuMode(r.gpu_mode), gpu_wait_s=r.gpu_wait_s,
        resources=resources, resource_keys=resource_keys, priority=r.priority,
        timeout_s=r.timeout_s, placement_timeout_s=r.placement_timeout_s, max_retries=r.max_retries,
        idempotency_key=r.idempotency_key, labels=r.labels or {},
    )  # fmt: skip
    return Task(
        id=r.id, tenant=r.tenant, spec=spec, state=TaskState(r.state), created_at=r.created_at,
        attempts=r.attempts, output=r.output, error=r.error, worker_id=r.worker_id,
        device=Device(r.device) if r.device else None, gpus=gpus, gpu_model=r.gpu_model, routing=routing,
        queued_at=r.queued_at, leased_at=r.leased_at, started_at=r.started_at, finished_at=r.finished_at,
        run_s=r.run_s, cost_usd=r.cost_usd, unservable_since=r.unservable_since, pipeline_run_id=r.pipeline_run_id,
        alloc=alloc, isolation=r.isolation, cold_start_s=r.cold_start_s, usage=r.usage,
    )  # fmt: skip


def _worker_row(w: Worker) -> dict[str, Any]:
    return {
        "name": w.name, "host": w.host, "state": w.state.value, "variants": [v.to_dict() for v in w.variants],
        "cpu": w.cpu, "memory_bytes": w.memory_bytes, "gpus": list(w.gpus), "strategy": w.strategy,
        "registered_at": w.registered_at, "last_heartbeat": w.last_heartbeat, "heartbeat_s": w.heartbeat_s,
        "metrics": w.metrics, "quarantined": w.quarantined,
    }  # fmt: skip


def _variant(v: dict[str, Any]) -> Variant:
    batch = (int(v.get("max_batch_size", 1)), float(v.get("max_batch_wait_ms", 0.0)))
    return Variant(v["capability"], Device(v["device"]), parse_resources(v["resources"]), *batch)


def _worker(r: Any) -> Worker:
    variants = tuple(_variant(v) for v in r.variants)
    return Worker(
        id=r.id, name=r.name, host=r.host, state=WorkerState(r.state), variants=variants, cpu=r.cpu,
        memory_bytes=r.memory_bytes, gpus=tuple(r.gpus), strategy=r.strategy, registered_at=r.registered_at,
        last_heartbeat=r.last_heartbeat, heartbeat_s=r.heartbeat_s, metrics=r.metrics or {},
        quarantined=r.quarantined or {},
    )  # fmt: skip
