"""State storage behind one port, `Store` (store/base.py): `SqlStore` over SQLite (embedded) or PostgreSQL,
sharing one schema, and `MemoryStore` (tests and demos: nothing survives a restart)."""

from turnout.errors import InvalidInput
from turnout.store import sql
from turnout.store.base import Store
from turnout.store.memory import MemoryStore
from turnout.store.sql import SqlStore

__all__ = ["MemoryStore", "SqlStore", "Store", "open_store"]

MEMORY_URL = "memory://"
SQL_SCHEMES = ("sqlite://", "postgresql://", "postgres://", "postgresql+psycopg://")


def open_store(url: str) -> Store:
    """The store a `--db` URL names: `sqlite:///PATH`, `postgresql://...`, or `memory://`."""
    if url.startswith(MEMORY_URL):
        return MemoryStore(url)
    if not url.startswith(SQL_SCHEMES):
        raise InvalidInput(f"db: {url!r} is not a sqlite:///PATH, postgresql:// or memory:// URL", field="db")
    return sql.open_store(url)
