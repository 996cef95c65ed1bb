"""One suite over every store backend: SQLite, PostgreSQL and memory (the `store` fixture, conftest.py)."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tests.contract.conftest import PG_URL, _fresh_pg_database  # noqa: F401 (tests/pg.py reads them here)
from turnout.models import Device, GpuMode, Task, TaskSpec, TaskState, Variant, Worker, WorkerState
from turnout.resources import parse_resources
from turnout.store import MemoryStore, SqlStore, Store, open_store


def _task(i: int, key: str | None = None, tenant: str = "default", priority: int = 0) -> Task:
    spec = TaskSpec(capability="cap", input={"n": i}, gpu=GpuMode.PREFER, idempotency_key=key, priority=priority,
                    resources=parse_resources({"memory": "1Gi"}), resource_keys=frozenset({"memory"}))  # fmt: skip
    now = time.time() + i * 1e-3
    return Task(
        id=f"t_{i:06d}", tenant=tenant, spec=spec, state=TaskState.QUEUED, created_at=now, queued_at=now
    )


def test_inserted_tasks_read_back_identically(store: Store) -> None:
    t = _task(1)
    store.insert_tasks([t])
    assert store.get_task(t.id) == t


def test_idempotency_key_yields_the_stored_task_per_tenant(store: Store) -> None:
    first = store.insert_tasks([_task(1, key="k")])[0]
    # the same request again (another one under the key is a conflict: test_idempotency.py)
    same_request = replace(_task(2, key="k"), spec=first.spec)
    again = store.insert_tasks([same_request, _task(3, key="k", tenant="acme")])
    assert again[0].id == first.id
    assert again[1].id == "t_000003"


def test_conditional_updates_apply_once(store: Store) -> None:
    store.insert_tasks([_task(1)])
    lease = ("t_000001", (TaskState.QUEUED,), 0, {"state": TaskState.LEASED, "attempts": 1, "worker_id": "w"})
    assert store.update_tasks([lease]) == ["t_000001"]
    assert store.update_tasks([lease]) == []  # the second claim loses
    done = (
        "t_000001",
        (TaskState.LEASED, TaskState.RUNNING),
        1,
        {"state": TaskState.SUCCEEDED, "output": {"ok": 1}},
    )
    stale = ("t_000001", (TaskState.LEASED, TaskState.RUNNING), 0, {"state": TaskState.FAILED})
    assert store.update_tasks([stale]) == []  # a report from an older attempt is refused
    assert store.update_tasks([done]) == ["t_000001"]
    assert store.get_task("t_000001").output == {"ok": 1}


def test_queue_order_is_priority_then_age(store: Store) -> None:
    store.insert_tasks([_task(1), _task(2, priority=5), _task(3)])
    assert [t.id for t in store.queued_tasks(["cap"])] == ["t_000002", "t_000001", "t_000003"]


def test_listing_pages_newest_first(store: Store) -> None:
    store.insert_tasks([_task(i) for i in range(5)])
    page = store.list_tasks(tenant="default", limit=2)
    assert [t.id for t in page] == ["t_000004", "t_000003"]
    assert [t.id for t in store.list_tasks(tenant="default", limit=10, cursor=page[-1].id)] == [
        "t_000002",
        "t_000001",
        "t_000000",
    ]


def test_workers_round_trip(store: Store) -> None:
    w = Worker(id="w_1", name="n", host="h", state=WorkerState.HEALTHY,
               variants=(Variant("cap", Device.GPU, parse_resources({"gpu": 1})),), cpu=2.0, memory_bytes=2**30,
               gpus=({"index": 0, "uuid": "GPU-x", "name": "X", "memory_total_bytes": 2**30},), strategy="pack",
               registered_at=1.0, last_heartbeat=2.0, heartbeat_s=5.0)  # fmt: skip
    store.upsert_worker(w)
    assert store.get_worker("w_1") == w
    assert store.update_worker("w_1", (WorkerState.HEALTHY,), state="unhealthy")
    assert not store.update_worker("w_1", (WorkerState.HEALTHY,), state="draining")


def test_events_get_per_task_sequence_numbers(store: Store) -> None:
    store.append_events(
        [("a", 1.0, {"event": "log"}), ("b", 1.0, {"event": "log"}), ("a", 2.0, {"event": "text"})]
    )
    store.append_events([("a", 3.0, {"event": "finish"})])
    assert [s for s, _, _ in store.read_events("a")] == [1, 2, 3]
    assert [b["event"] for _, _, b in store.read_events("a", after=1)] == ["text", "finish"]
    assert store.last_event_seq("b") == 1


def test_migrations_are_recorded_and_idempotent(sql_store: SqlStore) -> None:
    again = SqlStore(sql_store.url)
    assert again.schema_version == sql_store.schema_version >= 1
    again.close()


def _sqlite_layout(path: Path) -> tuple[list[str], set[tuple[str, str]]]:
    """The tasks table's columns in stored order, and its indexes as (name, SQL)."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        columns = [row[1] for row in db.execute("PRAGMA table_info(tasks)")]
        indexes = set(
            db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'tasks'")
        )
    return columns, indexes


def as_before_migration_10(path: Path) -> list[str]:
    """Turn the SQLite database at `path` into what migrations 1-9 left: the tasks table with input, output
    and error stored after `state`, one of its index names taken, migration 10 not recorded. Its column order."""
    today = _sqlite_layout(path)[0]
    moved = ("id", "tenant", "capability", "state", "input", "output", "error")
    old_order = [*moved, *(c for c in today if c not in moved)]
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
        db.execute("BEGIN")  # one transaction, DDL included
        db.execute("ALTER TABLE tasks RENAME TO tasks_today")
        for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'tasks_today' "
                                  "AND sql IS NOT NULL").fetchall():  # fmt: skip
            db.execute(f'DROP INDEX "{name}"')
        db.execute(f"CREATE TABLE tasks AS SELECT {', '.join(old_order)} FROM tasks_today")
        db.execute(
            "CREATE INDEX ix_tasks_worker ON tasks (worker_id, state)"
        )  # a name the new table needs too
        db.execute("DROP TABLE tasks_today")
        db.execute("DELETE FROM schema_migrations WHERE version = 10")
        db.execute("COMMIT")
    return old_order


def test_migration_10_rebuilds_an_older_sqlite_tasks_table_inputs_last_keeping_rows_and_indexes(
    tmp_path: Path,
) -> None:
    """A database from before migration 10 (input, output and error stored after `state`, as migrations 1-9
    left them) is rebuilt in today's order on open: every row as it was, every index as a fresh database has
    it (and unique ones still refuse a duplicate)."""
    path = tmp_path / "old.db"
    store = SqlStore(f"sqlite:///{path}")
    big = "x" * 100_000  # on overflow pages
    keyed = _task(1, key="k1")
    tasks = [replace(keyed, spec=replace(keyed.spec, input={"text": big, "n": [1, 2.5, None]})),
             replace(_task(2), state=TaskState.FAILED, output={"deep": {"é": 1}}, error={"type": "oom"}),
             _task(3)]  # fmt: skip
    store.insert_tasks(tasks)
    store.close()
    today, fresh_indexes = _sqlite_layout(path)
    assert today[-3:] == ["error", "output", "input"]
    old_order = as_before_migration_10(path)
    assert _sqlite_layout(path)[0] == old_order

    again = SqlStore(f"sqlite:///{path}")
    try:
        assert _sqlite_layout(path) == (today, fresh_indexes)
        assert again.get_tasks([t.id for t in tasks]) == tasks
        assert again.insert_tasks([replace(_task(4, key="k1"), spec=tasks[0].spec)]) == [
            tasks[0]
        ]  # deduplicated
        assert again.schema_version >= 10
    finally:
        again.close()
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert not db.execute("SELECT name FROM sqlite_master WHERE name = 'tasks_before_10'").fetchall()


def test_open_store_picks_the_backend_by_url_and_names_the_field_of_a_bad_one(tmp_path: Path) -> None:
    from turnout.errors import InvalidInput

    assert isinstance(open_store("memory://"), MemoryStore)
    sqlite = open_store(f"sqlite:///{tmp_path / 'x.db'}")
    assert isinstance(sqlite, SqlStore) and sqlite.dialect == "sqlite"
    sqlite.close()
    with pytest.raises(InvalidInput) as caught:
        open_store("mysql://somewhere/db")
    assert caught.value.field == "db" and "memory://" in str(caught.value)
