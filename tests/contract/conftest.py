"""The store fixtures: every test in tests/contract that takes `store` runs over SQLite (a real file),
PostgreSQL (a fresh database per test) and the in-memory store that ships in the package; `sql_store` is
for what only the SQL stores have (migrations).

PostgreSQL is `TURNOUT_TEST_POSTGRES` (default postgresql://postgres@127.0.0.1:5432/test); where none
answers, its cases are skipped with the reason, except under CI=true, where a missing PostgreSQL fails.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from turnout.store import SqlStore, Store, open_store, schema
from turnout.store import sql as sql_backend
from turnout.store.sql import normalise_url

PG_URL = os.environ.get("TURNOUT_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
SQL_BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


def _fresh_pg_database() -> tuple[str, str]:
    """Create an empty database next to the configured one; returns (its url, admin url)."""
    admin = sa.create_engine(normalise_url(PG_URL), isolation_level="AUTOCOMMIT")
    name = f"turnout_test_{secrets.token_hex(4)}"
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    except sa.exc.OperationalError as exc:
        admin.dispose()
        if os.environ.get("CI") == "true":
            pytest.fail(f"PostgreSQL at {PG_URL} does not answer under CI=true: {exc}")
        pytest.skip(f"no PostgreSQL at {PG_URL}: {exc.orig}")
    admin.dispose()
    return PG_URL.rsplit("/", 1)[0] + f"/{name}", name


def _drop_pg_database(name: str) -> None:
    admin = sa.create_engine(normalise_url(PG_URL), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


@contextlib.contextmanager
def _sql_store(backend: str, tmp_path: Path) -> Iterator[SqlStore]:
    """A SQL store on a database of its own: a new SQLite file, or a new PostgreSQL database."""
    if backend == "sqlite":
        s = sql_backend.open_store(f"sqlite:///{tmp_path / 'store.db'}")
        try:
            yield s
        finally:
            s.close()
        return
    url, name = _fresh_pg_database()
    s = sql_backend.open_store(url)
    try:
        yield s
    finally:
        s.close()
        _drop_pg_database(name)


@pytest.fixture(scope="session")
def pg_contract_url() -> Iterator[str]:
    """One PostgreSQL database for the contract tests, emptied before each (creating and migrating a database
    per test costs about a second each, most of the suite's PostgreSQL time)."""
    url, name = _fresh_pg_database()
    try:
        yield url
    finally:
        _drop_pg_database(name)


def _emptied(store: SqlStore) -> SqlStore:
    """Every table but the migrations' emptied, and ids (the audit's) counting from 1 again."""
    tables = ", ".join(f'"{t.name}"' for t in schema.metadata.sorted_tables if t.name != "schema_migrations")
    with store.engine.begin() as conn:
        conn.exec_driver_sql(f"TRUNCATE {tables} RESTART IDENTITY CASCADE")
    return store


@pytest.fixture(params=[*SQL_BACKENDS, "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """An empty store of each backend: a new SQLite file, the contract's PostgreSQL database emptied, or a
    new memory store."""
    if request.param == "memory":
        yield open_store("memory://")
        return
    if request.param == "sqlite":
        with _sql_store("sqlite", tmp_path) as s:
            yield s
        return
    pg = _emptied(sql_backend.open_store(request.getfixturevalue("pg_contract_url")))
    try:
        yield pg
    finally:
        pg.close()


@pytest.fixture(params=SQL_BACKENDS)
def sql_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SqlStore]:
    """A SQL store on a database of its own (SQLite, PostgreSQL): for what only a database has (migrations)."""
    with _sql_store(request.param, tmp_path) as s:
        yield s
