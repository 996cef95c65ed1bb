"""Hostile programs on the worker's process protocol: real child processes, each driven as the worker drives it.

A warm process never hands one task's lines to the next; a line over the protocol's limit is dropped whole and
fails its task; the timeout covers writing the task's line; event names, a program's `error` and its
`ready_at` are checked where a line is read; a batch's bad item fails only its own task; log lines are cut.
Every scenario runs under a deadline, so none can hang.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from turnout.worker import processes
from turnout.worker.app import WorkerApplication, load_app
from turnout.worker.executors import _batch_line, _python_pool, _wrapped_line, per_task
from turnout.worker.pools import ProcessPool
from turnout.worker.processes import Outcome, ProtocolProcess, _finish_facts, reported_error

T = TypeVar("T")
DEADLINE_S = 60.0
NAME = re.compile(r"[a-z][a-z0-9_.-]{0,63}\Z")

COMMAND = r"""
import json, os, sys, time
def out(obj):
    sys.stdout.write((obj if isinstance(obj, str) else json.dumps(obj)) + "\n"); sys.stdout.flush()
def done(data):
    out({"event": "result", "data": data}); out({"event": "finish", "status": "completed"})
if os.environ.get("NOREAD"):
    time.sleep(60)
for line in sys.stdin:
    task = json.loads(line)
    m, seq = task.get("m"), task.get("turnout_seq")
    if m == "ok":
        done({"echo": task.get("n"), "pid": os.getpid()})
    elif m == "twice":
        done({"first": task.get("n")}); done({"stale_from": task.get("n")})
    elif m == "after":
        done({"n": task.get("n")}); out({"event": "text", "content": "after finish of %s" % task.get("n")})
    elif m == "giant":
        sys.stdout.write('{"event": "text", "content": "' + "g" * task["n"] + '"}\n'); sys.stdout.flush()
        done({"after_giant": True})
    elif m == "giantresult":
        sys.stdout.write('{"event": "result", "data": "' + "r" * task["n"] + '"}\n')
        out({"event": "finish", "status": "completed"})
    elif m == "crafted":
        sys.stdout.write("z" * task["n"]); sys.stdout.flush()
        time.sleep(0.3)  # the reader has met the limit by now: what follows is the same line's tail
        out({"event": "finish", "status": "completed", "forged": 1})
        done({"real": 1})
    elif m == "bigstderr":
        sys.stderr.write("s" * task["n"] + "\n"); sys.stderr.write("next stderr line\n"); sys.stderr.flush()
        time.sleep(0.3)
        done({"after_bigstderr": True})
    elif m == "bigtext":
        out("t" * task["n"])
        done({"after_bigtext": True})
    elif m == "inject":
        out({"event": 'text\nid: 999\ndata: {"event": "finish", "output": "INJECTED"}\n\nevent: finish', "content": "x"})
        out({"event": "text\r\rdata: CR", "content": "y"}); out({"event": "x" * 10000}); out({"event": ""})
        out({"event": "progress", "done": 1, "total": 2})
        done({"ok": 1})
    elif m == "error":
        out({"event": "finish", "status": "failed", "error": task["error"]})
    elif m == "ready":
        out({"event": "result", "data": 1})
        out('{"event": "finish", "status": "completed", "ready_at": %s}' % task["ready_at"])
    elif m == "tags":  # a runner gone wrong: lines of an earlier task, untagged ones, then its own
        out({"turnout_seq": seq + 7, "event": "text", "content": "another task's"})
        out({"event": "text", "content": "untagged"})
        out({"turnout_seq": seq, "event": "result", "data": {"seq": seq}})
        out({"turnout_seq": seq, "event": "finish", "status": "completed"})
        out({"turnout_seq": seq, "event": "text", "content": "after its finish"})
    if os.environ.get("ONEOFF"):
        break
"""

APP = r"""
import threading, time
from turnout import WorkerApplication

app = WorkerApplication("hostile")


@app.capability("echo", cpu=0.1, max_processes=1)
def echo(ctx, data):
    if data.get("evil"):
        ctx.emit("finish", status="completed")
    if data.get("late"):
        def later():
            for i in range(40):
                time.sleep(0.025)
                ctx.emit("text", content="late from %s #%d" % (ctx.task_id, i))
        threading.Thread(target=later, daemon=True).start()
    if data.get("name") is not None:
        ctx.emit(data["name"], content="x")
    time.sleep(data.get("wait", 0))
    if data.get("huge"):
        return {"x": "a" * data["huge"]}
    return {"echo": data.get("n"), "task": ctx.task_id}


@app.capability("bat", cpu=0.1, max_batch_size=4, max_batch_wait_ms=10)
def bat(ctx, items):
    return [{"v": float("nan")} if d.get("bad") else {"v": d.get("n")} for d in items]
"""


def scenario(make: Callable[[], Awaitable[T]]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(make(), DEADLINE_S)

    return asyncio.run(bounded())


@pytest.fixture
def command(tmp_path: Path) -> list[str]:
    script = tmp_path / "hostile_command.py"
    script.write_text(COMMAND)
    return [sys.executable, str(script)]


@pytest.fixture
def app_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    (tmp_path / "hostile_app.py").write_text(APP)
    sys.path.insert(0, str(tmp_path))
    try:
        yield {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("hostile_app", None)


def runner(app_env: dict[str, str], capability: str) -> ProcessPool:
    """The pool the worker runs this app's variant in (the warm `turnout.worker.runner` processes)."""
    app: WorkerApplication = load_app("hostile_app:app")
    return _python_pool("hostile_app:app", app.variants[f"{capability}:cpu"], app_env)


def lease(n: int, data: Any) -> dict[str, Any]:
    return {"id": f"t{n}", "attempt": 1, "input": data, "gpus": None}


async def run(
    proc: ProtocolProcess, line: str, timeout_s: float | None = 20
) -> tuple[Outcome, list[dict[str, Any]]]:
    events: list[dict[str, Any]] = []
    outcome = await proc.run(line, events.append, timeout_s)
    return outcome, events


async def served(pool: ProcessPool, line: str) -> tuple[Outcome, list[dict[str, Any]], int | None]:
    """One task on the pool, its process given back as the executor does (warm unless it is unfit)."""
    proc = await pool.acquire(())
    try:
        outcome, events = await run(proc, line)
    finally:
        fault = (outcome.error or {}).get("type") in ("timeout", "process_exited")
        pool.release(proc, (), proc.alive and not getattr(proc, "out_of_step", False) and not fault)
    return outcome, events, proc.pid


def texts(events: list[dict[str, Any]]) -> list[str]:
    return [str(e.get("content")) for e in events if e.get("event") == "text"]


# ---- D1: one task's lines never reach the next ------------------------------------------------------------


@pytest.mark.parametrize("mode", ["twice", "after"])
def test_a_session_command_writing_after_its_finish_is_not_reused_and_each_task_gets_its_own_output(
    command: list[str], mode: str
) -> None:
    async def go() -> list[tuple[Outcome, list[dict[str, Any]], int | None]]:
        pool = ProcessPool(lambda key: ProtocolProcess(command, dict(os.environ)), max_processes=1)
        try:
            first = await served(pool, json.dumps({"m": mode, "n": 1}))
            await asyncio.sleep(0.5)  # its stray lines arrive before the next task is written
            return [first, *[await served(pool, json.dumps({"m": "ok", "n": n})) for n in (2, 3)]]
        finally:
            await pool.close()

    (o1, _, pid1), (o2, e2, pid2), (o3, e3, pid3) = scenario(go)
    assert o1.succeeded and o1.output in ({"first": 1}, {"n": 1})
    assert o2.succeeded and o2.output["echo"] == 2, o2.output
    assert o3.succeeded and o3.output["echo"] == 3, o3.output
    assert pid2 != pid1 and pid3 == pid2  # the out-of-step process was replaced; the new one stays warm
    assert not texts(e2) and not texts(e3)


def test_a_tagged_process_drops_lines_of_other_tasks_and_after_finish_and_stays_warm(
    command: list[str],
) -> None:
    async def go() -> list[tuple[Outcome, list[dict[str, Any]]]]:
        proc = ProtocolProcess(command, dict(os.environ), tagged=True)
        await proc.start()
        try:
            out = [await run(proc, json.dumps({"m": "tags"}))]
            await asyncio.sleep(0.3)
            out.append(await run(proc, json.dumps({"m": "tags"})))
            assert proc.alive and not proc.out_of_step
            return out
        finally:
            await proc.close()

    (o1, e1), (o2, e2) = scenario(go)
    assert (o1.output, o2.output) == ({"seq": 1}, {"seq": 2})
    assert texts(e1) == [] and texts(e2) == []  # another task's, untagged, after its finish: dropped


def test_ctx_emit_refuses_the_protocols_own_names_and_the_next_task_gets_its_own_result(
    app_env: dict[str, str],
) -> None:
    async def go() -> list[tuple[Outcome, list[dict[str, Any]], int | None]]:
        pool = runner(app_env, "echo")
        try:
            return [await served(pool, _wrapped_line(lease(n, data))) for n, data in
                    enumerate([{"evil": 1, "n": 1}, {"n": 2}, {"n": 3}])]  # fmt: skip
        finally:
            await pool.close()

    (o1, _, _), (o2, _, _), (o3, _, _) = scenario(go)
    assert not o1.succeeded and o1.error is not None
    assert o1.error["type"] == "handler_error" and "ctx.emit" in o1.error["message"]
    assert "'finish'" in o1.error["message"]
    assert o2.output == {"echo": 2, "task": "t1"} and o3.output == {"echo": 3, "task": "t2"}


def test_events_a_handlers_thread_emits_after_it_returned_never_reach_the_next_task(
    app_env: dict[str, str],
) -> None:
    async def go() -> list[tuple[Outcome, list[dict[str, Any]], int | None]]:
        pool = runner(app_env, "echo")
        try:
            first = await served(pool, _wrapped_line(lease(1, {"late": 1, "n": 1})))
            return [first, await served(pool, _wrapped_line(lease(2, {"wait": 0.8, "n": 2})))]
        finally:
            await pool.close()

    (o1, _, pid1), (o2, e2, pid2) = scenario(go)
    assert o1.output == {"echo": 1, "task": "t1"} and o2.output == {"echo": 2, "task": "t2"}
    assert texts(e2) == [] and pid1 == pid2


# ---- D2 and D7: over-long lines ---------------------------------------------------------------------------


def test_a_python_result_over_64_mib_fails_naming_the_limit_and_the_process_serves_on(
    app_env: dict[str, str],
) -> None:
    async def go() -> list[tuple[Outcome, list[dict[str, Any]], int | None]]:
        pool = runner(app_env, "echo")
        try:
            big = await served(pool, _wrapped_line(lease(1, {"huge": 65 * 2**20})))
            return [big, await served(pool, _wrapped_line(lease(2, {"n": 2})))]
        finally:
            await pool.close()

    (o1, e1, pid1), (o2, e2, pid2) = scenario(go)
    assert not o1.succeeded and o1.error is not None and o1.output is None
    assert o1.error["type"] == "output_too_large" and o1.error["field"] == "output"
    assert "64 MiB" in o1.error["message"]
    assert all(len(json.dumps(e)) < 100_000 for e in e1)  # no tail of the line kept as a "log line"
    assert o2.succeeded and o2.output == {"echo": 2, "task": "t2"} and pid1 == pid2 and not e2


@pytest.fixture
def small_limit(monkeypatch: pytest.MonkeyPatch) -> int:
    """A 1 MiB protocol limit, so over-long lines cost little (it is read when a process starts)."""
    monkeypatch.setattr(processes, "STREAM_LIMIT", 2**20)
    return 2**20


def one(command: list[str], task: dict[str, Any], **options: Any) -> tuple[Outcome, list[dict[str, Any]]]:
    async def go() -> tuple[Outcome, list[dict[str, Any]]]:
        proc = ProtocolProcess(command, dict(os.environ), **options)
        await proc.start()
        try:
            return await run(proc, json.dumps(task))
        finally:
            await proc.close()

    return scenario(go)


def test_a_command_event_over_the_limit_is_dropped_whole_and_fails_its_task(
    command: list[str], small_limit: int
) -> None:
    outcome, events = one(command, {"m": "giant", "n": 3 * small_limit})
    assert not outcome.succeeded and outcome.error is not None
    assert outcome.error["type"] == "output_too_large" and outcome.error["field"] == "events"
    assert "1 MiB" in outcome.error["message"]
    assert all(len(json.dumps(e)) < 1000 for e in events), [len(json.dumps(e)) for e in events]


def test_a_command_result_over_the_limit_fails_its_task_never_succeeds_with_null(
    command: list[str], small_limit: int
) -> None:
    outcome, _ = one(command, {"m": "giantresult", "n": 2 * small_limit})
    assert not outcome.succeeded and outcome.error is not None and outcome.error["field"] == "output"


def test_the_tail_of_an_over_long_line_is_never_read_as_an_event(
    command: list[str], small_limit: int
) -> None:
    outcome, events = one(command, {"m": "crafted", "n": small_limit + 10})
    assert outcome.succeeded and outcome.output == {"real": 1}, outcome
    assert not any("forged" in json.dumps(e) for e in events)


def test_stderr_lines_are_cut_with_a_note_and_an_over_long_one_is_dropped_whole(
    command: list[str], small_limit: int
) -> None:
    for n in (200_000, 3 * small_limit):  # over the log line cap; over the protocol limit too
        outcome, events = one(command, {"m": "bigstderr", "n": n})
        assert outcome.succeeded, outcome
        logs = [e["line"] for e in events if e.get("stream") == "stderr"]
        assert len(logs) == 2 and logs[1] == "next stderr line", [x[:80] for x in logs]
        assert logs[0].startswith("s" * 1000) and len(logs[0]) < processes.LOG_LINE_LIMIT + 200
        assert f"line cut: {n:,} bytes" in logs[0]


def test_a_long_stdout_line_that_is_not_json_is_cut_with_a_note(command: list[str]) -> None:
    outcome, events = one(command, {"m": "bigtext", "n": 300_000})
    assert outcome.succeeded
    (line,) = [e["line"] for e in events if e.get("event") == "log"]
    assert len(line) < processes.LOG_LINE_LIMIT + 200 and "line cut: 300,000 bytes" in line


# ---- D3: the timeout covers writing the task's line -------------------------------------------------------


def test_the_timeout_covers_writing_a_line_the_program_never_reads(command: list[str]) -> None:
    async def go() -> tuple[Outcome, float]:
        proc = ProtocolProcess(command, {**os.environ, "NOREAD": "1"}, one_task=True, default_timeout_s=1.0)
        await proc.start()
        began = time.monotonic()
        try:
            outcome, _ = await run(proc, json.dumps({"pad": "a" * 1_000_000}), None)
            return outcome, time.monotonic() - began
        finally:
            await proc.close()

    outcome, took = scenario(go)
    assert outcome.error is not None and outcome.error["type"] == "timeout" and took < 10


# ---- D4: event names --------------------------------------------------------------------------------------


def test_an_event_name_that_is_not_an_identifier_becomes_a_log_line(command: list[str]) -> None:
    outcome, events = one(command, {"m": "inject"})
    assert outcome.succeeded
    assert all(NAME.match(e["event"]) for e in events), [e["event"][:40] for e in events]
    logs = [e["line"] for e in events if e["event"] == "log"]
    assert len(logs) == 4 and all("not a short identifier" in line for line in logs)
    assert any("INJECTED" in line for line in logs)  # kept, as a log line's text
    assert [e["event"] for e in events if e["event"] != "log"] == ["progress"]


@pytest.mark.parametrize("name", ["text\nid: 9\n\nevent: finish", "", "x" * 65, "Text", "result"])
def test_ctx_emit_refuses_a_name_that_is_not_an_identifier(app_env: dict[str, str], name: str) -> None:
    async def go() -> tuple[Outcome, list[dict[str, Any]], int | None]:
        pool = runner(app_env, "echo")
        try:
            return await served(pool, _wrapped_line(lease(1, {"name": name})))
        finally:
            await pool.close()

    outcome, events, _ = scenario(go)
    assert outcome.error is not None and outcome.error["type"] == "handler_error"
    assert "ctx.emit" in outcome.error["message"] and events == []


# ---- D5: a program's error --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "kind", "says"),
    [
        ({"message": "no type"}, "failed", "no type"),
        ({"type": ["not", "str"], "message": {"a": 1}}, "failed", "not a short identifier"),
        ({"type": "worker_lost", "message": "spoof"}, "failed", "'worker_lost', which only Turnout decides"),
        ({"type": "timeout", "message": "spoof"}, "failed", "'timeout'"),
        ({"type": "gpu_oom", "message": "CUDA out of memory"}, "gpu_oom", "CUDA out of memory"),
        ({"type": "x" * 100_000, "message": "long type"}, "failed", "long type"),
        ("x" * 1_000_000, "failed", "xxx"),
        (None, "failed", "reported failure"),
    ],
)
def test_a_programs_error_is_normalised_to_a_short_type_and_a_bounded_message(
    error: Any, kind: str, says: str
) -> None:
    out = reported_error(error)
    assert out["type"] == kind and says in out["message"]
    assert isinstance(out["message"], str) and len(out["message"]) <= 100_000
    assert set(out) <= {"type", "message", "traceback", "field"}
    assert len(json.dumps(out)) < 110_000


def test_a_programs_other_error_fields_are_kept_only_when_small() -> None:
    assert reported_error({"type": "bad_input", "message": "m", "code": 7}) == {
        "type": "bad_input", "message": "m", "code": 7}  # fmt: skip
    big = reported_error({"type": "x", "message": "m", "extra": "y" * 3_000_000})
    assert set(big) == {"type", "message"} and "were dropped" in big["message"]


def test_a_list_error_type_from_a_session_command_fails_its_task_and_its_process_serves_on(
    command: list[str],
) -> None:
    async def go() -> list[tuple[Outcome, list[dict[str, Any]], int | None]]:
        pool = ProcessPool(lambda key: ProtocolProcess(command, dict(os.environ)), max_processes=1)
        try:
            bad = {"m": "error", "error": {"type": ["not", "str"], "message": {"a": [1]}}}
            return [await served(pool, json.dumps(bad)), await served(pool, json.dumps({"m": "ok", "n": 2}))]
        finally:
            await pool.close()

    (o1, _, pid1), (o2, _, pid2) = scenario(go)
    assert o1.error is not None and o1.error["type"] == "failed" and isinstance(o1.error["message"], str)
    assert o2.output["echo"] == 2 and pid1 == pid2


# ---- D6: a batch's bad item fails its own task only -------------------------------------------------------


def test_a_batch_item_json_cannot_carry_fails_only_its_own_task_with_its_own_path(
    app_env: dict[str, str],
) -> None:
    async def go() -> tuple[Outcome, list[dict[str, Any]], int | None]:
        pool = runner(app_env, "bat")
        try:
            line = _batch_line([lease(1, {"n": 1}), lease(2, {"bad": 1}), lease(3, {"n": 3})])
            return await served(pool, line)
        finally:
            await pool.close()

    outcome, _, _ = scenario(go)
    first, second, third = per_task(outcome, 3, batched=True)
    assert first.succeeded and first.output == {"v": 1}
    assert third.succeeded and third.output == {"v": 3}
    assert not second.succeeded and second.error is not None
    assert second.error["type"] == "invalid_output" and second.error["field"] == "output.v"
    assert second.error["message"].startswith("output.v: nan")


# ---- D8: ready_at ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ready_at", ["1e15", "1e999", "NaN", "-1e999", "1.0"])
def test_a_ready_at_that_is_not_a_time_since_the_process_started_is_ignored(
    command: list[str], ready_at: str
) -> None:
    outcome, _ = one(command, {"m": "ready", "ready_at": ready_at})
    assert outcome.succeeded and outcome.ready_at is None


def test_a_ready_at_between_the_start_and_now_is_kept() -> None:
    now = time.time()
    assert _finish_facts({"ready_at": now - 1}, now - 2) == {"ready_at": now - 1}
    assert _finish_facts({"ready_at": now - 3}, now - 2) == {}
    assert _finish_facts({"ready_at": now + 60}, now - 2) == {}
