"""A result or event that JSON cannot carry fails its task with `invalid_output`, and the worker serves on.

One NaN used to stop a worker's reporting for good: its tasks sat `running` while it heartbeated, and its
shutdown crashed. These run the real thing: a controller, a worker with Python handlers (the warm runner)
and command workers, the stream as a client reads it.
"""

from __future__ import annotations

import json
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Cluster
from turnout.client import Client

APP = "tests.apps.testapp:app"

# A session-mode command worker that writes, as its own JSON lines, what Python's json.loads accepts but
# strict JSON does not (NaN, Infinity, a lone surrogate escape).
BAD_LINES = textwrap.dedent(r"""
    import json, sys

    def out(text):
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    DONE = '{"event": "finish", "status": "completed"}'
    for line in sys.stdin:
        do = json.loads(line)["do"]
        if do == "ok":
            out('{"event": "result", "data": {"ok": true}}'); out(DONE)
        elif do == "infinity":
            out('{"event": "result", "data": {"x": Infinity}}'); out(DONE)
        elif do == "surrogate_text":
            out('{"event": "text", "content": "caf\\ud800"}'); out(DONE)
        elif do == "nan_event":
            out('{"event": "progress", "done": NaN, "total": 2}')
            out('{"event": "progress", "done": 2, "total": 2}')
            out('{"event": "result", "data": {"ok": true}}'); out(DONE)
        elif do == "nan_error":
            out('{"event": "finish", "status": "failed", "error": {"type": "model_error", "message": "diverged", "loss": NaN}}')
""")


@pytest.fixture(scope="module")
def served(shared_cluster: Cluster) -> Cluster:
    """One controller and one worker serving the test app and the `bad-lines` command worker."""
    program = shared_cluster.tmp / "bad_lines.py"
    program.write_text(BAD_LINES)
    presets = shared_cluster.tmp / "presets.yaml"
    presets.write_text(json.dumps({"models": {"bad-lines": {"inference": {
        "command": [sys.executable, str(program)], "mode": "session", "timeout_s": 20}}}}))  # fmt: skip
    shared_cluster.start_worker(APP, name="reports", extra=["--presets", str(presets)])
    return shared_cluster


def run(cluster: Cluster, capability: str, data: Any) -> dict[str, Any]:
    return cluster.result(cluster.submit(capability, data)["id"], wait=20)


def events_of(cluster: Cluster, task_id: str) -> list[dict[str, Any]]:
    with Client(cluster.url, cluster.token) as client:
        return list(client.task(task_id).events())


def assert_invalid_output(task: dict[str, Any], field: str) -> None:
    assert task["state"] == "failed", task
    assert task["error"]["type"] == "invalid_output", task["error"]
    assert task["error"]["field"] == field
    assert task["error"]["message"].startswith(f"{field}: ")
    assert task["output"] is None


# ---- Python handlers -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "field", "words"),
    [
        ("nan", "output.x", "NaN and Infinity have no JSON form"),  # the next task: tests/faults
        ("infinity", "output.scores.1", "inf"),
        ("surrogate", "output.text", "surrogate"),
        ("set", "output.tags", "a set is not a JSON value"),
        ("bytes", "output.blob", "a bytes is not a JSON value"),
        ("object", "output.model", "a Opaque is not a JSON value"),
    ],
)
def test_a_handler_returning_what_json_cannot_carry_fails_invalid_output(
    served: Cluster, kind: str, field: str, words: str
) -> None:
    task = run(served, "bad_output", {"kind": kind})
    assert_invalid_output(task, field)
    assert words in task["error"]["message"]


def test_a_nan_event_fails_its_task_at_the_emit_naming_the_field_and_earlier_events_still_stream(
    served: Cluster,
) -> None:
    # ctx.emit refuses the event in the handler itself: nothing JSON cannot carry is written or stringified
    task = run(served, "bad_event", {})
    assert task["state"] == "failed", task
    assert task["error"]["type"] == "invalid_output"
    assert task["error"]["field"] == "events.progress.done"
    assert "nan is not a JSON number" in task["error"]["message"]
    events = events_of(served, task["id"])
    assert [e["delta"] for e in events if e["event"] == "text_delta"] == ["before "]
    assert not [e for e in events if e["event"] == "progress"]
    assert events[-1]["event"] == "finish"


# ---- command workers -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("do", "field"),
    [
        ("infinity", "output.x"),  # the data of its result event
        ("surrogate_text", "output.text"),  # no result event: the last text becomes the output
    ],
)
def test_a_command_worker_result_json_cannot_carry_fails_invalid_output(
    served: Cluster, do: str, field: str
) -> None:
    assert_invalid_output(run(served, "bad-lines", {"do": do}), field)
    assert run(served, "bad-lines", {"do": "ok"})["state"] == "succeeded"


def test_a_command_worker_nan_event_fails_its_task_and_the_next_event_still_streams(served: Cluster) -> None:
    task = run(served, "bad-lines", {"do": "nan_event"})
    assert task["state"] == "failed" and task["error"]["type"] == "invalid_output", task
    assert task["error"]["field"].endswith(".done")
    events = events_of(served, task["id"])
    assert [(e["done"], e["total"]) for e in events if e["event"] == "progress"] == [(2, 2)]


def test_a_command_worker_error_json_cannot_carry_keeps_the_type_it_reported(served: Cluster) -> None:
    task = run(served, "bad-lines", {"do": "nan_error"})
    assert_invalid_output(task, "error.loss")
    assert "'model_error'" in task["error"]["message"]


# ---- shutdown ------------------------------------------------------------------------------------------


def wait_for_state(cluster: Cluster, task_id: str, states: set[str], timeout_s: float = 20) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = cluster.api("GET", f"/v1/tasks/{task_id}").json()["state"]
        if state in states:
            return state
        time.sleep(0.05)
    raise AssertionError(f"task {task_id} never reached {states}")


def test_a_worker_stopped_while_its_task_returns_nan_reports_the_failure_and_exits_cleanly(
    cluster: Cluster,
) -> None:
    worker = cluster.start_worker(APP, name="leaving")
    task = cluster.submit("bad_output", {"kind": "nan", "sleep": 1.5})
    wait_for_state(cluster, task["id"], {"leased", "running"})
    worker.send_signal(signal.SIGTERM)  # it drains: the task ends, is reported, and the worker leaves
    assert worker.wait(timeout=30) == 0, Path(cluster.tmp / "worker-leaving.log").read_text()[-3000:]
    assert_invalid_output(cluster.result(task["id"], wait=10), "output.x")
