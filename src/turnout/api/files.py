"""`/v1/files`: upload (streamed, size-limited, sha256 recorded), download (streamed, ranges), delete, retention.

    POST   /v1/files?name=N               (submit) the body is the file: application/octet-stream, or one file
                                          part of multipart/form-data; answers 201 {id, name, size, sha256, ...}
    POST   /v1/files/shared               (submit) {id, name?}: record a file written into the shared storage
    GET    /v1/files/{id}  (and HEAD)      (read) the bytes; `Range: bytes=a-b` answers 206; sha256 in x-turnout-sha256
    DELETE /v1/files/{id}                  (submit)
    POST   /v1/workers/{w}/files?task=ID&attempt=N          (the worker w) an output of the attempt it runs
    POST   /v1/workers/{w}/files/shared?task=ID&attempt=N   (the worker w) the same, written into the storage
    GET    /v1/workers/{w}/files/{id}?task=ID  (and HEAD)   (the worker w) an input of the task it holds

Files belong to a tenant: another tenant's file answers 404, as its tasks do. A worker proves who it is as on
the rest of its protocol (its registering token and `X-Worker-Secret`; another worker's routes answer 403),
reads only a file that the task it holds names in its input (any other: 404), and writes outputs only for
the attempt it runs (another: 409); an output belongs to the task's tenant. An upload is written to disk a
megabyte at a time on a thread as it arrives, never held whole; past `max_file_bytes` it is refused with a
413 naming the limit (the body limit middleware bounds the stream; the count here is exact). A file's
record is committed only once its bytes are fsync'd in place, so a file that answers is whole.

Retention: files expire `file_retention_s` after they were made (config; default 7 days); one replica per
round (`claim_sweep`) deletes their records, then their bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import AsyncIterator, Callable
from email.utils import formatdate
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import anyio
from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, MultipartState, parse_options_header
from sqlalchemy.exc import IntegrityError
from starlette.requests import ClientDisconnect
from starlette.responses import MalformedRangeHeader, RangeNotSatisfiable
from starlette.types import Receive, Scope, Send

from turnout.access import Action, Principal, worker_serves
from turnout.api.guards import Guards
from turnout.api.schemas import Strict, iso
from turnout.api.service import STORAGE_RETRY_AFTER_S, Service
from turnout.api.strictjson import StrictJsonRoute
from turnout.auth import WorkerCredential
from turnout.blobs import CHUNK_BYTES, FILE_ID, Blobs, BlobWriter, hash_file, new_file_id
from turnout.errors import Conflict, InvalidInput, NotFound, StorageUnavailable
from turnout.files import SHA256_HEADER, refs_in
from turnout.models import ACTIVE_STATES, Task
from turnout.store.files import FileRecord

log = logging.getLogger("turnout.api")
R = TypeVar("R")
UPLOAD_BODY = {"requestBody": {"required": True, "content": {
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
    "multipart/form-data": {"schema": {"type": "object", "properties": {"file": {"type": "string", "format": "binary"}}}},
}}}  # fmt: skip


class SharedFileIn(Strict):
    id: str
    name: str | None = None


class BigFileResponse(FileResponse):
    """A stored file's bytes, read from a handle the route opened before answering: a file deleted or expired
    meanwhile (its name gone, its bytes kept while the handle is open) is still sent whole, where opening it by
    name once the headers had gone would end the answer with none of its body. Ranges read from the same handle."""

    chunk_size = CHUNK_BYTES  # a megabyte per read (on a thread) and per write to the socket

    def __init__(self, opened: BinaryIO, path: Path, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.opened = opened

    @contextlib.asynccontextmanager
    async def _open_file(self) -> AsyncIterator[anyio.AsyncFile[bytes]]:
        """Starlette's one place that opens `path` for the body; closing is `__call__`'s (a HEAD opens none)."""
        yield anyio.wrap_file(self.opened)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.opened.close()


def router(service: Service, guards: Guards) -> APIRouter:
    """The file routes, over the files under `settings.storage_dir` (which must be set); registers the
    retention sweep with the service, to run while it does."""
    settings = service.controller.settings
    if settings.storage_dir is None:
        raise ValueError("file routes need settings.storage_dir")
    need, this_worker = guards.need, guards.this_worker()
    ctrl = service.controller
    blobs = Blobs(settings.storage_dir)
    blobs.ensure()
    api = APIRouter(route_class=StrictJsonRoute)
    limits = settings.request_limits

    async def held_task(me: WorkerCredential, task_id: str, attempt: int | None) -> Task:
        """The task, if this worker holds it now (and, given `attempt`, runs that attempt); else Conflict. A task
        of a tenant the worker does not serve is not found, as an unknown id is: a worker learns nothing of
        other tenants' ids."""
        worker_id = me.worker_id
        task = await _task(service, task_id)
        if not worker_serves(me.tenant, task.tenant):
            raise NotFound(f"task {task_id} not found", field="task")
        if task.state not in ACTIVE_STATES or task.worker_id != worker_id:
            raise Conflict(f"task {task_id} is not running on worker {worker_id}", field="task")
        if attempt is not None and task.attempts != attempt:
            raise Conflict(f"task {task_id} attempt {attempt} is no longer running", field="attempt")
        return task

    async def visible_file(file_id: str, tenant: str | None) -> FileRecord:
        """The file, if it is `tenant`'s (None: any tenant's) and not expired; else NotFound, whether or not
        it exists. An expired file is gone from the moment it expires, not from the sweep's next round."""
        missing = NotFound(f"file {file_id} not found", field="id")
        if not FILE_ID.match(file_id):
            raise missing
        record = await service.read(ctrl.file_record, file_id)
        if record is None or (tenant is not None and record.tenant != tenant):
            raise missing
        if record.expires_at is not None and record.expires_at <= ctrl.clock():
            raise missing
        return record

    def expiry(now: float) -> float | None:
        return now + settings.file_retention_s if settings.file_retention_s else None

    async def receive(request: Request, tenant: str, name: str | None, task_id: str | None) -> Any:
        kind, options = parse_options_header(request.headers.get("content-type"))
        if kind in (b"", b"application/json") or kind.endswith(b"+json"):
            raise InvalidInput("body: send the file's bytes as application/octet-stream, or as the file part of "
                               "multipart/form-data", field="body")  # fmt: skip
        try:
            writer = await _blocking(blobs.writer, limits.max_file_bytes)
        except OSError as exc:
            raise _disk_failure(exc) from None
        file_id = new_file_id()
        try:
            if kind == b"multipart/form-data":
                name = await _receive_multipart(request, writer, options.get(b"boundary"), name)
            else:
                await _receive_raw(request, writer)
            await _blocking(writer.commit, file_id)
        except ClientDisconnect:  # the client went away (or the body limit answered it): nobody reads this
            await _blocking(writer.discard)
            return Response(status_code=400)
        except OSError as exc:  # the storage is full or failing: nothing was kept
            await _blocking(writer.discard)
            raise _disk_failure(exc) from None
        except BaseException:
            await _blocking(writer.discard)
            raise
        now = service.controller.clock()
        record = FileRecord(file_id, tenant, name, writer.size, writer.sha256, now, expiry(now), task_id)
        try:
            await service.call(ctrl.record_file, record)
        except BaseException:
            await _blocking(blobs.remove, file_id)
            raise
        return file_out(record)

    async def record_shared(body: SharedFileIn, tenant: str, task_id: str | None) -> Any:
        """Record a file whose bytes were written into `objects/<id>` of the shared storage directly."""
        if not FILE_ID.match(body.id):
            raise InvalidInput(f"id: {body.id!r} is not a file id (f_ and 28 hex digits)", field="id")
        missing = InvalidInput(f"id: no file {body.id} in this controller's storage; is --storage the same "
                               "shared directory on the controller and the worker?", field="id")  # fmt: skip

        def taken(recorded: FileRecord) -> InvalidInput | Conflict:
            """Another tenant's record is answered as no file at all: its id tells nothing."""
            if recorded.tenant == tenant:
                return Conflict(f"id: file {body.id} is already recorded", field="id")
            return missing

        recorded = await service.read(ctrl.file_record, body.id)
        if recorded is not None:
            raise taken(recorded)
        try:
            size, digest = await _blocking(_hash_file, blobs, body.id)
        except FileNotFoundError:
            raise missing from None
        if size > limits.max_file_bytes:
            await _blocking(blobs.remove, body.id)
            raise InvalidInput(
                f"id: file of {size} bytes is over {limits.describe('max_file_bytes')}", field="id"
            )
        now = service.controller.clock()
        record = FileRecord(body.id, tenant, body.name, size, digest, now, expiry(now), task_id)
        try:
            await service.call(ctrl.record_file, record)
        except IntegrityError:  # recorded by a request that raced this one past the check above
            recorded = await service.read(ctrl.file_record, body.id)
            if recorded is None:
                raise
            raise taken(recorded) from None
        return file_out(record)

    async def send(request: Request, record: FileRecord) -> Any:
        headers = {SHA256_HEADER: record.sha256, "etag": f'"{record.sha256}"', "cache-control": "private"}
        found = await _blocking(_open_blob, blobs, record.id)
        if found is None:
            raise NotFound(f"file {record.id} not found (its bytes are gone from the storage)", field="id")
        opened, stat = found
        http_range = request.headers.get("range")
        if_range = request.headers.get("if-range")
        if if_range is not None and if_range not in (headers["etag"], formatdate(stat.st_mtime, usegmt=True)):
            http_range = None  # a copy other than the one it names: the whole file goes out (RFC 9110 13.1.5)
        if http_range is not None:
            try:
                BigFileResponse._parse_range_header(http_range, stat.st_size)
            except (MalformedRangeHeader, RangeNotSatisfiable) as exc:
                opened.close()  # refused: no answer will read it
                if isinstance(exc, MalformedRangeHeader):
                    raise InvalidInput(
                        f"Range: {exc.content} (expected bytes=START-END)", field="Range"
                    ) from None
                return JSONResponse(
                    {"error": {"type": "range_not_satisfiable", "field": "Range",
                               "message": f"Range: {http_range!r} starts past the end of a {stat.st_size}-byte file"}},
                    status_code=416, headers={"Content-Range": f"bytes */{stat.st_size}"},
                )  # fmt: skip
        return BigFileResponse(opened, blobs.path(record.id), headers=headers, stat_result=stat,
                               filename=record.name or record.id, media_type="application/octet-stream")  # fmt: skip

    # ---- a tenant's own files: submit tokens write, read tokens read; another tenant's file is not there

    @api.post("/v1/files", status_code=201, openapi_extra=UPLOAD_BODY)
    async def upload(
        request: Request,
        name: str | None = Query(None, max_length=255),
        p: Principal = need(Action.SUBMIT),
    ) -> Any:
        return await receive(request, p.home_tenant, name, None)

    @api.post("/v1/files/shared", status_code=201)
    async def shared(body: SharedFileIn, p: Principal = need(Action.SUBMIT)) -> Any:
        """Record a file whose bytes the caller wrote into `objects/<id>` of the shared storage itself."""
        return await record_shared(body, p.home_tenant, None)

    @api.get("/v1/files/{file_id}")
    @api.head("/v1/files/{file_id}")  # a route of its own: its own operation id in the OpenAPI document
    async def download(request: Request, file_id: str, p: Principal = need(Action.READ)) -> Any:
        return await send(request, await visible_file(file_id, p.scope))

    @api.delete("/v1/files/{file_id}")
    async def delete(file_id: str, p: Principal = need(Action.SUBMIT)) -> Any:
        record = await visible_file(file_id, p.scope)
        if await service.call(ctrl.delete_file, record.id):
            await _blocking(blobs.remove, record.id)
        return {"id": record.id, "deleted": True}

    # ---- a worker's transfers, for the task it holds: only the worker itself (token and secret) ------

    @api.post("/v1/workers/{worker_id}/files", status_code=201, openapi_extra=UPLOAD_BODY)
    async def worker_upload(
        request: Request,
        worker_id: str,
        task: str = Query(..., max_length=64),
        attempt: int = Query(..., ge=1, le=2**31 - 1),
        name: str | None = Query(None, max_length=255),
        me: WorkerCredential = this_worker,
    ) -> Any:
        """An output of the attempt this worker runs; the file belongs to the task's tenant."""
        held = await held_task(me, task, attempt)
        return await receive(request, held.tenant, name, held.id)

    @api.post("/v1/workers/{worker_id}/files/shared", status_code=201)
    async def worker_shared(
        body: SharedFileIn,
        worker_id: str,
        task: str = Query(..., max_length=64),
        attempt: int = Query(..., ge=1, le=2**31 - 1),
        me: WorkerCredential = this_worker,
    ) -> Any:
        held = await held_task(me, task, attempt)
        return await record_shared(body, held.tenant, held.id)

    @api.get("/v1/workers/{worker_id}/files/{file_id}")
    @api.head("/v1/workers/{worker_id}/files/{file_id}")
    async def worker_download(
        request: Request,
        worker_id: str,
        file_id: str,
        task: str = Query(..., max_length=64),
        me: WorkerCredential = this_worker,
    ) -> Any:
        """A file the task this worker holds names in its input; any other answers 404."""
        try:
            held = await held_task(me, task, None)
        except (
            Conflict,
            NotFound,
        ):  # whichever the task is (another's, unknown, not held): the file is not here
            raise NotFound(f"file {file_id} not found", field="id") from None
        record = await visible_file(file_id, held.tenant)
        if file_id not in {fid for _, fid in refs_in(held.spec.input)}:
            raise NotFound(f"file {file_id} not found", field="id")
        return await send(request, record)

    service.run_in_background(functools.partial(_expire_forever, service, blobs))
    return api


def _disk_failure(exc: OSError) -> StorageUnavailable:
    log.error("file storage failed: %s", exc)
    return StorageUnavailable("the file storage cannot take this file now (full or failing); nothing was kept, "
                              "try again", retry_after_s=STORAGE_RETRY_AFTER_S)  # fmt: skip


def file_out(record: FileRecord) -> dict[str, Any]:
    return {"id": record.id, "name": record.name, "size": record.size, "sha256": record.sha256,
            "created_at": iso(record.created_at), "expires_at": iso(record.expires_at), "task": record.task_id}  # fmt: skip


async def _task(service: Service, task_id: str) -> Task:
    task = await service.read(service.controller.find_task, task_id)
    if task is None:
        raise NotFound(f"task {task_id} not found", field="task")
    return task


async def _blocking(fn: Callable[..., R], *args: Any) -> R:
    """Disk work (writes, fsync, hashing) on a thread: the event loop keeps answering heartbeats."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def _receive_raw(request: Request, writer: BlobWriter) -> None:
    pending = bytearray()
    async for chunk in request.stream():
        pending += chunk
        if len(pending) >= CHUNK_BYTES:
            await _blocking(writer.write, bytes(pending))
            pending.clear()
    if pending:
        await _blocking(writer.write, bytes(pending))


async def _receive_multipart(
    request: Request, writer: BlobWriter, boundary: bytes | None, name: str | None
) -> str | None:
    """Write the one file part of a multipart body into `writer` as it streams; returns the file's name."""
    if not boundary:
        raise InvalidInput("Content-Type: multipart/form-data needs a boundary", field="Content-Type")
    state: dict[str, Any] = {
        "field": b"",
        "value": b"",
        "headers": {},
        "in_file": False,
        "files": 0,
        "name": name,
    }
    pieces: list[bytes] = []

    def on_header_field(data: bytes, start: int, end: int) -> None:
        state["field"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        state["value"] += data[start:end]

    def on_header_end() -> None:
        state["headers"][state["field"].lower()] = state["value"]
        state["field"], state["value"] = b"", b""

    def on_headers_finished() -> None:
        _, params = parse_options_header(state["headers"].get(b"content-disposition", b"").decode("latin-1"))
        is_file = b"filename" in params or params.get(b"name") == b"file"
        state["in_file"] = is_file and state["files"] == 0
        if is_file:
            state["files"] += 1
            if state["name"] is None and params.get(b"filename"):
                state["name"] = params[b"filename"].decode("utf-8", "replace")[:255]

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if state["in_file"]:
            pieces.append(data[start:end])

    def on_part_begin() -> None:
        state["headers"] = {}
        state["in_file"] = False

    try:
        parser = MultipartParser(boundary, {"on_part_begin": on_part_begin, "on_header_field": on_header_field,
                                            "on_header_value": on_header_value, "on_header_end": on_header_end,
                                            "on_headers_finished": on_headers_finished, "on_part_data": on_part_data})  # fmt: skip
    except FormParserError as exc:  # a boundary over its 256 bytes: the client's mistake, not a 500
        raise InvalidInput(f"Content-Type: {exc}", field="Content-Type") from None
    async for chunk in request.stream():
        try:
            parser.write(chunk)
        except Exception as exc:  # python-multipart's parse errors
            raise InvalidInput(f"body: not a multipart/form-data body ({exc})", field="body") from None
        if sum(len(p) for p in pieces) >= CHUNK_BYTES:
            await _blocking(writer.write, b"".join(pieces))
            pieces.clear()
    if parser.state is not MultipartState.END:  # no closing boundary: a body cut short is not a whole file
        raise InvalidInput(f"body: the multipart body ends before its closing boundary (--{boundary.decode('latin-1')}--); "
                           "was the upload cut short?", field="body")  # fmt: skip
    if pieces:
        await _blocking(writer.write, b"".join(pieces))
    if state["files"] == 0:
        raise InvalidInput("file: the multipart body holds no file part", field="file")
    if state["files"] > 1:
        raise InvalidInput("file: one file per upload", field="file")
    result: str | None = state["name"]
    if result is not None and "\x00" in result:  # as `?name=` refuses one: no store's text holds it
        raise InvalidInput("file: its filename holds a NUL character", field="file")
    return result


def _hash_file(blobs: Blobs, file_id: str) -> tuple[int, str]:
    with blobs.open(file_id) as fh:
        return hash_file(fh)


def _open_blob(blobs: Blobs, file_id: str) -> tuple[BinaryIO, os.stat_result] | None:
    """The stored file opened for reading, and its size and times from that handle; None when it is gone
    (or is not a regular file: `Blobs.open`)."""
    try:
        opened = blobs.open(file_id)
    except FileNotFoundError:
        return None
    return opened, os.fstat(opened.fileno())


async def _expire_forever(service: Service, blobs: Blobs) -> None:
    """Delete expired files: records first (one replica per round), then their bytes; and stale tmp/ files."""
    ctrl = service.controller
    settings = ctrl.settings
    interval_s = min(60.0, max(0.5, settings.file_retention_s / 4)) if settings.file_retention_s else 60.0
    while True:
        try:
            for file_id in await service.call(ctrl.expire_files, service.replica_id, interval_s):
                await _blocking(blobs.remove, file_id)
            await _blocking(blobs.remove_stale_tmp, ctrl.clock())
        except Exception:  # the sweep outlives a bad moment; the next round tries again
            log.exception("expiring files failed")
        await asyncio.sleep(interval_s)
