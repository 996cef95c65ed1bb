"""A fresh PostgreSQL database per test, dropped afterwards, also when the test fails.

Where no PostgreSQL answers at `TURNOUT_TEST_POSTGRES`, the test is skipped with the reason, except
under CI=true, where that is a failure (tests/contract/test_store.py makes them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import sqlalchemy as sa

from tests.contract.test_store import PG_URL, _fresh_pg_database
from turnout.store.sql import normalise_url


@contextlib.contextmanager
def fresh_database() -> Iterator[str]:
    """The URL of an empty database (postgresql://...), dropped with every connection to it on exit."""
    url, name = _fresh_pg_database()
    try:
        yield url
    finally:
        admin = sa.create_engine(normalise_url(PG_URL), isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        finally:
            admin.dispose()
