"""File references in task inputs and outputs, and moving a file's bytes over HTTP without holding them.

A task's input may hold `{"$file": "<id>"}` anywhere: a file uploaded with `POST /v1/files` (or written by
an earlier task). The worker fetches each one before the handler runs and hands over a local path; files
the handler writes under its output directory come back in its output as references too. One reference
shape in both directions, so a task's output can be the next task's input as it is.

`upload` and `download` stream a megabyte at a time (disk reads and writes on threads, hashing as they
go), so a file of any size costs the SDK, the CLI and the worker a few megabytes of memory. Every byte a
download receives is hashed, and the file is kept only if that sha256 is the one the controller recorded
when it was uploaded: bytes that changed on the controller's disk or on the way are never taken as good.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import os
import queue
import socket
import ssl
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from turnout import tls
from turnout.errors import InvalidInput, TurnoutError

REF_KEY = "$file"
CHUNK_BYTES = 1024 * 1024
SHA256_HEADER = "x-turnout-sha256"
# Writes to a file are at most this long. Linux 6.x gives a long aligned write large page-cache folios,
# and where those are costly to allocate (measured on a 2-core VM: 200 MiB in 1 MiB writes took 0.4 s of
# CPU, in 256 KiB writes 0.05 s) a download paid eight times what curl, writing 16 KiB at a time, pays.
WRITE_BYTES = 256 * 1024
R = TypeVar("R")


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
    from turnout.client import json_body

    size = os.stat(path).st_size
    query = {"name": name if name is not None else Path(path).name, **(params or {})}
    resp = await http.post(route, content=_chunks(Path(path)), params=query,
                           headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)})  # fmt: skip
    body: dict[str, Any] = json_body(resp, _base(http))
    return body


def _base(http: httpx.AsyncClient) -> str:
    """The controller's URL `http` talks to, for a message."""
    return str(http.base_url).rstrip("/")


async def download(
    http: httpx.AsyncClient,
    file_id: str,
    dest: Path,
    *,
    params: dict[str, Any] | None = None,
    route: str = "/v1/files",
) -> dict[str, Any]:
    """Stream `GET {route}/{id}` into `dest` (through `dest.part`, renamed when whole and checked).

    Every byte that arrives is hashed, and the file is kept only if its sha256 is the one the controller
    recorded when it was uploaded (`x-turnout-sha256`): bytes that changed on the controller's disk, or on
    the way, are never taken for the file. Returns {id, size, sha256, path}. Raises the controller's error
    (NotFound, ...) or FileCorrupt.
    """
    from turnout.client import path_id

    dest = Path(dest)
    path = f"{route}/{path_id(file_id, 'file id')}"
    # where it goes is checked before a byte is asked for: a local mistake is not a failed connection
    if dest.is_dir():
        raise InvalidInput(f"output: {dest} is a directory; name the file to write, e.g. {dest / file_id}",
                           field="output")  # fmt: skip
    if not dest.parent.is_dir():
        raise InvalidInput(f"output: {dest.parent} is not a directory here", field="output")
    part = dest.with_name(dest.name + ".part")
    try:
        got = await _direct_get(http, path, params or {}, part)
        if got is None:  # not for the direct path (a proxy, an error, ...): httpx does it
            got = await _httpx_get(http, path, params or {}, part)
        if got.sha256 != got.expected:
            raise FileCorrupt(f"file {file_id}: sha256 {got.sha256} of what arrived is not the stored "
                              f"{got.expected}", field="sha256")  # fmt: skip
        os.replace(part, dest)
    except BaseException:  # nothing half-written is left behind, whatever ended it
        part.unlink(missing_ok=True)
        raise
    return {"id": file_id, "size": got.size, "sha256": got.sha256, "path": str(dest)}


@dataclass(frozen=True)
class _Arrived:
    """What a download wrote: its size and sha256, and the sha256 the controller says it should have."""

    size: int
    sha256: str
    expected: str


async def _httpx_get(http: httpx.AsyncClient, path: str, params: dict[str, Any], part: Path) -> _Arrived:
    """Through httpx's stream: slower than the direct path, for what that one does not take."""
    from turnout.client import NotAController, raise_for_error, what_came

    with _Sink(part) as sink:
        async with http.stream("GET", path, params=params) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                raise_for_error(resp, _base(http))
            if resp.status_code != 200 or not resp.headers.get(SHA256_HEADER):
                # a controller always says the sha256 it stored: without it nothing could be checked
                raise NotAController(_base(http), f"{what_came(resp)} with no {SHA256_HEADER}")
            pending: list[bytes] = []
            async for chunk in resp.aiter_raw():
                pending.append(chunk)
                if sum(map(len, pending)) >= CHUNK_BYTES:
                    await asyncio.to_thread(sink.write_all, pending)
                    pending = []
            await asyncio.to_thread(sink.write_all, pending)
    return _Arrived(sink.size, sink.sha256, resp.headers.get(SHA256_HEADER, ""))


DIRECT_READ_TIMEOUT_S = 60.0
HANDOFF_BYTES = 512 * 1024  # received bytes are handed to the writer in pieces of at least this much


@dataclass(frozen=True)
class _DirectGet:
    """One GET for the direct path: where to connect, how (TLS or not), and the request's head."""

    host: str
    port: int
    context: ssl.SSLContext | None  # None: plain http
    head: bytes
    what: str  # the path, for messages


def _direct_request(http: httpx.AsyncClient, path: str, params: dict[str, Any]) -> _DirectGet | None:
    """The direct GET of `path` on `http`'s controller, or None where httpx must do it: a client not made
    by `tls.async_client` (its TLS trust is not known here), or a proxy configured."""
    context = tls.context_of(http)
    url = http.base_url
    if context is None or url.scheme not in ("http", "https") or not url.host:
        return None
    if tls.proxied_by_environment():
        return None
    target = httpx.URL(url.raw_path.decode("ascii").rstrip("/") + path, params=params)
    lines = [f"GET {target.raw_path.decode('ascii')} HTTP/1.1", f"Host: {url.netloc.decode('ascii')}",
             "Accept-Encoding: identity", "Connection: close", "User-Agent: turnout"]  # fmt: skip
    # who we are: the token, and a worker's secret (worker routes need both)
    lines += [
        f"{k}: {v}" for k, v in http.headers.items() if k.lower() in ("authorization", "x-worker-secret")
    ]
    return _DirectGet(host=url.host, port=url.port or (443 if url.scheme == "https" else 80),
                      context=context if url.scheme == "https" else None,
                      head=("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"), what=path)  # fmt: skip


async def _direct_get(
    http: httpx.AsyncClient, path: str, params: dict[str, Any], part: Path
) -> _Arrived | None:
    """The body of a plain 200 answer read straight off a connection of its own, by two threads of its own.

    httpx's streaming costs a few Python layers per 64 KiB, and an event loop between the socket and the
    disk costs a copy and a hand-off per read: together they held a download to a third of curl's speed
    on the same link. Here one thread only receives, into a few reused megabyte buffers, so the socket
    is drained as fast as the sender fills it; a second hashes and writes each buffer behind it (socket
    reads, sha256 and writes all release the GIL). A single thread doing all three leaves the socket full
    while it hashes, and the sender then waits for it once per megabyte or so.

    Only the common case is taken: a client made by `tls.async_client` (same TLS trust), no proxy
    configured, and an answer of 200 with a Content-Length and no transfer or content encoding. Anything
    else returns None before a byte reaches `part`, and httpx does it.
    """
    request = _direct_request(http, path, params)
    if request is None:
        return None
    connection = _Connection()
    done = _on_thread(_receive_direct, request, part, connection)
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:  # the caller gave up: end the transfer now, and its file with it
        connection.abort()
        with contextlib.suppress(BaseException):
            await done
        raise


class _Connection:
    """The socket a direct download reads, so that the caller's thread can cut it short (`abort`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.aborted = False

    def hold(self, sock: socket.socket) -> None:
        with self._lock:
            self._sock = sock
            if self.aborted:
                self._shut()

    def abort(self) -> None:
        with self._lock:
            self.aborted = True
            self._shut()

    def _shut(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)  # a read under way returns at once


def _on_thread(fn: Callable[..., R], *args: Any) -> asyncio.Future[R]:
    """`fn(*args)` on a new daemon thread: a long transfer never holds a thread of the loop's shared pool."""
    done: concurrent.futures.Future[R] = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(fn(*args))
        except BaseException as exc:
            done.set_exception(exc)

    threading.Thread(target=run, name="turnout-download", daemon=True).start()
    return asyncio.wrap_future(done)


def _receive_direct(request: _DirectGet, part: Path, connection: _Connection) -> _Arrived | None:
    """Blocking: the request on a new connection, the answer's body into `part` (see `_direct_get`)."""
    try:
        sock = socket.create_connection((request.host, request.port), timeout=DIRECT_READ_TIMEOUT_S)
    except TimeoutError:
        raise httpx.ConnectTimeout(f"no connection to {request.host}:{request.port} in "
                                   f"{DIRECT_READ_TIMEOUT_S:g} s") from None  # fmt: skip
    except OSError as exc:
        raise httpx.ConnectError(f"cannot connect to {request.host}:{request.port}: {exc}") from None
    try:
        if request.context is not None:
            sock = request.context.wrap_socket(sock, server_hostname=request.host)
        connection.hold(sock)
        sock.sendall(request.head)
        head, first = _read_head(sock)
        status, headers = _parse_head(head)
        length = headers.get("content-length", "")
        plain = (
            not headers.get("transfer-encoding") and headers.get("content-encoding", "identity") == "identity"
        )
        if status != 200 or not length.isdigit() or not plain or not headers.get(SHA256_HEADER):
            return None  # httpx's path says what is wrong with it
        with _Sink(part) as sink, _Writer(sink) as writer:
            _receive_body(sock, writer, first, int(length), connection)
        return _Arrived(sink.size, sink.sha256, headers.get(SHA256_HEADER, ""))
    except TimeoutError:
        raise httpx.ReadTimeout(f"no bytes of {request.what} for {DIRECT_READ_TIMEOUT_S:g} s") from None
    except OSError as exc:  # ssl.SSLError is one
        raise httpx.ReadError(f"{type(exc).__name__}: {exc}") from None
    finally:
        sock.close()


def _receive_body(
    sock: socket.socket, writer: _Writer, first: bytes, length: int, connection: _Connection
) -> None:
    """`length` bytes of body to `writer`: `first` (what came with the head), then off `sock`."""
    left = length
    view = memoryview(first)[:length]
    while left > 0:
        buffer = writer.take()
        filled = min(len(view), len(buffer))
        buffer[:filled], view = view[:filled], view[filled:]
        while filled < min(left, HANDOFF_BYTES):  # a TLS read gives 16 KiB at most: gather a few
            n = sock.recv_into(buffer[filled:], min(left, len(buffer)) - filled)
            if not n:
                if connection.aborted:
                    raise httpx.ReadError("the download was cancelled")
                raise httpx.RemoteProtocolError(
                    f"the connection closed with {left - filled} bytes of the file still to come"
                )
            filled += n
        writer.put(buffer, filled)
        left -= filled


def _read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    """(the response head, the body bytes that came with it)."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        if len(raw) > 64 * 1024:
            raise httpx.RemoteProtocolError("an answer whose head is over 64 KiB")
        more = sock.recv(64 * 1024)
        if not more:
            raise httpx.RemoteProtocolError("the connection closed before the answer's head")
        raw += more
    head, _, body = raw.partition(b"\r\n\r\n")
    return head, body


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


class _Sink:
    """A file being written, hashed as it goes; removed if the `with` block fails."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh = open(path, "wb")  # noqa: SIM115 (closed in __exit__)
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | memoryview) -> None:
        self._hash.update(data)
        view = memoryview(data)
        for start in range(0, len(view), WRITE_BYTES):
            self._fh.write(view[start : start + WRITE_BYTES])
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


class _Writer:
    """A `_Sink` written on a thread of its own, a few buffers behind the thread that receives.

    The receiver takes an empty buffer (`take`), fills it and hands it over (`put`). There are only
    BUFFERS of a megabyte, so memory stays small whatever the file's size, and a receiver that outruns the
    disk waits in `take`. Leaving the `with` block waits until all that was handed over is written; a
    failure on the writer's thread comes out of the next `take`, or of leaving the block.
    """

    BUFFERS = 4

    def __init__(self, sink: _Sink) -> None:
        self.sink = sink
        self._empty: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
        self._full: queue.SimpleQueue[tuple[memoryview, int] | None] = queue.SimpleQueue()
        for _ in range(self.BUFFERS):
            self._empty.put(memoryview(bytearray(CHUNK_BYTES)))
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._write_all, name="turnout-file-write", daemon=True)

    def take(self) -> memoryview:
        buffer = self._empty.get()
        if buffer is None:  # the writer failed; whoever asks next hears it too
            self._empty.put(None)
            assert self._error is not None  # set before None is put
            raise self._error
        return buffer

    def put(self, buffer: memoryview, size: int) -> None:
        self._full.put((buffer, size))

    def _write_all(self) -> None:
        try:
            while (item := self._full.get()) is not None:
                buffer, size = item
                self.sink.write(buffer[:size])
                self._empty.put(buffer)
        except BaseException as exc:
            self._error = exc
            self._empty.put(None)

    def __enter__(self) -> _Writer:
        self._thread.start()
        return self

    def __exit__(self, kind: object, *_: object) -> None:
        self._full.put(None)
        self._thread.join()  # nothing writes to the file once the block is left
        if kind is None and self._error is not None:
            raise self._error


def walk_files(root: Path) -> Iterator[tuple[str, Path]]:
    """(relative name with `/`, path) of each regular file under `root`, sorted; links are not followed."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.is_file() and not path.is_symlink():
                yield path.relative_to(root).as_posix(), path
