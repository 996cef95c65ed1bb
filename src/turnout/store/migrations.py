"""Versioned schema migrations: an ordered list, each applied once, recorded in `schema_migrations`.

A new column or index is a new entry at the end; entries are never edited once released.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import sqlalchemy as sa

from turnout.store import schema

Migration = tuple[int, str, Callable[[sa.Connection], None]]


def _initial(conn: sa.Connection) -> None:
    tables = [t for t in schema.metadata.sorted_tables if t.name != "schema_migrations"]
    schema.metadata.create_all(conn, tables=tables)


def _queue_order_and_nulls(conn: sa.Connection) -> None:
    schema.queue_order.create(conn, checkfirst=True)
    nullable_json = {"tasks": ("input", "output", "error", "resources", "labels", "gpus", "alloc", "routing"),
                     "workers": ("metrics", "quarantined")}  # fmt: skip
    for table, columns in nullable_json.items():
        for col in columns:  # JSON 'null' written before none_as_null becomes SQL NULL
            conn.execute(sa.text(f"UPDATE {table} SET {col} = NULL WHERE CAST({col} AS TEXT) = 'null'"))


def _known_capabilities(conn: sa.Connection) -> None:
    schema.capabilities.create(conn, checkfirst=True)
    known = {row[0] for row in conn.execute(sa.select(schema.capabilities.c.name))}
    names: set[str] = set()
    for (variants,) in conn.execute(sa.select(schema.workers.c.variants)):
        names |= {v["capability"] for v in variants or () if isinstance(v, dict) and "capability" in v}
    now = time.time()
    rows = [{"name": n, "first_seen_at": now} for n in sorted(names - known)]
    if rows:
        conn.execute(schema.capabilities.insert(), rows)


def _task_isolation(conn: sa.Connection) -> None:
    if "isolation" in {c["name"] for c in sa.inspect(conn).get_columns("tasks")}:
        return  # a database made by `_initial` from today's schema has it already
    kind = schema.tasks.c.isolation.type.compile(dialect=conn.dialect)
    conn.execute(sa.text(f"ALTER TABLE tasks ADD COLUMN isolation {kind}"))


def _tenancy(conn: sa.Connection) -> None:
    schema.worker_credentials.create(conn, checkfirst=True)
    schema.queue_by_tenant.create(conn, checkfirst=True)
    schema.audit_by_tenant.create(conn, checkfirst=True)
    # Before tenancy, an admin of tenant "default" saw and managed every tenant: it becomes what it was, the
    # operator (tenant "*"), so an upgrade takes no power from the token in admin.token and gives none to others.
    conn.execute(sa.text("UPDATE tokens SET tenant = '*' WHERE role = 'admin' AND tenant = 'default'"))


def _pipelines_costs_profiles(conn: sa.Connection) -> None:
    have = {c["name"] for c in sa.inspect(conn).get_columns("tasks")}
    for col in ("cold_start_s", "usage"):
        if col not in have:  # a database made by `_initial` from today's schema has them already
            kind = schema.tasks.c[col].type.compile(dialect=conn.dialect)
            conn.execute(sa.text(f"ALTER TABLE tasks ADD COLUMN {col} {kind}"))
    schema.pipeline_runs.create(conn, checkfirst=True)
    schema.profiles.create(conn, checkfirst=True)
    schema.pipeline_run_index.create(conn, checkfirst=True)


def _sweeps(conn: sa.Connection) -> None:
    schema.sweeps.create(conn, checkfirst=True)


def _files(conn: sa.Connection) -> None:
    schema.files.create(conn, checkfirst=True)


def _inputs_last(conn: sa.Connection) -> None:
    """On SQLite, the tasks table rebuilt in today's column order: error, output and input last (schema.py
    says why). A table `_initial` made from today's schema has that order already. PostgreSQL keeps a large
    value out of its row (TOAST), so its column order costs no read there: its table stays as it is."""
    if conn.dialect.name != "sqlite":
        return
    want = [c.name for c in schema.tasks.c]
    if [c["name"] for c in sa.inspect(conn).get_columns("tasks")] == want:
        return
    conn.execute(sa.text("ALTER TABLE tasks RENAME TO tasks_before_10"))
    old_indexes = conn.execute(sa.text(  # index names are the database's, not the table's: free them first
        "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'tasks_before_10' AND sql IS NOT NULL"
    )).scalars().all()  # fmt: skip
    for name in old_indexes:
        conn.execute(sa.text(f'DROP INDEX "{name}"'))
    schema.tasks.create(conn)  # with every index of today's schema
    columns = ", ".join(want)  # migrations 1-9 made every one of them
    conn.execute(sa.text(f"INSERT INTO tasks ({columns}) SELECT {columns} FROM tasks_before_10"))
    conn.execute(sa.text("DROP TABLE tasks_before_10"))


MIGRATIONS: list[Migration] = [
    (1, "initial tables", _initial),
    (2, "lease-order index; JSON null as SQL NULL", _queue_order_and_nulls),
    (3, "tasks.isolation: what held a task's processes", _task_isolation),
    (4, "capabilities ever registered, from the workers so far", _known_capabilities),
    (5, "tenancy: worker credentials, per-tenant queue and audit indexes, the operator token", _tenancy),
    # The sandbox work (issue 10) first numbered the same column 6: here it adds the column only where it is
    # missing, so it is a no-op after 3, and a database that recorded 6 first finds 3 a no-op in turn.
    (6, "tasks.isolation under its first number: a no-op where migration 3 ran", _task_isolation),
    # Issue 9's branch numbered this 101, apart from the others' next entries; nothing released used 101. It adds
    # only what is missing, so a database that recorded 101 on that branch finds 7 a no-op.
    (7, "pipeline runs, tasks.cold_start_s and usage, profiles", _pipelines_costs_profiles),
    # Issue 11 first numbered these 5 and 6; both are create(checkfirst=True), so they are
    # no-ops where the tables exist already.
    (8, "sweeps: which replica ran each periodic sweep last", _sweeps),
    (9, "files: task inputs and outputs", _files),
    (10, "tasks: error, output and input stored last (SQLite)", _inputs_last),
]


def migrate(engine: sa.Engine) -> int:
    """Apply what is missing; returns the schema version now in force. Safe to run from many controllers."""
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(727274)"))  # one migrator at a time
        schema.schema_migrations.create(conn, checkfirst=True)
        done = {row[0] for row in conn.execute(sa.select(schema.schema_migrations.c.version))}
        for version, name, apply in MIGRATIONS:
            if version in done:
                continue
            apply(conn)
            conn.execute(
                schema.schema_migrations.insert().values(version=version, name=name, applied_at=time.time())
            )
    return max(version for version, _, _ in MIGRATIONS)
