"""A task's files on the worker: inputs fetched before its handler runs, outputs sent back after.

Before a task runs, every `{"$file": ID}` in its input is made a local file: read in place from the shared
storage (`--storage DIR`, the controller's directory mounted here), or else downloaded over HTTP into the
task's scratch directory, checked against its sha256. The handler gets the paths (`ctx.path(ref)`; for
command workers `TURNOUT_INPUT_FILES`, a JSON object of id -> path, and a `"path"` beside each reference in
the input line) and an empty output directory (`ctx.output_dir`, `TURNOUT_OUTPUT_DIR`). Whatever it leaves
there is sent back once it succeeds: renamed into the shared storage and recorded, or uploaded, and its
output gains `"files": {"<relative name>": {"$file": "<id>"}}`. The scratch directory goes with the task.

Transfers ride out a controller or network that is away for a while (retried with backoff and jitter);
a file that is not there (404), or an attempt the controller no longer runs (409), fails at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from turnout.errors import Conflict, NotFound, PayloadTooLarge, TurnoutError
from turnout.files import FileCorrupt, download, file_ref, refs_in, upload, walk_files
from turnout.store.files import FILE_ID, Blobs, fsync_dir, new_file_id

log = logging.getLogger("turnout.worker")
TRANSFER_PATIENCE_S = 300.0  # how long a transfer keeps retrying while the controller cannot be reached
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0


class TaskFileError(Exception):
    """A task cannot run (an input) or cannot report (an output) because of a file: its task fails so."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error["message"])
        self.error = error


@dataclass
class TaskFiles:
    """One attempt's files: its scratch directory, its inputs' local paths, its output directory."""

    scratch: Path
    output_dir: Path
    inputs: dict[str, str] = field(default_factory=dict)  # file id -> local path

    def env(self) -> dict[str, str]:
        """What a command worker started for this task gets."""
        return {"TURNOUT_INPUT_FILES": json.dumps(self.inputs), "TURNOUT_OUTPUT_DIR": str(self.output_dir)}


class WorkerFiles:
    """The worker's side of files, over its HTTP client, with a scratch directory (and a shared storage)."""

    def __init__(
        self, http: httpx.AsyncClient, *, scratch: Path | None = None, storage: Path | None = None
    ) -> None:
        self.http = http
        self.worker_id: str | None = None  # set once registered: transfers go to this worker's own routes
        self.shared = Blobs(storage) if storage is not None else None
        self._own_scratch = scratch is None
        self.scratch = (
            Path(scratch) if scratch is not None else Path(tempfile.mkdtemp(prefix="turnout-worker-"))
        )
        self.scratch.mkdir(parents=True, exist_ok=True)

    @property
    def route(self) -> str:
        """This worker's file routes: its token and secret (on `http`) prove who asks, for tasks it holds."""
        return f"/v1/workers/{self.worker_id}/files"

    def close(self) -> None:
        if self._own_scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)

    async def prepare(self, lease: dict[str, Any]) -> TaskFiles:
        """Make the attempt's directories and local copies (or shared paths) of its input files."""
        task_id, attempt = lease["id"], lease["attempt"]
        outputs_root = (
            self.shared.tmp if self.shared is not None else self.scratch
        )  # a rename away from objects/
        if self.shared is not None:
            self.shared.ensure()
        scratch = self.scratch / f"{task_id}-{attempt}"
        output_dir = outputs_root / f"out-{task_id}-{attempt}"
        for d in (scratch, output_dir):
            shutil.rmtree(d, ignore_errors=True)  # a retry of this attempt on this worker starts clean
            d.mkdir(mode=0o700, parents=True)
        files = TaskFiles(scratch, output_dir)
        try:
            for where, file_id in refs_in(lease.get("input")):
                if file_id not in files.inputs:
                    files.inputs[file_id] = await self._fetch(file_id, where, scratch, task_id)
        except BaseException:
            self.cleanup(files)
            raise
        return files

    async def _fetch(self, file_id: str, where: str, scratch: Path, task_id: str) -> str:
        if not FILE_ID.match(file_id):
            raise TaskFileError({"type": "input_file_missing", "field": where,
                                 "message": f"{where}: {file_id!r} is not a file id"})  # fmt: skip
        if self.shared is not None:
            in_place = self.shared.path(file_id)
            if in_place.exists():
                return str(in_place)
        dest = scratch / "in" / file_id
        dest.parent.mkdir(exist_ok=True)
        try:
            await self._patiently(
                f"fetching {file_id}",
                lambda: download(self.http, file_id, dest, params={"task": task_id}, route=self.route),
            )
        except NotFound:
            raise TaskFileError({"type": "input_file_missing", "field": where,
                                 "message": f"{where}: file {file_id} does not exist (deleted, expired, or never "
                                            "uploaded)"}) from None  # fmt: skip
        except TurnoutError as exc:
            raise TaskFileError({"type": "input_file_unavailable", "field": where,
                                 "message": f"{where}: file {file_id} could not be fetched: {exc.message}"}) from None  # fmt: skip
        return str(dest)

    async def collect(self, files: TaskFiles, lease: dict[str, Any], output: Any) -> Any:
        """Send back what the handler left in its output directory; `output` with their references."""
        found = list(
            await asyncio.get_running_loop().run_in_executor(None, lambda: list(walk_files(files.output_dir)))
        )
        if not found:
            return output
        params = {"task": lease["id"], "attempt": lease["attempt"]}
        refs: dict[str, dict[str, str]] = {}
        for name, path in found:
            try:
                record = await self._send(path, name, params)
            except (Conflict, NotFound) as exc:  # the attempt is over: its result will be refused anyway
                raise TaskFileError({"type": "output_refused", "field": f"output_dir.{name}",
                                     "message": f"output file {name}: {exc.message}"}) from None  # fmt: skip
            except PayloadTooLarge as exc:
                raise TaskFileError({"type": "output_too_large", "field": f"output_dir.{name}",
                                     "message": f"output file {name}: {exc.message}"}) from None  # fmt: skip
            except TurnoutError as exc:
                raise TaskFileError({"type": "output_upload_failed", "field": f"output_dir.{name}",
                                     "message": f"output file {name} could not be sent: {exc.message}"}) from None  # fmt: skip
            refs[name] = file_ref(record["id"])
        return _with_files(output, refs)

    async def _send(self, path: Path, name: str, params: dict[str, Any]) -> dict[str, Any]:
        if self.shared is None:
            return await self._patiently(
                f"uploading {name}",
                lambda: upload(self.http, path, name=name, params=params, route=self.route),
            )
        shared = self.shared
        file_id = new_file_id()
        await asyncio.get_running_loop().run_in_executor(None, _into_objects, path, shared, file_id)

        async def record() -> dict[str, Any]:
            from turnout.client import raise_for_error

            resp = await self.http.post(
                f"{self.route}/shared", json={"id": file_id, "name": name}, params=params
            )
            raise_for_error(resp)
            body: dict[str, Any] = resp.json()
            return body

        try:
            return await self._patiently(f"recording {name}", record)
        except BaseException:
            shared.remove(file_id)
            raise

    async def _patiently(self, what: str, attempt: Any) -> Any:
        """Run `attempt()` until it succeeds or fails for a reason a retry cannot change, for at most
        TRANSFER_PATIENCE_S while the controller cannot be reached (backoff with jitter)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + TRANSFER_PATIENCE_S
        delay_s = FIRST_BACKOFF_S
        corrupt_left = 2
        while True:
            try:
                return await attempt()
            except FileCorrupt:
                corrupt_left -= 1
                if not corrupt_left:
                    raise
            except (httpx.HTTPError, TurnoutError) as exc:
                retry = isinstance(exc, httpx.HTTPError) or _transient(exc)
                if not retry or loop.time() >= deadline:
                    if isinstance(exc, httpx.HTTPError):
                        raise TurnoutError(f"{type(exc).__name__}: {exc}") from None
                    raise
                log.warning("%s failed (%s); retrying in %.1f s", what, exc, delay_s)
            await asyncio.sleep(delay_s * (0.5 + random.random() / 2))
            delay_s = min(delay_s * 2, MAX_BACKOFF_S)

    def remove_if_empty(self, files: TaskFiles) -> bool:
        """Remove the attempt's directories if nothing is in them (the common case); whether both are gone."""
        gone = True
        for d in (files.scratch, files.output_dir):
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                gone = False
        return gone

    def cleanup(self, files: TaskFiles) -> None:
        """Remove the attempt's directories and all in them (blocking: large files take a while)."""
        for d in (files.scratch, files.output_dir):
            shutil.rmtree(d, ignore_errors=True)


def _transient(exc: TurnoutError) -> bool:
    """Answers about the controller, not the request: 5xx, 429, and tokens or workers it does not know yet."""
    from turnout.errors import RateLimited, Unauthorized, Unavailable

    return isinstance(exc, Unavailable | RateLimited | Unauthorized) or type(exc) is TurnoutError


def _into_objects(path: Path, shared: Blobs, file_id: str) -> None:
    """Move an output into the shared storage's objects/ (a rename: the output directory is in its tmp/)."""
    with open(path, "rb") as fh:  # durable before it is named: the controller records it as it finds it
        os.fsync(fh.fileno())
    final = shared.path(file_id)
    os.rename(path, final)
    with contextlib.suppress(OSError):
        os.chmod(final, 0o600)
    fsync_dir(shared.objects)


def _with_files(output: Any, refs: dict[str, dict[str, str]]) -> Any:
    """The handler's output with its files under `files`: merged into an object, or beside another value."""
    if output is None:
        return {"files": refs}
    if isinstance(output, dict):
        mine = output.get("files")
        if mine is None:
            return {**output, "files": refs}
        if isinstance(mine, dict):
            return {**output, "files": {**mine, **refs}}
        raise TaskFileError({"type": "invalid_output", "field": "output.files",
                             "message": "output.files: the handler returned a `files` value that is not an object, "
                                        "and also wrote files under its output directory"})  # fmt: skip
    return {"value": output, "files": refs}
