"""Child processes that speak the JSON-lines event protocol (their pools: `pools.py`).

One implementation serves warm Python handlers (`runner.py`) and command workers: the child reads a task
as one JSON line on stdin and writes JSON events on stdout, `finish` last; stderr lines become `log`
events; a line that is not a JSON object becomes a `log` event, never a crash. Each child leads its own
process group, so a timeout or cancel kills everything it started, and holds a lifeline pipe whose other
end only the worker holds, so it dies with the worker. Where the host allows (`containment.py`), the
kernel backs this up without the child's cooperation: parent-death SIGKILL set before exec, a cgroup per
process killed as a whole (which holds children that called `setsid`), or a PID namespace; `isolation`
on each outcome says which were applied. When the group's leader exits, the rest of its group is killed
at once: a forked child that outlives its parent would otherwise hold the pipes open and hide the exit
(asyncio's `wait()` resolves only once every pipe has closed, so exits are watched by a pidfd).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnout.worker import containment
from turnout.worker.containment import Containment, Isolation

log = logging.getLogger("turnout.worker")
EventSink = Callable[[dict[str, Any]], None]
STREAM_LIMIT = 64 * 1024 * 1024  # one protocol line (a large result) may be this long
EXIT_POLL_S = 0.02


@dataclass
class Outcome:
    succeeded: bool
    output: Any = None
    error: dict[str, Any] | None = None
    run_s: float = 0.0
    started_at: float = field(default_factory=time.time)
    isolation: Isolation | None = None  # what held the process that ran it (containment.py)
    ready_at: float | None = None  # when a fresh Python process finished its setup (the runner says)
    peak_rss_bytes: int | None = None  # the process's peak RAM so far (the runner says)
    peak_gpu_memory_bytes: int | None = None  # torch's peak CUDA allocation during the task (the runner says)


class ProtocolProcess:
    """One live child. `run()` sends one task and collects its events until `finish`."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], *, cwd: str | None = None, lifeline_arg: bool = False,
                 default_timeout_s: float | None = None, one_task: bool = False,
                 cleanup_argv: Sequence[str] | None = None, contain: Containment | None = None) -> None:  # fmt: skip
        self.argv = list(argv)
        self.env = env
        self.cwd = cwd
        self.lifeline_arg = (
            lifeline_arg  # append "<worker pid> <lifeline fd>" to argv (the runner, the guard)
        )
        self.default_timeout_s = default_timeout_s  # for tasks that set no timeout of their own
        self.one_task = one_task  # close stdin after the task's line: a one-off program may read to EOF
        self.cleanup_argv = list(
            cleanup_argv or []
        )  # run when killed alive, for what outlives the group (a container)
        self.contain = contain  # default: the worker's (`containment.current()`), resolved at start
        # what held and confined it, recorded on its tasks: keys its maker knows (a sandbox's, a container's),
        # set before `start`, joined at start by what containment applied (`launch.confirm`)
        self.isolation: Isolation | None = None
        self._cgroup: Path | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self._lifeline_w: int | None = None
        self._group_gone = False  # its group was killed after the leader exited; the pgid may be reused now
        self._exit_task: asyncio.Task[None] | None = None
        self._sink: EventSink | None = None
        self._stderr_tail: deque[str] = deque(maxlen=20)
        self._stderr_task: asyncio.Task[None] | None = None
        self.last_used = time.monotonic()
        self.tasks_served = 0
        self.spawned_at: float | None = (
            None  # epoch seconds when start() began: a cold start counts from here
        )

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self) -> None:
        self.spawned_at = time.time()
        launch = (self.contain or containment.current()).launch()
        read_end, self._lifeline_w = os.pipe()
        # PID 1 of a new namespace sees its parent (unshare, outside it) as pid 0
        parent = 0 if launch.pid_namespace else os.getpid()
        argv = launch.prefix + self.argv + ([str(parent), str(read_end)] if self.lifeline_arg else [])
        try:
            # Forked from the event loop's thread, which lives as long as the worker: the parent-death
            # signal fires when the forking thread ends, not only the process.
            self.proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env=self.env, cwd=self.cwd, start_new_session=True, pass_fds=(read_end,), limit=STREAM_LIMIT,
                preexec_fn=launch.preexec,
            )  # fmt: skip
        except BaseException:
            launch.abandon()
            os.close(self._lifeline_w)
            self._lifeline_w = None
            raise
        finally:
            os.close(read_end)
        self.isolation = {**launch.confirm(self.proc.pid), **(self.isolation or {})}
        self._cgroup = launch.cgroup
        self._stderr_task = asyncio.create_task(self._read_stderr())
        self._exit_task = asyncio.create_task(self._kill_group_on_exit())

    async def _wait_exit(self) -> int:
        """The exit code, as soon as the child exits (not when its pipes close, which a forked child may delay).

        A pidfd makes this one wake-up instead of polling, so forty idle warm processes cost nothing.
        """
        assert self.proc
        try:
            pidfd = os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):  # not Linux >= 5.3, or already reaped: poll below
            pidfd = None
        if pidfd is not None:
            loop = asyncio.get_running_loop()
            exited: asyncio.Future[None] = loop.create_future()

            def on_exit() -> None:
                if not exited.done():
                    exited.set_result(None)

            loop.add_reader(pidfd, on_exit)
            try:
                await exited
            finally:
                loop.remove_reader(pidfd)
                os.close(pidfd)
        while self.proc.returncode is None:  # the exit happened; the child watcher records the code shortly
            await asyncio.sleep(EXIT_POLL_S)
        return self.proc.returncode

    async def _kill_group_on_exit(self) -> None:
        await self._wait_exit()
        self.kill()
        self._group_gone = True
        await self._remove_cgroup()

    async def _remove_cgroup(self) -> None:
        """Remove the process's cgroup once the kill has emptied it (what stays is the warden's to remove)."""
        path = self._cgroup
        if path is None:
            return
        deadline = time.monotonic() + containment.EMPTY_WAIT_S
        while containment.populated(path) and time.monotonic() < deadline:
            await asyncio.sleep(EXIT_POLL_S)
        if containment.remove_cgroup(path):
            self._cgroup = None

    async def _read_stderr(self) -> None:
        assert self.proc and self.proc.stderr
        while True:
            try:
                raw = await self.proc.stderr.readline()
            except (ValueError, asyncio.LimitOverrunError):
                continue
            if not raw:
                return
            line = raw.decode(errors="replace").rstrip("\n")
            self._stderr_tail.append(line)
            if self._sink:
                self._sink({"event": "log", "stream": "stderr", "line": line})

    async def run(self, task_line: str, sink: EventSink, timeout_s: float | None) -> Outcome:
        """Send one task, stream its events to `sink`; kill the process group on timeout or cancel."""
        assert self.proc and self.proc.stdin and self.proc.stdout
        self._sink = sink
        self._stderr_tail.clear()
        started = time.time()
        timeout_s = timeout_s if timeout_s is not None else self.default_timeout_s
        try:
            self.proc.stdin.write(task_line.encode() + b"\n")
            await self.proc.stdin.drain()
            if self.one_task:
                self.proc.stdin.close()
            outcome = await asyncio.wait_for(self._collect(sink, started), timeout=timeout_s)
        except asyncio.TimeoutError:
            self.kill()
            message = f"ran longer than timeout_s={timeout_s:g}; its process group was killed"
            outcome = Outcome(False, error={"type": "timeout", "message": message}, started_at=started)
        except (BrokenPipeError, ConnectionResetError):
            outcome = await self._exited(started)
        except asyncio.CancelledError:
            self.kill()
            raise
        finally:
            self._sink = None
        outcome.run_s = time.time() - started
        outcome.isolation = self.isolation
        self.tasks_served += 1
        self.last_used = time.monotonic()
        return outcome

    async def _collect(self, sink: EventSink, started: float) -> Outcome:
        assert self.proc and self.proc.stdout
        output: Any = None
        have_result = False
        last_text: str | None = None
        while True:
            try:
                raw = await self.proc.stdout.readline()
            except (ValueError, asyncio.LimitOverrunError):
                sink(
                    {
                        "event": "log",
                        "stream": "stdout",
                        "line": "(line longer than the protocol limit dropped)",
                    }
                )
                continue
            if not raw:
                return await self._exited(started)
            text = raw.decode(errors="replace").strip()
            if not text:
                continue
            try:
                event = json.loads(text)
            except ValueError:
                event = None
            if not isinstance(event, dict) or not isinstance(event.get("event"), str):
                sink({"event": "log", "stream": "stdout", "line": text})
                continue
            kind = event["event"]
            if kind == "result":
                output, have_result = event.get("data"), True
            elif kind == "text":
                last_text = event.get("content")
                sink(event)
            elif kind == "finish":
                facts = _finish_facts(event)
                if event.get("status") == "completed":
                    if not have_result and last_text is not None:
                        output = {"text": last_text}
                    return Outcome(True, output=output, started_at=started, **facts)
                error = event.get("error")
                if not isinstance(error, dict):
                    error = {"type": "failed", "message": str(error or "the worker program reported failure")}
                return Outcome(False, error=error, started_at=started, **facts)
            else:
                sink(event)

    async def _exited(self, started: float) -> Outcome:
        code = await self._wait_exit()
        if self._stderr_task:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._stderr_task), 1.0)
        self.kill()  # whatever it left behind in its group goes too
        tail = "\n".join(self._stderr_tail)
        message = f"the process exited with code {code} before finishing" + (
            f"; last stderr:\n{tail}" if tail else ""
        )
        return Outcome(
            False, error={"type": "process_exited", "message": message, "exit_code": code}, started_at=started
        )

    def kill(self) -> None:
        """SIGKILL the whole process group (the child and anything it forked) and its cgroup (what left the
        group with `setsid` too)."""
        if self._cgroup is not None:
            containment.kill_cgroup(self._cgroup)
        if self.proc is not None and not self._group_gone:
            alive = self.proc.returncode is None
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            if alive and self.cleanup_argv:
                with contextlib.suppress(OSError):
                    subprocess.Popen(self.cleanup_argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True, env=self.env)  # fmt: skip
        if self._lifeline_w is not None:
            with contextlib.suppress(OSError):
                os.close(self._lifeline_w)
            self._lifeline_w = None

    async def close(self) -> None:
        self.kill()
        if self.proc is not None:
            await self._wait_exit()
        await self._remove_cgroup()
        for task in (self._stderr_task, self._exit_task):
            if task:
                task.cancel()


def _finish_facts(event: dict[str, Any]) -> dict[str, Any]:
    """What a `finish` event may say about the process (the Python runner says it; other programs may too)."""
    out: dict[str, Any] = {}
    ready = event.get("ready_at")
    if isinstance(ready, int | float) and not isinstance(ready, bool):
        out["ready_at"] = float(ready)
    for key in ("peak_rss_bytes", "peak_gpu_memory_bytes"):
        value = event.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53:
            out[key] = value
    return out


class RefusedProcess(ProtocolProcess):
    """Stands in for a process that cannot start on this worker: each task fails with `error`, the worker lives."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__([], {})
        self.error = error

    async def start(self) -> None:
        return None

    async def run(self, task_line: str, sink: EventSink, timeout_s: float | None) -> Outcome:
        return Outcome(False, error=dict(self.error))
