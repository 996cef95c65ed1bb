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
import math
import os
import re
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
from turnout.worker.reports import TASK_TAG, event_name_problem, readable

log = logging.getLogger("turnout.worker")
EventSink = Callable[[dict[str, Any]], None]
STREAM_LIMIT = 64 * 1024 * 1024  # one protocol line (a large result) may be this long
LOG_LINE_LIMIT = 64 * 1024  # one log line (stderr, or stdout that is not JSON) is cut to this many bytes
TAIL_LINE_CHARS = 4000  # each of the last stderr lines a `process_exited` error quotes
EXIT_POLL_S = 0.02
ERROR_MESSAGE_CHARS = 100_000  # as the runner caps a handler's message
MAX_ERROR_EXTRA = 4096  # a program's error fields beyond type and message are kept up to this much JSON
ERROR_TYPE = re.compile(r"[a-z][a-z0-9_.-]{0,63}\Z")
# error types only Turnout decides (its controller's verdicts, what it retries, what its worker measured): a
# program that reports one fails `failed`, its claim quoted in the message. `gpu_oom` is a program's to say.
TURNOUT_VERDICTS = frozenset({
    "worker_lost", "timeout", "cancelled", "no_capacity", "stage_failed", "gpu_scrub_failed", "gpu_quarantined",
    "gpu_memory_exceeded", "process_exited", "worker_error", "not_served", "sandbox_unavailable",
    "docker_unavailable", "input_file_missing", "input_file_unavailable", "output_upload_failed",
    "output_too_large", "output_refused",
})  # fmt: skip
_TAGGED_HEAD = re.compile(rb'\{"%s": (\d+)' % TASK_TAG.encode())


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
    # a batch's per-item failures (the runner's `item_errors`): None, or one error or None per input
    item_errors: list[dict[str, Any] | None] | None = None


@dataclass
class _Task:
    """The task a process is running: where its events go and what its lines said so far."""

    seq: int
    sink: EventSink
    started: float
    done: asyncio.Future[Outcome]
    output: Any = None
    have_result: bool = False
    last_text: Any = None
    item_errors: Any = None
    too_long: str | None = None  # the field ("output", "events") of the first line dropped for its length


class ProtocolProcess:
    """One live child. `run()` sends one task and collects its events until `finish`.

    Each line the child writes belongs to the task in flight, from its line's writing to its `finish`; what it
    writes between tasks is no task's. A `tagged` child (the Python runner) numbers its lines with the task
    they belong to, so a line of an earlier task (a handler's thread emitting after it returned) is dropped
    and the child stays warm. An untagged child (a command) that writes after its `finish` is out of step:
    it is killed, never reused, so no task ever receives another task's lines.
    """

    def __init__(self, argv: Sequence[str], env: dict[str, str], *, cwd: str | None = None, lifeline_arg: bool = False,
                 default_timeout_s: float | None = None, one_task: bool = False,
                 cleanup_argv: Sequence[str] | None = None, contain: Containment | None = None,
                 tagged: bool = False) -> None:  # fmt: skip
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
        self.tagged = tagged  # its task lines carry TASK_TAG and so does each line it writes (the runner)
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
        self._stdout_task: asyncio.Task[None] | None = None  # reads every line, from the first task on
        self._stdout_closed = False
        self._current: _Task | None = None
        self._seq = 0
        self._killed = False
        self.out_of_step = False  # wrote between tasks: killed, and never reused
        self.stray_lines = 0  # lines dropped as no task's
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
            raw, dropped = await read_line(self.proc.stderr, LOG_LINE_LIMIT)
            if not raw and not dropped:
                return
            line = log_line(raw, dropped)
            self._stderr_tail.append(readable(line, TAIL_LINE_CHARS))
            if self._sink:
                self._sink({"event": "log", "stream": "stderr", "line": line})

    async def run(self, task_line: str, sink: EventSink, timeout_s: float | None) -> Outcome:
        """Send one task, stream its events to `sink`; kill the process group on timeout or cancel.

        The timeout covers the whole run, the writing of the task's line included (a program that never
        reads a line larger than its pipe holds would block that write for ever)."""
        assert self.proc and self.proc.stdin and self.proc.stdout
        self._seq += 1
        started = time.time()
        current = _Task(self._seq, sink, started, asyncio.get_running_loop().create_future())
        if self.tagged:
            task_line = with_tag(task_line, current.seq)
        self._sink = sink
        self._stderr_tail.clear()
        self._current = current
        if self._stdout_task is None:  # what it wrote before its first task (setup's events) is that task's
            self._stdout_task = asyncio.create_task(self._read_stdout())
        timeout_s = timeout_s if timeout_s is not None else self.default_timeout_s
        try:
            outcome = await asyncio.wait_for(self._send(task_line, current), timeout=timeout_s)
        except asyncio.TimeoutError:
            self.kill()
            message = f"ran longer than timeout_s={timeout_s:g}; its process group was killed"
            outcome = Outcome(False, error={"type": "timeout", "message": message}, started_at=started)
        except (BrokenPipeError, ConnectionResetError):
            reported = current.done
            if reported.done() and not reported.cancelled() and reported.exception() is None:
                outcome = reported.result()  # it finished without reading all of its line
            else:
                outcome = await self._exited(started)
        except asyncio.CancelledError:
            self.kill()
            raise
        finally:
            if self._current is current:
                self._current = None
            self._sink = None
        outcome.run_s = time.time() - started
        outcome.isolation = self.isolation
        self.tasks_served += 1
        self.last_used = time.monotonic()
        return outcome

    async def _send(self, task_line: str, current: _Task) -> Outcome:
        assert self.proc and self.proc.stdin
        if self._stdout_closed:  # it closed its stdout: no event of this task can come
            return await self._exited(current.started)
        self.proc.stdin.write(task_line.encode() + b"\n")
        await self.proc.stdin.drain()
        if self.one_task:
            self.proc.stdin.close()
        return await current.done

    async def _read_stdout(self) -> None:
        """Every line the child writes, for as long as it writes: each goes to the task it belongs to, or none."""
        assert self.proc and self.proc.stdout
        try:
            while True:
                raw, dropped = await read_line(self.proc.stdout, LOG_LINE_LIMIT)
                if not raw and not dropped:
                    break
                self._line(raw, dropped)
        except Exception as exc:  # a bug here must fail the task in flight, not leave it waiting
            log.exception("process %s: reading its output failed", self.pid)
            current = self._current
            if current is not None and not current.done.done():
                current.done.set_exception(exc)
            return
        self._stdout_closed = True
        current = self._current
        if current is not None:
            self._end(current, await self._exited(current.started))

    def _end(self, current: _Task, outcome: Outcome) -> None:
        """The task's last line was read: from here on, what the child writes is no task's until the next."""
        if self._current is current:
            self._current = None
        if not current.done.done():
            current.done.set_result(outcome)

    def _line(self, raw: bytes, dropped: int) -> None:
        current = self._current
        if dropped:  # longer than STREAM_LIMIT: `raw` is its head, the rest was never held
            tag = _TAGGED_HEAD.match(raw)
            if current is None or (self.tagged and (tag is None or not self._is_current(int(tag.group(1))))):
                self._stray(raw[:200].decode(errors="replace") + "...")
                return
            if not raw.lstrip().startswith(b"{"):  # plain text, not an event: its head is kept as a log line
                current.sink({"event": "log", "stream": "stdout", "line": log_line(raw, dropped)})
                return
            is_result = re.search(rb'"event"\s*:\s*"result"', raw[:300]) is not None
            current.too_long = current.too_long or ("output" if is_result else "events")
            note = f"(a line of {dropped:,} bytes, over the protocol's {STREAM_LIMIT // 2**20} MiB limit, was dropped)"
            current.sink({"event": "log", "stream": "stdout", "line": note})
            return
        text = raw.decode(errors="replace").strip()
        if not text:
            return
        try:
            event = json.loads(text)
        except ValueError:
            event = None
        if self.tagged:
            tag = event.get(TASK_TAG) if isinstance(event, dict) else None
            if current is None or type(tag) is not int or not self._is_current(tag):
                self._stray(text)
                return
            del event[TASK_TAG]
        elif current is None:
            self._stray(text)
            return
        assert current is not None
        if not isinstance(event, dict) or not isinstance(event.get("event"), str):
            current.sink({"event": "log", "stream": "stdout", "line": log_line(raw.strip(), 0)})
            return
        kind = event["event"]
        why = event_name_problem(kind)
        if why is not None:  # never forwarded as a name: the events stream writes names raw
            line = f"({why}; the line is kept here) " + log_line(raw.strip(), 0)
            current.sink({"event": "log", "stream": "stdout", "line": line})
            return
        if kind == "result":
            current.output, current.have_result = event.get("data"), True
            current.item_errors = event.get("item_errors")
        elif kind == "text":
            current.last_text = event.get("content")
            current.sink(event)
        elif kind == "finish":
            self._end(current, self._finished(current, event))
        else:
            current.sink(event)

    def _is_current(self, tag: int) -> bool:
        """Whether a line tagged `tag` is the task in flight's: its number, or 0 (setup's) during the first."""
        return tag == self._seq or (tag == 0 and self._seq == 1)

    def _finished(self, current: _Task, event: dict[str, Any]) -> Outcome:
        facts = _finish_facts(event, self.spawned_at)
        if event.get("status") == "completed":
            if current.too_long is not None:
                why = (f"a line of its {'result' if current.too_long == 'output' else 'events'} was longer than "
                       f"the protocol's {STREAM_LIMIT // 2**20} MiB limit and was dropped (write a large result "
                       "as files: ctx.output_dir, or TURNOUT_OUTPUT_DIR for a command)")  # fmt: skip
                error = {
                    "type": "output_too_large",
                    "field": current.too_long,
                    "message": f"{current.too_long}: {why}",
                }
                return Outcome(False, error=error, started_at=current.started, **facts)
            output = current.output
            if not current.have_result and current.last_text is not None:
                output = {"text": current.last_text}
            return Outcome(True, output=output, started_at=current.started,
                           item_errors=_item_errors(current.item_errors), **facts)  # fmt: skip
        return Outcome(False, error=reported_error(event.get("error")), started_at=current.started, **facts)

    def _stray(self, text: str) -> None:
        """A line no task may have: dropped with a log line. An untagged child that writes between tasks is out
        of step with its tasks (a second `finish`, a late event): it is killed, and never gets another task."""
        self.stray_lines += 1
        if self._killed:
            return
        shown = readable(text, 200)
        if (
            self.one_task
        ):  # its one task is over (a program may say goodbye as it exits): nothing to keep in step
            log.debug("process %s: dropped a line written after its task's finish: %s", self.pid, shown)
            return
        if self.tagged:
            if self.stray_lines <= 3:
                log.warning("process %s: dropped a line of no task in flight (a handler's thread that outlived "
                            "its task?): %s", self.pid, shown)  # fmt: skip
            return
        if not self.out_of_step:
            self.out_of_step = True
            log.warning("process %s wrote after its task's finish, so its lines no longer match its tasks; it is "
                        "killed and not reused. The line: %s", self.pid, shown)  # fmt: skip
            self.kill()

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
        self._killed = True
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
        for task in (self._stderr_task, self._exit_task, self._stdout_task):
            if task:
                task.cancel()


async def read_line(stream: asyncio.StreamReader, keep: int) -> tuple[bytes, int]:
    """The next line, (line, 0); (b"", 0) at the end. A line longer than the stream's limit is read to its end
    and dropped whole, never split into lines: (its first `keep` bytes, its length)."""
    try:
        return await stream.readuntil(b"\n"), 0
    except asyncio.IncompleteReadError as exc:  # the end, after a last line without its newline
        return exc.partial, 0
    except asyncio.LimitOverrunError as exc:
        pending = exc.consumed
    head, dropped = b"", 0
    while True:  # the buffer holds `pending` bytes of the line, none of them its end
        chunk = await stream.read(pending)
        head = head or chunk[:keep]
        dropped += len(chunk)
        try:
            return head, dropped + len(await stream.readuntil(b"\n")) - 1  # its length without the newline
        except asyncio.IncompleteReadError as exc:
            return head, dropped + len(exc.partial)
        except asyncio.LimitOverrunError as exc:
            pending = exc.consumed


def log_line(raw: bytes, dropped: int = 0) -> str:
    """A log line as it is kept: at most LOG_LINE_LIMIT bytes of it, with a note saying how long it was."""
    body = raw if dropped else raw.rstrip(b"\r\n")
    total = dropped or len(body)
    if len(body) > LOG_LINE_LIMIT or dropped:
        kept = body[:LOG_LINE_LIMIT]
        return kept.decode(errors="replace") + f" [line cut: {total:,} bytes, the first {len(kept):,} kept]"
    return body.decode(errors="replace")


def with_tag(task_line: str, seq: int) -> str:
    """A task's JSON object line with TASK_TAG first (the runner tags each line of that task with it)."""
    body = task_line.strip()
    if not body.startswith("{"):
        raise ValueError("a tagged process takes a JSON object per task")
    rest = body[1:].lstrip()
    return f'{{"{TASK_TAG}": {seq}' + ("}" if rest.startswith("}") else ", " + rest)


def reported_error(error: Any) -> dict[str, Any]:
    """A program's own `error` as a task's: `{type, message}` (and the runner's bounded `traceback`, `field`).

    `type` is a short identifier, "failed" when it gives none; one only Turnout decides (a timeout, a lost
    worker: see TURNOUT_VERDICTS) is not taken from a program, and the message says what it claimed. Its
    other fields are kept as they are while they are small (MAX_ERROR_EXTRA characters of JSON), else dropped
    with a note in the message."""
    fields = error if isinstance(error, dict) else {"message": error}
    claimed, message = fields.get("type"), fields.get("message")
    if not isinstance(message, str):
        message = "" if message is None else _short_json(message, ERROR_MESSAGE_CHARS)
    message = message or "the worker program reported failure"
    kind = "failed"
    if claimed is None:
        pass
    elif not isinstance(claimed, str) or not ERROR_TYPE.match(claimed):
        message = f"(it reported an error type that is not a short identifier: {_short_json(claimed, 100)}) {message}"
    elif claimed in TURNOUT_VERDICTS:
        message = f"(it reported error type {claimed!r}, which only Turnout decides) {message}"
    else:
        kind = claimed
    out: dict[str, Any] = {"type": kind, "message": readable(message, ERROR_MESSAGE_CHARS)}
    for key, limit in (("traceback", 8000), ("field", 300)):
        if isinstance(fields.get(key), str):
            out[key] = readable(fields[key], limit)
    rest = {k: v for k, v in fields.items() if k not in ("type", "message", "traceback", "field")}
    try:  # NaN counts here: what JSON cannot carry fails the task naming it (`reports.checked_completion`)
        size = len(json.dumps(rest, ensure_ascii=False)) if rest else 0
    except (ValueError, TypeError, RecursionError):
        size = MAX_ERROR_EXTRA + 1
    if size <= MAX_ERROR_EXTRA:
        out.update({k: v for k, v in rest.items() if k not in out})
    else:
        out["message"] = readable(f"{out['message']} (its other fields, {size:,} characters, were dropped)",
                                  ERROR_MESSAGE_CHARS)  # fmt: skip
    return out


def _short_json(value: Any, limit: int) -> str:
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
    except (ValueError, TypeError, RecursionError):
        text = "(not JSON)"
    return readable(text, limit)


def _item_errors(value: Any) -> list[dict[str, Any] | None] | None:
    """A batch's per-item errors as the runner wrote them, each a reported error; None when there are none."""
    if not isinstance(value, list) or not any(isinstance(e, dict) for e in value):
        return None
    return [reported_error(e) if isinstance(e, dict) else None for e in value]


def _finish_facts(event: dict[str, Any], spawned_at: float | None = None) -> dict[str, Any]:
    """What a `finish` event may say about the process (the Python runner says it; other programs may too).

    `ready_at` counts only when it is a time between the process's start and now: a program may say anything."""
    out: dict[str, Any] = {}
    ready = event.get("ready_at")
    if isinstance(ready, int | float) and not isinstance(ready, bool) and math.isfinite(ready):
        when = float(ready)
        if spawned_at is not None and spawned_at <= when <= time.time():
            out["ready_at"] = when
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
