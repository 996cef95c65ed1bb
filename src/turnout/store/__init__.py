"""State storage: one `SqlStore` over SQLite (embedded) or PostgreSQL, sharing one schema."""

from turnout.store.sql import SqlStore, open_store

__all__ = ["SqlStore", "open_store"]
