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

from turnout import tls
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
    http: httpx.AsyncClient,
    path: Path,
    *,
    name: str | None = None,
    params: dict[str, Any] | None = None,
    route: str = "/v1/files",
) -> dict[str, Any]:
    """Stream `path` to `POST {route}` (raw bytes, its length declared); returns the controller's record.

    `route` is `/v1/files` for a user, `/v1/workers/{id}/files` for a worker sending a task's output."""
    from turnout.client import raise_for_error

    size = os.stat(path).st_size
    query = {"name": name if name is not None else Path(path).name, **(params or {})}
    resp = await http.post(route, content=_chunks(Path(path)), params=query,
                           headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)})  # fmt: skip
    raise_for_error(resp)
    body: dict[str, Any] = resp.json()
    return body


async def download(
    http: httpx.AsyncClient,
    file_id: str,
    dest: Path,
    *,
    params: dict[str, Any] | None = None,
    route: str = "/v1/files",
) -> dict[str, Any]:
    """Stream `GET {route}/{id}` into `dest` (through `dest.part`, renamed when whole and checked).

    Returns {id, size, sha256, path}. Raises the controller's error (NotFound, ...) or FileCorrupt.
    """
    dest = Path(dest)
    part = dest.with_name(dest.name + ".part")
    path = f"{route}/{file_id}"
    with _Pipeline(part) as sink:
        expected = await _direct_get(http, path, params or {}, sink)
        if expected is None:  # not for the direct path (a proxy, an error, ...): httpx does it
            expected = await _httpx_get(http, path, params or {}, sink)
        size, digest = await sink.finish()
    if expected and digest != expected:
        part.unlink(missing_ok=True)
        raise FileCorrupt(f"file {file_id}: sha256 {digest} of what arrived is not the stored {expected}",
                          field="sha256")  # fmt: skip
    os.replace(part, dest)
    return {"id": file_id, "size": size, "sha256": digest, "path": str(dest)}


async def _httpx_get(http: httpx.AsyncClient, path: str, params: dict[str, Any], sink: _Pipeline) -> str:
    from turnout.client import raise_for_error

    async with http.stream("GET", path, params=params) as resp:
        if resp.status_code >= 400:
            await resp.aread()
            raise_for_error(resp)
        async for chunk in resp.aiter_raw():
            await sink.feed(chunk)
    return resp.headers.get(SHA256_HEADER, "")


_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy")
DIRECT_READ_TIMEOUT_S = 60.0


async def _direct_get(
    http: httpx.AsyncClient, path: str, params: dict[str, Any], sink: _Pipeline
) -> str | None:
    """The body of a plain 200 answer read straight off a connection of its own, a megabyte per read.

    httpx's streaming costs a few Python layers per 64 KiB, which caps a download at a fraction of what
    the link and the disk do. Only the common case is taken here: a client made by `tls.async_client`
    (same TLS trust), no proxy configured, and an answer of 200 with a Content-Length and no transfer or
    content encoding. Anything else returns None before a byte reaches `sink`, and httpx does it.
    """
    context = tls.context_of(http)
    url = http.base_url
    if context is None or url.scheme not in ("http", "https") or not url.host:
        return None
    if any(os.environ.get(v) or os.environ.get(v.upper()) for v in _PROXY_VARS):
        return None
    port = url.port or (443 if url.scheme == "https" else 80)
    target = httpx.URL(url.raw_path.decode("ascii").rstrip("/") + path, params=params)
    head = [f"GET {target.raw_path.decode('ascii')} HTTP/1.1", f"Host: {url.netloc.decode('ascii')}",
            "Accept-Encoding: identity", "Connection: close", "User-Agent: turnout"]  # fmt: skip
    # who we are: the token, and a worker's secret (worker routes need both)
    head += [
        f"{k}: {v}" for k, v in http.headers.items() if k.lower() in ("authorization", "x-worker-secret")
    ]
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(url.host, port, ssl=context if url.scheme == "https" else None,
                                limit=4 * CHUNK_BYTES),
        DIRECT_READ_TIMEOUT_S,
    )  # fmt: skip
    try:
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), DIRECT_READ_TIMEOUT_S)
        status, headers = _parse_head(raw)
        length = headers.get("content-length", "")
        plain = (
            not headers.get("transfer-encoding") and headers.get("content-encoding", "identity") == "identity"
        )
        if status != 200 or not length.isdigit() or not plain:
            return None
        left = int(length)
        while left > 0:
            chunk = await asyncio.wait_for(reader.read(min(left, CHUNK_BYTES)), DIRECT_READ_TIMEOUT_S)
            if not chunk:
                raise httpx.RemoteProtocolError(
                    f"the connection closed with {left} bytes of the file still to come"
                )
            left -= len(chunk)
            await sink.feed(chunk)
        return headers.get(SHA256_HEADER, "")
    except asyncio.TimeoutError:
        raise httpx.ReadTimeout(f"no bytes of {path} for {DIRECT_READ_TIMEOUT_S:g} s") from None
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        raise httpx.ReadError(f"{type(exc).__name__}: {exc}") from None
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


def _parse_head(raw: bytes) -> tuple[int, dict[str, str]]:
    """(status, lower-cased headers) of an HTTP/1.1 response head."""
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return status, headers


class _Pipeline:
    """A file being written and hashed on a thread of its own while the next megabyte arrives: at most one
    megabyte waits, so memory stays small whatever the size. Removed if the `with` block fails."""

    def __init__(self, path: Path) -> None:
        self._sink = _Sink(path)
        self._disk = ThreadPoolExecutor(max_workers=1, thread_name_prefix="turnout-file")
        self._writing: asyncio.Future[None] | None = None
        self._pending: list[bytes] = []
        self._held = 0

    async def feed(self, chunk: bytes) -> None:
        self._pending.append(chunk)
        self._held += len(chunk)
        if self._held >= CHUNK_BYTES:
            await self._flush()

    async def _flush(self) -> None:
        if self._writing is not None:
            await self._writing
            self._writing = None
        if self._pending:
            chunks, self._pending, self._held = self._pending, [], 0
            self._writing = asyncio.get_running_loop().run_in_executor(
                self._disk, self._sink.write_all, chunks
            )

    async def finish(self) -> tuple[int, str]:
        """Write what is left; (size, sha256 hex)."""
        await self._flush()
        if self._writing is not None:
            await self._writing
            self._writing = None
        return self._sink.size, self._sink.sha256

    def __enter__(self) -> _Pipeline:
        self._sink.__enter__()
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        self._disk.shutdown(wait=True)  # a write under way ends before the file is closed (or removed)
        self._sink.__exit__(kind, *rest)


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

    def write_all(self, chunks: list[bytes]) -> None:
        for data in chunks:  # as they came: no copy to join them
            self.write(data)

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
