"""File references in task inputs and outputs, and moving a file's bytes over HTTP without holding them.

A task's input may hold `{"$file": "<id>"}` anywhere: a file uploaded with `POST /v1/files` (or written by
an earlier task). The worker fetches each one before the handler runs and hands over a local path; files
the handler writes under its output directory come back in its output as references too. One reference
shape in both directions, so a task's output can be the next task's input as it is.

`upload` and `download` stream a megabyte at a time (reads and writes on a thread, hashing as they go),
so a file of any size costs the SDK, the CLI and the worker a few megabytes of memory. A download is
checked against the sha256 the controller recorded when the file was uploaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from turnout.errors import InvalidInput, TurnoutError

REF_KEY = "$file"
CHUNK_BYTES = 1024 * 1024
SHA256_HEADER = "x-turnout-sha256"


class FileCorrupt(TurnoutError):
    """The bytes that arrived are not the bytes that were stored (their sha256 differs)."""

    type = "file_corrupt"


def file_ref(file_id: str) -> dict[str, str]:
    return {REF_KEY: file_id}


def ref_id(value: Any) -> str | None:
    """The file id if `value` is a reference (`{"$file": "<id>"}`, other keys ignored), else None."""
    if type(value) is dict:
        file_id = value.get(REF_KEY)
        if isinstance(file_id, str):
            return file_id
    return None


def refs_in(value: Any, where: str = "input") -> list[tuple[str, str]]:
    """(field path, file id) of every reference in `value`, in document order (`input.images.0`)."""
    found: list[tuple[str, str]] = []
    stack: list[tuple[str, Any]] = [(where, value)]
    while stack:
        path, item = stack.pop()
        file_id = ref_id(item)
        if file_id is not None:
            found.append((path, file_id))
        elif type(item) is dict:
            stack.extend((f"{path}.{k}", v) for k, v in reversed(list(item.items())))
        elif type(item) is list:
            stack.extend((f"{path}.{i}", v) for i, v in reversed(list(enumerate(item))))
    return found


def with_paths(value: Any, paths: dict[str, str]) -> Any:
    """`value` with each reference to a file in `paths` given a `"path"` key: what a command worker reads."""
    file_id = ref_id(value)
    if file_id is not None:
        return {**value, "path": paths[file_id]} if file_id in paths else value
    if type(value) is dict:
        return {k: with_paths(v, paths) for k, v in value.items()}
    if type(value) is list:
        return [with_paths(v, paths) for v in value]
    return value


def set_field(data: Any, name: str, ref: dict[str, str]) -> dict[str, Any]:
    """`data` (an object, or null) with `name` set to `ref`: what `turnout submit --file NAME=PATH` sends."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise InvalidInput(
            "--file: the task input must be a JSON object to hold files by name", field="input"
        )
    return {**data, name: ref}


# ---- moving bytes --------------------------------------------------------------------------------


async def _chunks(path: Path) -> AsyncIterator[bytes]:
    """A file's bytes, a megabyte at a time, read on a thread."""
    loop = asyncio.get_running_loop()
    with open(path, "rb") as fh:
        while chunk := await loop.run_in_executor(None, fh.read, CHUNK_BYTES):
            yield chunk


async def upload(
    http: httpx.AsyncClient, path: Path, *, name: str | None = None, params: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Stream `path` to `POST /v1/files` (raw bytes, its length declared); returns the controller's record."""
    from turnout.client import raise_for_error

    size = os.stat(path).st_size
    query = {"name": name if name is not None else Path(path).name, **(params or {})}
    resp = await http.post("/v1/files", content=_chunks(Path(path)), params=query,
                           headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)})  # fmt: skip
    raise_for_error(resp)
    body: dict[str, Any] = resp.json()
    return body


async def download(
    http: httpx.AsyncClient, file_id: str, dest: Path, *, params: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Stream `GET /v1/files/{id}` into `dest` (through `dest.part`, renamed when whole and checked).

    Returns {id, size, sha256, path}. Raises the controller's error (NotFound, ...) or FileCorrupt.
    """
    from turnout.client import raise_for_error

    loop = asyncio.get_running_loop()
    dest = Path(dest)
    part = dest.with_name(dest.name + ".part")
    async with http.stream("GET", f"/v1/files/{file_id}", params=params or {}) as resp:
        if resp.status_code >= 400:
            await resp.aread()
            raise_for_error(resp)
        expected = resp.headers.get(SHA256_HEADER)
        # Receiving and writing overlap: a megabyte is hashed and written on the sink's own thread while the
        # next one arrives; at most one is waiting, so memory stays a few megabytes whatever the size.
        with (
            _Sink(part) as sink,
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="turnout-file") as disk,
        ):
            writing: asyncio.Future[None] | None = None
            pending: list[bytes] = []
            held = 0
            async for chunk in resp.aiter_raw():
                pending.append(chunk)
                held += len(chunk)
                if held >= CHUNK_BYTES:
                    if writing is not None:
                        await writing
                    writing = loop.run_in_executor(disk, sink.write, b"".join(pending))
                    pending, held = [], 0
            if writing is not None:
                await writing
            if pending:
                await loop.run_in_executor(disk, sink.write, b"".join(pending))
            size, digest = sink.size, sink.sha256
    if expected and digest != expected:
        part.unlink(missing_ok=True)
        raise FileCorrupt(f"file {file_id}: sha256 {digest} of what arrived is not the stored {expected}",
                          field="sha256")  # fmt: skip
    os.replace(part, dest)
    return {"id": file_id, "size": size, "sha256": digest, "path": str(dest)}


class _Sink:
    """A file being written, hashed as it goes; removed if the `with` block fails."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh = open(path, "wb")  # noqa: SIM115 (closed in __exit__)
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> None:
        self._hash.update(data)
        self._fh.write(data)
        self.size += len(data)

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def __enter__(self) -> _Sink:
        return self

    def __exit__(self, kind: object, *_: object) -> None:
        self._fh.close()
        if kind is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


def walk_files(root: Path) -> Iterator[tuple[str, Path]]:
    """(relative name with `/`, path) of each regular file under `root`, sorted; links are not followed."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.is_file() and not path.is_symlink():
                yield path.relative_to(root).as_posix(), path
