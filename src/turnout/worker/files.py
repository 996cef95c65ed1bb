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
import collections
import contextlib
import functools
import itertools
import json
import logging
import os
import queue
import random
import secrets
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from turnout.blobs import FILE_ID, Blobs, fsync_dir, new_file_id
from turnout.errors import Conflict, NotFound, PayloadTooLarge, TurnoutError
from turnout.files import FileCorrupt, download, file_ref, refs_in, upload, walk_files
from turnout.worker.containment import owner_alive, worker_tag

log = logging.getLogger("turnout.worker")
TRANSFER_PATIENCE_S = 300.0  # how long a transfer keeps retrying while the controller cannot be reached
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0
# an output directory in a shared storage's tmp/ untouched this long is touched (`keep_in_use`), well within
# the day after which that storage's sweep removes it (`blobs.TMP_MAX_AGE_S`)
KEEP_ALIVE_S = 3600.0
# files one task may leave in its output directory: each is an upload and a record, and a handler that leaves
# a million would hold its worker for an hour and flood the controller's records; pack many into an archive
MAX_OUTPUT_FILES = 10_000


class TaskFileError(Exception):
    """A task cannot run (an input) or cannot report (an output) because of a file: its task fails so."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error["message"])
        self.error = error


SCRATCH_PREFIX = "turnout-worker-"


def own_scratch(base: Path | None = None) -> Path:
    """A fresh 0700 scratch directory in `base` (the temporary directory) named by this worker's tag, made
    after removing those whose workers are gone: a SIGKILLed worker cannot remove its own, and its tasks'
    files would stay on the disk, one directory per kill. Workers of another PID namespace must not share
    `base`, as for the stale cgroups (`containment.sweep_stale`)."""
    base = Path(tempfile.gettempdir()) if base is None else base
    for stale in stale_scratch(base):
        shutil.rmtree(stale, ignore_errors=True)
        log.info("removed %s, the scratch directory of a worker that is gone", stale)
    return Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{worker_tag()}-", dir=base))


def stale_scratch(base: Path) -> list[Path]:
    """The scratch directories in `base` of this user's workers on this host that are gone. One named otherwise
    (an older version's, another program's), a link, or another user's is not this worker's to judge, and stays."""
    found = []
    with contextlib.suppress(OSError):
        for path in base.iterdir():
            if not path.name.startswith(SCRATCH_PREFIX):
                continue
            with contextlib.suppress(OSError):
                info = path.lstat()  # a link is never followed, and only this user's directories are judged
                tag = path.name[len(SCRATCH_PREFIX) :].rpartition("-")[0]
                if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and owner_alive(tag) is False:
                    found.append(path)
    return sorted(found)


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
        self.scratch = Path(scratch) if scratch is not None else own_scratch()
        self.scratch.mkdir(parents=True, exist_ok=True)
        if self.shared is not None:
            self.shared.ensure()
        # outputs a rename away from objects/ where there is a shared storage
        self._outputs = _Directories(self.shared.tmp if self.shared is not None else self.scratch)
        # the output directories of attempts under way, in the shared storage's tmp/ (`keep_in_use`)
        self._in_use: dict[Path, None] = {}

    @property
    def route(self) -> str:
        """This worker's file routes: its token and secret (on `http`) prove who asks, for tasks it holds."""
        return f"/v1/workers/{self.worker_id}/files"

    def close(self) -> None:
        self._outputs.close()
        if self._own_scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)

    async def prepare(self, lease: dict[str, Any], *, make_output: bool = True) -> TaskFiles:
        """The attempt's directories and local copies (or shared paths) of its input files.

        A task with no input file gets no scratch directory. Its output directory is only named when its
        program makes it at first use (`make_output=False`: the Python runner), else it was made ahead
        (`_Directories`): the common task costs the event loop no change to the file system."""
        task_id, attempt = lease["id"], lease["attempt"]
        refs = refs_in(lease.get("input"))
        scratch = self.scratch / f"{task_id}-{attempt}"
        if refs:
            shutil.rmtree(scratch, ignore_errors=True)  # a retry of this attempt on this worker starts clean
            scratch.mkdir(mode=0o700, parents=True)
        files = TaskFiles(scratch, self._outputs.take() if make_output else self._outputs.name())
        if self.shared is not None:
            self._in_use[files.output_dir] = None
        try:
            for where, file_id in refs:
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
            # a regular file, never a link: whoever can write to the storage could put one there to any file
            # of this host; the controller serves no such file either (`Blobs.open`), so it is fetched instead
            with contextlib.suppress(OSError):
                if stat.S_ISREG(in_place.lstat().st_mode):
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
        if not _holds(files.output_dir):  # the common case, seen with one read: no walk on a thread
            return output
        found = await asyncio.get_running_loop().run_in_executor(
            None, lambda: list(itertools.islice(walk_files(files.output_dir), MAX_OUTPUT_FILES + 1))
        )
        if not found:
            return output
        if len(found) > MAX_OUTPUT_FILES:  # refused before any is sent: none of them is kept
            raise TaskFileError({"type": "output_too_large", "field": "output_dir",
                                 "message": f"output_dir: more than {MAX_OUTPUT_FILES:,} files; pack them into an "
                                            "archive (tar, zip) and leave that"})  # fmt: skip
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
        """Whether the attempt's directories hold nothing (the common case): those that are there are then
        removed behind, off the event loop, with anything written into them after this look."""
        there = []
        for d in (files.scratch, files.output_dir):
            held = _holds(d)
            if held:
                return False  # `cleanup` removes them
            if held is False:
                there.append(d)
        self._in_use.pop(files.output_dir, None)
        if there:
            self._outputs.remove_later(there)
        return True

    def keep_in_use(self, now: float | None = None) -> None:
        """Touch the output directories of the attempts under way that nothing touched for `KEEP_ALIVE_S`.

        They lie in the shared storage's tmp/, whose sweep (`Blobs.remove_stale_tmp`) removes what did not
        change for a day: a task may run longer than that and write its outputs only at its end. Blocking
        (a few stats): called off the event loop, with the heartbeat."""
        now = time.time() if now is None else now
        for d in list(self._in_use):
            with contextlib.suppress(OSError):
                if now - d.stat().st_mtime > KEEP_ALIVE_S:
                    os.utime(d)

    def cleanup(self, files: TaskFiles) -> None:
        """Remove the attempt's directories and all in them (blocking: large files take a while)."""
        self._in_use.pop(files.output_dir, None)
        for d in (files.scratch, files.output_dir):
            shutil.rmtree(d, ignore_errors=True)


class _Directories:
    """Empty output directories made ahead, and used ones removed behind, on a thread of their own.

    Making or removing a directory is a journaled change to the file system: beside a database's fsyncs
    a mkdir and an rmdir took 0.75 ms together (ext4, a 2-core VM), and a worker made and removed two per
    task on the event loop that also leases and reports for all its tasks. Each directory is handed out
    once, never reused, so nothing one task writes late can land in another's outputs. A Python handler's is
    only named here (`name`): the runner makes it if the handler uses it, most never do.
    """

    STOCK = 16  # made ahead: what a burst of leases takes before the thread catches up

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(mode=0o700, parents=True, exist_ok=True)  # where a runner makes a named one
        self._stock: collections.deque[Path] = collections.deque()
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="turnout-dirs", daemon=True)
        self._thread.start()
        for _ in range(self.STOCK):
            self._jobs.put(self._make)

    def name(self) -> Path:
        """A new directory's path under the root, not made: its user makes it at first use."""
        return _dir_name(self.root)

    def take(self) -> Path:
        """A new empty directory (0700) under the root."""
        while self._stock:
            made = self._stock.popleft()
            self._jobs.put(self._make)
            try:
                age = time.time() - made.stat().st_mtime
            except OSError:
                continue  # a shared storage's sweep removed it: it lay in its tmp/ for a day
            if age > KEEP_ALIVE_S:  # made long ago: from now on its task's, as new to that sweep
                with contextlib.suppress(OSError):
                    os.utime(made)
            return made
        return _new_dir(self.root)

    def remove_later(self, dirs: list[Path]) -> None:
        self._jobs.put(functools.partial(_remove, dirs))

    def close(self) -> None:
        """Remove the directories made ahead; wait for the removals asked for."""
        self._jobs.put(None)
        self._thread.join(timeout=30)
        _remove(list(self._stock))
        self._stock.clear()

    def _make(self) -> None:
        if len(self._stock) < self.STOCK:
            self._stock.append(_new_dir(self.root))

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except (
                OSError
            ) as exc:  # a full or failing disk: `take` makes its own, the removals wait for close
                log.debug("output directories: %s", exc)


def _dir_name(root: Path) -> Path:
    """A name no other directory had: 64 random bits, so a late or hostile writer cannot guess the next."""
    return root / f"out-{secrets.token_hex(8)}"


def _new_dir(root: Path) -> Path:
    path = _dir_name(root)
    path.mkdir(mode=0o700, parents=True)
    return path


def _remove(dirs: list[Path]) -> None:
    for d in dirs:
        try:
            d.rmdir()
        except FileNotFoundError:
            pass
        except OSError:  # something was written into it after it was seen empty
            shutil.rmtree(d, ignore_errors=True)


def _holds(path: Path) -> bool | None:
    """Whether the directory `path` holds anything (True also when it cannot be read), None when it is not
    there; one read of the directory, no write."""
    try:
        with os.scandir(path) as entries:
            return next(entries, None) is not None
    except FileNotFoundError:
        return None
    except OSError:
        return True


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
