"""`MemoryStore`: the whole `Store` contract in this process's memory, for tests and demos.

A real implementation, not a mock: the same conditional updates, idempotency keys, tenants, sequence
numbers, audit, runs, profiles and file records as `SqlStore`, checked by the same contract suite
(tests/contract). Nothing survives the process: `turnout up --db memory://` is for trying things out.

How it keeps the contract:

- **Rows, as the database keeps them.** Each table is a dict of rows whose columns are typed as
  `schema.py` types them: JSON columns hold JSON text, float columns floats. Records are decoded from rows
  by the SQL store's own translators, so a read returns fresh values and a Task reads back as SQL would.
- **One lock, and an undo log.** Every method runs under one re-entrant lock, so threads see each other's
  changes whole. Writes go through three primitives that log how to undo them; a transaction (each
  method, or `group()`) that raises is rolled back to where it began, and a `savepoint()` rolls back only
  its own writes. A group holds the lock until it ends: readers see committed state only.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import itertools
import json
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import sqlalchemy as sa

from turnout.models import Allocation, Task, TaskState, Worker, WorkerState
from turnout.pipelines import PipelineRun, RunState
from turnout.profiles import Profile, RunSample, fold
from turnout.store import schema
from turnout.store.base import QueuedKind, TaskChange, queue_pages
from turnout.store.files import FileRecord
from turnout.store.runs import _run, _run_row
from turnout.store.sql import _dedupe, _encode, _task, _worker, _worker_row, gpus_held

_MISSING = object()
_ACTIVE = frozenset({TaskState.LEASED.value, TaskState.RUNNING.value})
_QUEUED = TaskState.QUEUED.value
_NOT_ENDED = frozenset(s.value for s in TaskState if not s.terminal)  # queued, leased, running
Row = dict[str, Any]


@dataclass(frozen=True)
class _Columns:
    """A table's columns as the SQL schema types them: what a value becomes when it is stored."""

    table: str
    names: frozenset[str]
    json: frozenset[str]
    floats: frozenset[str]
    ints: frozenset[str]
    required: frozenset[str]

    @classmethod
    def of(cls, table: sa.Table) -> _Columns:
        cols = list(table.columns)
        return cls(
            table=table.name,
            names=frozenset(c.name for c in cols),
            json=frozenset(c.name for c in cols if isinstance(c.type, sa.JSON)),
            floats=frozenset(c.name for c in cols if isinstance(c.type, sa.Float)),
            ints=frozenset(c.name for c in cols if isinstance(c.type, sa.Integer)),
            required=frozenset(c.name for c in cols if not c.nullable),
        )

    def encode(self, values: Mapping[str, Any], *, whole: bool = False) -> Row:
        """Column values as stored; `whole`: a new row, whose NOT NULL columns must all be there."""
        unknown = set(values) - self.names
        if unknown:
            raise sa.exc.CompileError(f"Unconsumed column names: {', '.join(sorted(unknown))}")
        out: Row = {}
        for name, value in values.items():
            if value is None:
                if name in self.required:
                    raise _integrity(f"NOT NULL constraint failed: {self.table}.{name}")
            elif name in self.json:
                value = json.dumps(value)
            elif name in self.floats:
                value = float(value)
            elif name in self.ints:
                value = int(value)
            elif isinstance(value, enum.Enum):
                value = value.value  # a str enum member is stored as its text, as the drivers bind it
            out[name] = value
        if whole:
            missing = self.required - set(out)
            if missing:
                raise _integrity(f"NOT NULL constraint failed: {self.table}.{sorted(missing)[0]}")
            out.update({n: None for n in self.names - set(out)})
        return out

    def decode(self, row: Row) -> SimpleNamespace:
        return SimpleNamespace(**self.mapping(row))

    def mapping(self, row: Row) -> Row:
        return {k: (json.loads(v) if k in self.json and v is not None else v) for k, v in row.items()}


TASKS = _Columns.of(schema.tasks)
WORKERS = _Columns.of(schema.workers)
CREDENTIALS = _Columns.of(schema.worker_credentials)
TOKENS = _Columns.of(schema.tokens)
AUDIT = _Columns.of(schema.audit)
RUNS = _Columns.of(schema.pipeline_runs)
PROFILES = _Columns.of(schema.profiles)


def _integrity(message: str) -> sa.exc.IntegrityError:
    """The error a SQL store raises for a duplicate key or a missing value, so callers meet one error."""
    return sa.exc.IntegrityError(message, None, Exception(message))


def _restore(table: dict[Any, Any], key: Any, old: Any) -> None:
    if old is _MISSING:
        table.pop(key, None)
    else:
        table[key] = old


def _truncate(items: list[Any], length: int) -> None:
    del items[length:]


class MemoryStore:
    """All state in dicts of rows, under one lock. See the module docstring for how it keeps the contract."""

    dialect = "memory"

    def __init__(self, url: str = "memory://") -> None:
        self.url = url
        self._lock = threading.RLock()
        self._undo: list[Callable[[], None]] = []
        self._depth = 0  # transactions open (the outermost commits: its undo log is dropped)
        self._tasks: dict[str, Row] = {}
        self._keys: dict[tuple[str, str], str] = {}  # (tenant, idempotency_key) -> task id: the unique index
        self._capabilities: dict[str, float] = {}
        self._workers: dict[str, Row] = {}
        self._credentials: dict[str, Row] = {}
        self._tokens: dict[str, Row] = {}
        self._token_hashes: dict[str, str] = {}  # hash -> token id: the unique index
        # task id -> its events as (seq, ts, body), seq 1, 2, ...: event n is at index n - 1
        self._events: dict[str, list[tuple[int, float, str]]] = {}
        self._audit: list[Row] = []
        self._audit_ids = itertools.count(1)  # like a sequence: an id rolled back is not handed out again
        self._runs: dict[str, Row] = {}
        self._profiles: dict[tuple[str, str, str], Row] = {}
        self._files: dict[str, FileRecord] = {}
        self.runs = MemoryRuns(self)
        self.files = MemoryFiles(self)

    # ---- transactions ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """All of the body's writes, or (if it raises) none; nested, a savepoint of the enclosing one."""
        with self._lock:
            mark = len(self._undo)
            self._depth += 1
            try:
                yield
            except BaseException:
                while len(self._undo) > mark:
                    self._undo.pop()()
                raise
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self._undo.clear()

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """One transaction for everything inside; the lock is held till it ends (no reader sees half)."""
        with self._transaction():
            yield

    def savepoint(self, conn: Any) -> contextlib.AbstractContextManager[None]:
        """A mark in the undo log: a body that raises undoes back to it."""
        return self._transaction()

    def intact(self, conn: Any) -> bool:
        return True  # nothing outside this process can end a memory transaction early

    def close(self) -> None:
        """Nothing to release; the state stays readable until the store is dropped."""

    def _put(self, table: dict[Any, Any], key: Any, value: Any) -> None:
        old = table.get(key, _MISSING)
        table[key] = value
        self._undo.append(functools.partial(_restore, table, key, old))

    def _drop(self, table: dict[Any, Any], key: Any) -> None:
        old = table.pop(key)
        self._undo.append(functools.partial(_restore, table, key, old))

    def _extend(self, items: list[Any], more: Iterable[Any]) -> None:
        self._undo.append(functools.partial(_truncate, items, len(items)))
        items.extend(more)

    def _set(self, table: dict[Any, Row], columns: _Columns, key: Any, values: Mapping[str, Any]) -> None:
        self._put(table, key, {**table[key], **columns.encode(values)})

    # ---- tasks -------------------------------------------------------------------------------

    def insert_tasks(self, tasks: Sequence[Task]) -> list[Task]:
        with self._transaction():
            taken = {}
            for t in tasks:
                key = (t.tenant, t.spec.idempotency_key or "")
                if t.spec.idempotency_key and key in self._keys:
                    taken[key] = self._task(self._tasks[self._keys[key]])
            out, fresh = _dedupe(tasks, taken)
            for row in fresh:
                if row["id"] in self._tasks:
                    raise _integrity("UNIQUE constraint failed: tasks.id")
                self._put(self._tasks, row["id"], TASKS.encode(row, whole=True))
                if row["idempotency_key"]:
                    self._put(self._keys, (row["tenant"], row["idempotency_key"]), row["id"])
            return out

    def known_capabilities(self) -> set[str]:
        with self._lock:
            return set(self._capabilities)

    def remember_capabilities(self, names: Iterable[str], now: float) -> None:
        with self._transaction():
            for name in sorted(set(names)):
                if name not in self._capabilities:
                    self._put(self._capabilities, name, float(now))

    def get_task(self, task_id: str) -> Task | None:
        with self._lock:
            row = self._tasks.get(task_id)
            return self._task(row) if row is not None else None

    def get_tasks(self, task_ids: Iterable[str], *, bare: bool = False) -> list[Task]:
        with self._lock:
            rows = [self._tasks[i] for i in dict.fromkeys(task_ids) if i in self._tasks]
            return [self._task({**r, "input": None, "output": None} if bare else r) for r in rows]

    def list_tasks(
        self,
        *,
        tenant: str | None,
        state: str | None = None,
        capability: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> list[Task]:
        with self._lock:
            rows = [r for r in self._tasks.values()
                    if (tenant is None or r["tenant"] == tenant) and (not state or r["state"] == state)
                    and (not capability or r["capability"] == capability) and (not cursor or r["id"] < cursor)]  # fmt: skip
            rows.sort(key=lambda r: r["id"], reverse=True)
            return [self._task(r) for r in rows[:limit]]

    def queued_tasks(
        self,
        capabilities: Iterable[str] | None = None,
        limit: int = 500,
        *,
        widen_to: int | None = None,
        tenant: str | None = None,
    ) -> Iterator[Task]:
        """As `SqlStore.queued_tasks`: `limit` first; read on, the next ones (as they are then), up to `widen_to`,
        in the same growing pages."""
        caps = None if capabilities is None else set(capabilities)

        def page(offset: int, n: int) -> list[Task]:
            with self._lock:
                rows = [r for r in self._tasks.values() if r["state"] == _QUEUED
                        and (caps is None or r["capability"] in caps) and (tenant is None or r["tenant"] == tenant)]  # fmt: skip
                rows.sort(key=lambda r: (-r["priority"], r["created_at"], r["id"]))
                return [self._task(r) for r in rows[offset : offset + n]]

        for offset, rows in queue_pages(limit, widen_to):
            got = page(offset, rows)
            yield from got
            if len(got) < rows:
                return

    def queued_tenants(self) -> list[str]:
        with self._lock:
            return sorted({r["tenant"] for r in self._tasks.values() if r["state"] == _QUEUED})

    def active_by_tenant(self) -> dict[str, int]:
        out: dict[str, int] = {}
        with self._lock:
            for r in self._tasks.values():
                if r["state"] in _ACTIVE:
                    out[r["tenant"]] = out.get(r["tenant"], 0) + 1
        return out

    def gpu_use_by_tenant(self) -> dict[str, float]:
        """As `SqlStore.gpu_use_by_tenant`: a share counts its fraction, a batch's grant once, a cloud task one."""
        with self._lock:
            holds = [(r["tenant"], Allocation.from_dict(json.loads(r["alloc"]) if r["alloc"] is not None else None))
                     for r in self._tasks.values()
                     if r["state"] in _ACTIVE and (r["gpus"] is not None or (r["worker_id"] or "").startswith("cloud:"))]  # fmt: skip
        return gpus_held(holds)

    def queued_kinds(self) -> list[QueuedKind]:
        kinds: dict[tuple[str, str, str, str | None], str] = {}
        with self._lock:
            for r in self._never_retried():
                key = (r["tenant"], r["capability"], r["gpu_mode"], r["resources"])
                kinds[key] = min(kinds.get(key, r["id"]), r["id"])
        return [QueuedKind(t, c, m, res, i) for (t, c, m, res), i in kinds.items()]

    def _never_retried(self, kind: QueuedKind | None = None) -> list[Row]:
        """Queued tasks with no retry history (of one kind, if named)."""
        return [r for r in self._tasks.values() if r["state"] == _QUEUED and r["routing"] is None
                and (kind is None or (r["tenant"], r["capability"], r["gpu_mode"], r["resources"]) == kind[:4])]  # fmt: skip

    def queued_unusual(self, limit: int = 10_000) -> list[Task]:
        with self._lock:
            rows = [r for r in self._tasks.values() if r["state"] == _QUEUED and r["routing"] is not None]
            return [self._task(r) for r in rows[:limit]]

    def mark_servable(self, kind: QueuedKind, servable: bool, now: float, error: dict[str, Any]) -> list[str]:
        """As `SqlStore.mark_servable`: start, clear, or act on the placement-timeout clock of one kind."""
        with self._transaction():
            tasks = self._never_retried(kind)
            if servable:
                for r in tasks:
                    if r["unservable_since"] is not None:
                        self._set(self._tasks, TASKS, r["id"], {"unservable_since": None})
                return []
            for r in tasks:
                if r["unservable_since"] is None:
                    self._set(self._tasks, TASKS, r["id"], {"unservable_since": now})
            due = [r["id"] for r in self._never_retried(kind)
                   if r["unservable_since"] + r["placement_timeout_s"] <= now]  # fmt: skip
            for task_id in due:
                failed = {"state": TaskState.FAILED.value, "error": error, "finished_at": now}
                self._set(self._tasks, TASKS, task_id, failed)
            return due

    def active_tasks(self, worker_ids: Iterable[str] | None = None, *, inputs: bool = True) -> list[Task]:
        only = None if worker_ids is None else set(worker_ids)
        with self._lock:
            return [self._task(r if inputs else {**r, "input": None}) for r in self._tasks.values()
                    if r["state"] in _ACTIVE and (only is None or r["worker_id"] in only)]  # fmt: skip

    def queue_depths(self, tenant: str | None = None) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        with self._lock:
            for r in self._tasks.values():
                if (r["state"] == _QUEUED or r["state"] in _ACTIVE) and tenant in (None, r["tenant"]):
                    states = out.setdefault(r["capability"], {})
                    states[r["state"]] = states.get(r["state"], 0) + 1
        return out

    def task_stats(
        self,
        states: Iterable[TaskState] | None = None,
        run_s_buckets: Sequence[float] = (),
        *,
        tenant: str | None = None,
    ) -> list[dict[str, Any]]:
        """As `SqlStore.task_stats`: counts, run times, cost and run-time buckets per (capability, state,
        device, gpu_mode)."""
        wanted = None if states is None else {s.value for s in states}
        groups: dict[tuple[Any, ...], dict[str, Any]] = {}
        with self._lock:
            for r in self._tasks.values():
                if tenant not in (None, r["tenant"]) or (wanted is not None and r["state"] not in wanted):
                    continue
                key = (r["capability"], r["state"], r["device"], r["gpu_mode"])
                g = groups.get(key)
                if g is None:
                    g = groups[key] = {"capability": key[0], "state": key[1], "device": key[2], "gpu_mode": key[3],
                                       "count": 0, "run_s_count": 0, "run_s_sum": 0.0, "cost_usd": 0.0,
                                       "run_s_buckets": [0] * len(run_s_buckets)}  # fmt: skip
                g["count"] += 1
                if r["run_s"] is not None:
                    g["run_s_count"] += 1
                    g["run_s_sum"] += r["run_s"]
                    counts = zip(g["run_s_buckets"], run_s_buckets, strict=True)
                    g["run_s_buckets"] = [n + (r["run_s"] <= b) for n, b in counts]
                if r["cost_usd"] is not None:
                    g["cost_usd"] += r["cost_usd"]
        return list(groups.values())

    def update_tasks(self, changes: Sequence[TaskChange]) -> list[str]:
        """Conditional changes, in order, in one transaction: each applies only while the task is in one of
        its states (and at its attempt, if given). Returns the ids that changed."""
        done: list[str] = []
        with self._transaction():
            for task_id, states, attempts, values in changes:
                row = self._tasks.get(task_id)
                if row is None or row["state"] not in {s.value for s in states}:
                    continue
                if attempts is not None and row["attempts"] != attempts:
                    continue
                encoded = _encode(values)
                if "id" in encoded:
                    raise ValueError("a task's id never changes")  # the rows are filed under it
                if encoded.keys() & {"tenant", "idempotency_key"}:
                    self._rekey(row, encoded)
                self._set(self._tasks, TASKS, task_id, encoded)
                done.append(task_id)
        return done

    def _rekey(self, row: Row, values: Row) -> None:
        """Keep the unique (tenant, idempotency_key) index true when a change touches its columns."""
        new = {**row, **values}
        key = (new["tenant"], new["idempotency_key"])
        if new["idempotency_key"] and self._keys.get(key, row["id"]) != row["id"]:
            raise _integrity("UNIQUE constraint failed: tasks.tenant, tasks.idempotency_key")
        if row["idempotency_key"]:
            self._drop(self._keys, (row["tenant"], row["idempotency_key"]))
        if new["idempotency_key"]:
            self._put(self._keys, key, row["id"])

    def _task(self, row: Row) -> Task:
        return _task(TASKS.decode(row))

    # ---- workers -----------------------------------------------------------------------------

    def upsert_worker(self, worker: Worker) -> None:
        with self._transaction():
            row = WORKERS.encode({"id": worker.id, **_worker_row(worker)}, whole=True)
            self._put(self._workers, worker.id, row)

    def get_worker(self, worker_id: str) -> Worker | None:
        with self._lock:
            row = self._workers.get(worker_id)
            return _worker(WORKERS.decode(row)) if row is not None else None

    def list_workers(self, *, include_gone: bool = False) -> list[Worker]:
        with self._lock:
            rows = [r for r in self._workers.values() if include_gone or r["state"] != WorkerState.GONE.value]
            rows.sort(key=lambda r: r["registered_at"])
            return [_worker(WORKERS.decode(r)) for r in rows]

    def update_worker(
        self, worker_id: str, states: Sequence[WorkerState] | None = None, **values: Any
    ) -> bool:
        with self._transaction():
            row = self._workers.get(worker_id)
            if row is None or (states is not None and row["state"] not in {s.value for s in states}):
                return False
            values = {k: (v.value if isinstance(v, WorkerState) else v) for k, v in values.items()}
            self._set(self._workers, WORKERS, worker_id, values)
            return True

    def insert_worker_credential(
        self, worker_id: str, secret_hash: str, token_id: str, tenant: str, created_at: float
    ) -> None:
        with self._transaction():
            if worker_id in self._credentials:
                raise _integrity("UNIQUE constraint failed: worker_credentials.worker_id")
            values = {"worker_id": worker_id, "secret_hash": secret_hash, "token_id": token_id,
                      "tenant": tenant, "created_at": created_at}  # fmt: skip
            self._put(self._credentials, worker_id, CREDENTIALS.encode(values, whole=True))

    def get_worker_credential(self, worker_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._credentials.get(worker_id)
            return _ordered(schema.worker_credentials, row) if row is not None else None

    def worker_tenants(self) -> dict[str, str]:
        with self._lock:
            return {w: r["tenant"] for w, r in self._credentials.items()}

    # ---- tokens ------------------------------------------------------------------------------

    def insert_token(self, token_id: str, token_hash: str, role: str, tenant: str, created_at: float) -> None:
        with self._transaction():
            if token_id in self._tokens or token_hash in self._token_hashes:
                raise _integrity("UNIQUE constraint failed: tokens")
            values = {"id": token_id, "hash": token_hash, "role": role, "tenant": tenant,
                      "created_at": created_at}  # fmt: skip
            self._put(self._tokens, token_id, TOKENS.encode(values, whole=True))
            self._put(self._token_hashes, token_hash, token_id)

    def find_token(self, token_hash: str) -> dict[str, Any] | None:
        with self._lock:
            token_id = self._token_hashes.get(token_hash)
            return _ordered(schema.tokens, self._tokens[token_id]) if token_id is not None else None

    def get_token(self, token_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._tokens.get(token_id)
            return _ordered(schema.tokens, row) if row is not None else None

    def revoke_token(self, token_id: str, now: float) -> bool:
        with self._transaction():
            row = self._tokens.get(token_id)
            if row is None or row["revoked_at"] is not None:
                return False
            self._set(self._tokens, TOKENS, token_id, {"revoked_at": now})
            return True

    def list_tokens(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """Tokens (of one tenant, or all), oldest first, without their hashes."""
        with self._lock:
            rows = sorted((r for r in self._tokens.values() if tenant is None or r["tenant"] == tenant),
                          key=lambda r: (r["created_at"], r["id"]))  # fmt: skip
            return [{k: r[k] for k in ("id", "role", "tenant", "created_at", "revoked_at")} for r in rows]

    def count_tokens(self) -> int:
        with self._lock:
            return len(self._tokens)

    # ---- events ------------------------------------------------------------------------------

    def append_events(self, items: Sequence[tuple[str, float, dict[str, Any]]]) -> dict[str, int]:
        """Append (task id, ts, body) in order; seq is per task, 1, 2, ... Returns the last seq per task."""
        last: dict[str, int] = {}
        with self._transaction():
            for task_id, ts, body in items:
                events = self._events.get(task_id)
                if events is None:
                    events = []
                    self._put(self._events, task_id, events)
                seq = last.get(task_id, len(events)) + 1
                self._extend(events, [(seq, float(ts), json.dumps(body))])
                last[task_id] = seq
        return last

    def last_event_seq(self, task_id: str) -> int:
        with self._lock:
            return len(self._events.get(task_id, ()))

    def read_events(
        self, task_id: str, after: int = 0, limit: int = 1000
    ) -> list[tuple[int, float, dict[str, Any]]]:
        start = max(after, 0)
        with self._lock:
            events = self._events.get(task_id, [])[start : start + max(limit, 0)]
        return [(seq, ts, json.loads(body)) for seq, ts, body in events]

    # ---- audit -------------------------------------------------------------------------------

    def append_audit(self, records: Sequence[tuple[float, str, str | None, dict[str, Any]]]) -> None:
        if not records:
            return
        with self._transaction():
            rows = [AUDIT.encode({"id": next(self._audit_ids), "ts": ts, "kind": kind, "tenant": tenant, "body": body},
                                 whole=True) for ts, kind, tenant, body in records]  # fmt: skip
            self._extend(self._audit, rows)

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
        with self._lock:
            rows = [r for r in self._audit if (since is None or r["ts"] >= since)
                    and (tenant is None or r["tenant"] == tenant) and (kind is None or r["kind"] == kind)
                    and (after_id is None or r["id"] > after_id)]  # fmt: skip
        return [AUDIT.mapping(r) for r in rows[:limit]]


def _ordered(table: sa.Table, row: Row) -> dict[str, Any]:
    """A row as `dict(row._mapping)` gives it on SQL: every column, in the table's order."""
    return {c.name: row[c.name] for c in table.columns}


class MemoryRuns:
    """Pipeline runs and routing profiles: `RunStore` of the SQL stores, in the memory store's transactions."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    def insert_run(self, run: PipelineRun) -> None:
        s = self.store
        with s._transaction():
            if run.id in s._runs:
                raise _integrity("UNIQUE constraint failed: pipeline_runs.id")
            s._put(s._runs, run.id, RUNS.encode(_run_row(run), whole=True))

    def get_run(self, run_id: str) -> PipelineRun | None:
        with self.store._lock:
            row = self.store._runs.get(run_id)
            return _run(RUNS.decode(row)) if row is not None else None

    def get_runs(self, run_ids: Sequence[str]) -> list[PipelineRun]:
        runs = self.store._runs
        with self.store._lock:
            return [_run(RUNS.decode(runs[i])) for i in dict.fromkeys(run_ids) if i in runs]

    def list_runs(
        self, *, tenant: str | None, state: str | None = None, limit: int = 50, cursor: str | None = None
    ) -> list[PipelineRun]:
        with self.store._lock:
            rows = [r for r in self.store._runs.values() if (tenant is None or r["tenant"] == tenant)
                    and (not state or r["state"] == state) and (not cursor or r["id"] < cursor)]  # fmt: skip
            rows.sort(key=lambda r: r["id"], reverse=True)
            return [_run(RUNS.decode(r)) for r in rows[:limit]]

    def runs_to_move_on(self, limit: int = 1000) -> list[PipelineRun]:
        """As the SQL store's: running runs with no stage queued or in flight."""
        with self.store._lock:
            waiting = {t["pipeline_run_id"] for t in self.store._tasks.values() if t["state"] in _NOT_ENDED}
            rows = sorted((r for r in self.store._runs.values()
                           if r["state"] == RunState.RUNNING.value and r["id"] not in waiting),
                          key=lambda r: r["id"])  # fmt: skip
            return [_run(RUNS.decode(r)) for r in rows[:limit]]

    def update_run(self, run_id: str, expect_tasks: int, values: dict[str, Any]) -> bool:
        """Change a running run whose task list still has `expect_tasks` entries."""
        s = self.store
        values = {k: (v.value if isinstance(v, RunState) else v) for k, v in values.items()}
        if "task_ids" in values:
            values["task_ids"] = list(values["task_ids"])
        with s._transaction():
            row = s._runs.get(run_id)
            if row is None or len(json.loads(row["task_ids"]) or []) != expect_tasks:
                return False
            if row["state"] != RunState.RUNNING.value:
                return False
            s._set(s._runs, RUNS, run_id, values)
            return True

    def cost_by_tenant(self) -> list[tuple[str, str, float]]:
        """(capability, tenant, summed cost_usd) over every priced task."""
        out: dict[tuple[str, str], float] = {}
        with self.store._lock:
            for r in self.store._tasks.values():
                if r["cost_usd"] is not None:
                    key = (r["capability"], r["tenant"])
                    out[key] = out.get(key, 0.0) + r["cost_usd"]
        return [(c, t, v) for (c, t), v in out.items()]

    def run_counts(self) -> list[tuple[str, str, int]]:
        """(pipeline, state, runs)."""
        out: dict[tuple[str, str], int] = {}
        with self.store._lock:
            for r in self.store._runs.values():
                out[(r["pipeline"], r["state"])] = out.get((r["pipeline"], r["state"]), 0) + 1
        return [(p, s, n) for (p, s), n in out.items()]

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
    ) -> None:
        """Fold one finished task into its (capability, device, GPU model) profile, as `RunStore` does."""
        sample = RunSample(run_s, cold_start_s, peak_gpu_memory_bytes, peak_rss_bytes)
        self.record_profiles(capability, device, gpu_model, [sample], now)

    def record_profiles(
        self, capability: str, device: str, gpu_model: str | None, samples: Sequence[RunSample], now: float
    ) -> bool:
        """Fold finished tasks, oldest first, into their profile with `RunStore`'s arithmetic (`_fold`)."""
        if not samples:
            return True
        s = self.store
        key = (capability, device, gpu_model or "")
        with s._transaction():
            row = s._profiles.get(key)
            folded = fold(None if row is None else SimpleNamespace(**row), samples)
            if row is None:
                values = {"capability": capability, "device": device, "gpu_model": gpu_model or "", **folded,
                          "updated_at": now}  # fmt: skip
                s._put(s._profiles, key, PROFILES.encode(values, whole=True))
            else:
                s._set(s._profiles, PROFILES, key, {**folded, "updated_at": now})
        return True

    def profiles(self) -> list[Profile]:
        with self.store._lock:
            return [Profile(r["capability"], r["device"], r["gpu_model"] or None, r["samples"], r["run_s"],
                            r["cold_start_s"], r["peak_gpu_memory_bytes"], r["peak_rss_bytes"])
                    for r in self.store._profiles.values()]  # fmt: skip


class MemoryFiles:
    """File records (`FileRecords` of the SQL stores); the bytes stay in the storage directory."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    def insert(self, record: FileRecord) -> None:
        s = self.store
        with s._transaction():
            if record.id in s._files:
                raise _integrity("UNIQUE constraint failed: files.id")
            s._put(s._files, record.id, record)

    def get(self, file_id: str) -> FileRecord | None:
        with self.store._lock:
            return self.store._files.get(file_id)

    def owned(self, file_ids: set[str], tenant: str, now: float) -> set[str]:
        with self.store._lock:
            return {i for i in file_ids if (r := self.store._files.get(i)) is not None and r.tenant == tenant
                    and (r.expires_at is None or r.expires_at > now)}  # fmt: skip

    def delete(self, file_id: str) -> bool:
        s = self.store
        with s._transaction():
            if file_id not in s._files:
                return False
            s._drop(s._files, file_id)
            return True

    def expire(self, now: float, limit: int = 1000) -> list[str]:
        """Delete the records of files whose retention ended; returns their ids."""
        s = self.store
        with s._transaction():
            due = [r.id for r in s._files.values() if r.expires_at is not None and r.expires_at <= now]
            ids = due[:limit]
            for file_id in ids:
                s._drop(s._files, file_id)
            return ids
