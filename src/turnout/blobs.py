"""The bytes of task input and output files in a storage directory: no database here.

The storage directory (`--storage DIR`, default `$TURNOUT_HOME/files`) holds `objects/<id>`, written once
and never changed, and `tmp/` for uploads under way. A blob is written to `tmp/`, fsync'd, then renamed
into `objects/` (and the directory fsync'd) before its record is committed (`store/files.py`), so a record
always names complete bytes; an upload cut off leaves only a `tmp/` file, removed by the retention sweep.
Where controllers and workers mount the same directory (NFS in practice), workers read inputs from
`objects/` and write outputs through `tmp/` themselves, with no HTTP transfer (`worker/files.py`), and a
worker process loads no database code for it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import shutil
import stat
import time
from pathlib import Path
from typing import BinaryIO

from turnout.errors import PayloadTooLarge

FILE_ID = re.compile(r"^f_[0-9a-f]{12}[0-9a-f]{16}\Z")  # \Z: `$` would let a trailing newline in
CHUNK_BYTES = 1024 * 1024
TMP_MAX_AGE_S = 24 * 3600.0  # a tmp/ file this old belongs to an upload that will never finish


def new_file_id() -> str:
    """Time-ordered, and unguessable: an id is what a shared mount's reader needs to find the bytes."""
    return f"f_{int(time.time() * 1000):012x}{secrets.token_hex(8)}"


class Blobs:
    """The storage directory: `objects/<id>` (complete, immutable) and `tmp/` (uploads under way)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.objects = self.root / "objects"
        self.tmp = self.root / "tmp"

    def ensure(self) -> None:
        for d in (self.root, self.objects, self.tmp):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        if not FILE_ID.match(file_id):  # never a path outside objects/
            raise ValueError(f"not a file id: {file_id!r}")
        return self.objects / file_id

    def open(self, file_id: str) -> BinaryIO:
        """`objects/<file_id>` opened for reading, if it is a regular file; else FileNotFoundError.

        Whoever can write to a shared storage (a tenant's worker, its handler) could put a link there to any
        file on this host (the admin token), or a FIFO whose read never ends: neither is a stored file."""
        path = self.path(file_id)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO's open would wait
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a link
                raise FileNotFoundError(errno.ENOENT, "not a regular file", str(path)) from None
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise FileNotFoundError(errno.ENOENT, "not a regular file", str(path))
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    def writer(self, limit_bytes: int | None = None, limit_name: str = "max_file_bytes") -> BlobWriter:
        self.ensure()
        return BlobWriter(self, limit_bytes, limit_name)

    def remove(self, file_id: str) -> None:
        with contextlib.suppress(FileNotFoundError, ValueError):
            self.path(file_id).unlink()

    def remove_stale_tmp(self, now: float, max_age_s: float = TMP_MAX_AGE_S) -> int:
        """Delete `tmp/` leftovers of uploads that never finished; returns how many.

        A directory is a worker's output directory (shared storage), maybe of a task still running: it is
        stale only when nothing in it changed for `max_age_s` either. Its own mtime changes only when an
        entry directly in it comes or goes, so a task writing into `ckpt/` under it for days leaves it old."""
        removed = 0
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.tmp):
                with contextlib.suppress(FileNotFoundError):
                    old = now - entry.stat(follow_symlinks=False).st_mtime > max_age_s
                    if old and now - _last_change(entry) > max_age_s:  # the walk only for an old entry
                        if entry.is_dir(follow_symlinks=False):
                            shutil.rmtree(entry.path, ignore_errors=True)
                        else:
                            os.unlink(entry.path)
                        removed += 1
        return removed


def _last_change(entry: os.DirEntry[str]) -> float:
    """The newest mtime of `entry` and, for a directory, of everything under it."""
    newest = entry.stat(follow_symlinks=False).st_mtime
    if entry.is_dir(follow_symlinks=False):
        for dirpath, dirnames, filenames in os.walk(entry.path):  # links are not followed
            for name in (*dirnames, *filenames):
                with contextlib.suppress(FileNotFoundError):
                    newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_mtime)
    return newest


class BlobWriter:
    """Bytes on their way into `objects/`: hashed and counted as written, fsync'd and renamed on `commit`.

    Blocking (disk I/O and hashing): the API calls it on a thread, a megabyte at a time. Raises
    PayloadTooLarge, naming the limit, at the first byte past `limit_bytes`; `discard` removes what was
    written (always call one of the two).
    """

    def __init__(self, blobs: Blobs, limit_bytes: int | None, limit_name: str) -> None:
        self.blobs = blobs
        self.limit_bytes = limit_bytes
        self.limit_name = limit_name
        self.tmp_path = blobs.tmp / f"up-{secrets.token_hex(8)}"
        self._fh = open(self.tmp_path, "xb")  # noqa: SIM115 (closed by commit or discard)
        os.chmod(self.tmp_path, 0o600)
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.limit_bytes is not None and self.size > self.limit_bytes:
            from turnout.config import describe_bytes

            raise PayloadTooLarge(
                f"file too large (more than {describe_bytes(self.limit_bytes)} sent); "
                f"limit {describe_bytes(self.limit_bytes)} ({self.limit_name})",
                field="file",
            )
        self._hash.update(data)
        self._fh.write(data)

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def commit(self, file_id: str) -> Path:
        """Make the bytes durable under `objects/<file_id>`; returns that path."""
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        final = self.blobs.path(file_id)
        os.rename(self.tmp_path, final)
        fsync_dir(self.blobs.objects)
        return final

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self._fh.close()
        with contextlib.suppress(FileNotFoundError):
            self.tmp_path.unlink()


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (the directory entry itself)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def hash_file(fh: BinaryIO) -> tuple[int, str]:
    """(size, sha256 hex) of an open file from where it stands, read a megabyte at a time."""
    digest = hashlib.sha256()
    size = 0
    while chunk := fh.read(CHUNK_BYTES):
        size += len(chunk)
        digest.update(chunk)
    return size, digest.hexdigest()
