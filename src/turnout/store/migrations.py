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


def _tenancy(conn: sa.Connection) -> None:
    schema.worker_credentials.create(conn, checkfirst=True)
    schema.queue_by_tenant.create(conn, checkfirst=True)
    schema.audit_by_tenant.create(conn, checkfirst=True)
    # Before tenancy, an admin of tenant "default" saw and managed every tenant: it becomes what it was, the
    # operator (tenant "*"), so an upgrade takes no power from the token in admin.token and gives none to others.
    conn.execute(sa.text("UPDATE tokens SET tenant = '*' WHERE role = 'admin' AND tenant = 'default'"))


MIGRATIONS: list[Migration] = [
    (1, "initial tables", _initial),
    (2, "lease-order index; JSON null as SQL NULL", _queue_order_and_nulls),
    # 3 and 4 are taken on main (issue 10 access control starts at 5, so a merge appends without renumbering)
    (5, "tenancy: worker credentials, per-tenant queue and audit indexes, the operator token", _tenancy),
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
