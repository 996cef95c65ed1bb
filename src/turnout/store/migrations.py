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


def _task_isolation(conn: sa.Connection) -> None:
    # a database made at version 1 from today's schema has the column already
    if "isolation" not in {c["name"] for c in sa.inspect(conn).get_columns("tasks")}:
        conn.execute(sa.text("ALTER TABLE tasks ADD COLUMN isolation JSON"))


MIGRATIONS: list[Migration] = [
    (1, "initial tables", _initial),
    (2, "lease-order index; JSON null as SQL NULL", _queue_order_and_nulls),
    (6, "tasks.isolation: what confined a task's process", _task_isolation),
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
    return MIGRATIONS[-1][0]
