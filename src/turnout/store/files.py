"""The records of task input and output files in the database; their bytes are `blobs.py`'s.

Records are rows of `files` (id, tenant, name, size, sha256, created_at, expires_at, task_id), read and
written in the caller's transaction like every other store method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from turnout.store import schema
from turnout.store.sql import SqlStore

F = schema.files


@dataclass(frozen=True)
class FileRecord:
    id: str
    tenant: str
    name: str | None
    size: int
    sha256: str
    created_at: float
    expires_at: float | None = None
    task_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "size": self.size, "sha256": self.sha256,
                "created_at": self.created_at, "expires_at": self.expires_at, "task_id": self.task_id}  # fmt: skip


class FileRecords:
    """The `files` table, through the store's connections (inside `group()`, the group's transaction)."""

    def __init__(self, store: SqlStore) -> None:
        self.store = store

    def insert(self, record: FileRecord) -> None:
        with self.store._write() as conn:
            conn.execute(F.insert().values(**_row(record)))

    def get(self, file_id: str) -> FileRecord | None:
        with self.store._read() as conn:
            row = conn.execute(sa.select(F).where(F.c.id == file_id)).first()
        return _record(row) if row else None

    def owned(self, file_ids: set[str], tenant: str, now: float) -> set[str]:
        if not file_ids:
            return set()
        with self.store._read() as conn:
            query = sa.select(F.c.id).where(F.c.id.in_(sorted(file_ids)), F.c.tenant == tenant,
                                            sa.or_(F.c.expires_at.is_(None), F.c.expires_at > now))  # fmt: skip
            return {r[0] for r in conn.execute(query)}

    def delete(self, file_id: str) -> bool:
        with self.store._write() as conn:
            return bool(conn.execute(F.delete().where(F.c.id == file_id)).rowcount)

    def expire(self, now: float, limit: int = 1000) -> list[str]:
        """Delete the records of files whose retention ended; returns their ids (their bytes go after commit)."""
        with self.store._write() as conn:
            ids = [r[0] for r in conn.execute(
                sa.select(F.c.id).where(F.c.expires_at.is_not(None), F.c.expires_at <= now).limit(limit))]  # fmt: skip
            if ids:
                conn.execute(F.delete().where(F.c.id.in_(ids)))
        return ids


def _row(r: FileRecord) -> dict[str, Any]:
    return {"id": r.id, "tenant": r.tenant, "name": r.name, "size": r.size, "sha256": r.sha256,
            "created_at": r.created_at, "expires_at": r.expires_at, "task_id": r.task_id}  # fmt: skip


def _record(r: Any) -> FileRecord:
    return FileRecord(id=r.id, tenant=r.tenant, name=r.name, size=int(r.size), sha256=r.sha256,
                      created_at=r.created_at, expires_at=r.expires_at, task_id=r.task_id)  # fmt: skip
