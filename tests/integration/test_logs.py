"""Structured logs: `--log-format json` on the controller and worker, with task and worker ids on their lines."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from tests.conftest import Cluster, Processes
from turnout import logs


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The log lines of a process's output (its stdout, banner lines, is mixed in: those are not JSON)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def wait_for_line(path: Path, match: Any, what: str, timeout_s: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in json_lines(path):
            if match(line):
                return line
        time.sleep(0.1)
    raise AssertionError(f"no log line {what} in {path}:\n{path.read_text()[-3000:]}")


def test_controller_and_worker_write_json_lines_naming_the_task_and_worker(
    tmp_path: Path, processes: Processes
) -> None:
    c = Cluster(
        tmp_path, processes, f"sqlite:///{tmp_path / 't.db'}", extra_args=["--log-format", "json", "-v"]
    )
    c.start_controller()
    proc = c.start_worker("tests.apps.testapp:app", name="jw", extra=["--log-format", "json", "-v"])
    worker_id = c.wait_for_worker("jw")["id"]
    worker_log = tmp_path / "worker-jw.log"
    task = c.submit("count", {"sleep": 60})
    deadline = time.monotonic() + 30
    while (
        c.api("GET", f"/v1/tasks/{task['id']}").json()["state"] != "running" and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    c.api("POST", f"/v1/tasks/{task['id']}/cancel")  # the worker logs that it stops the task

    stopping = wait_for_line(worker_log, lambda line: line.get("task_id") == task["id"], "about the task")
    assert stopping["worker_id"] == worker_id
    assert {"ts", "level", "logger", "msg"} <= stopping.keys() and stopping["ts"].endswith("Z")
    registered = wait_for_line(
        worker_log, lambda line: line["msg"].startswith("registered as"), "on registering"
    )
    assert registered["worker_id"] == worker_id
    os.killpg(proc.pid, signal.SIGKILL)
    lost = wait_for_line(tmp_path / "controller.log", lambda line: line.get("worker_id") == worker_id,
                         "about the lost worker")  # fmt: skip
    assert lost["level"] == "warning" and "jw" in lost["msg"]


def test_text_lines_end_with_the_ids_they_are_about() -> None:
    record = logging.LogRecord("turnout.worker", logging.WARNING, __file__, 1, "stopping task %s: %s",
                               ("t_0123456789abcdef01234567", "cancelled"), None)  # fmt: skip
    logs.IdsFilter().filter(record)
    line = logs.TextFormatter().format(record)
    assert line.endswith("WARNING turnout.worker: stopping task t_0123456789abcdef01234567: cancelled "
                         "task=t_0123456789abcdef01234567")  # fmt: skip


def test_a_line_about_no_task_carries_no_task_field() -> None:
    record = logging.LogRecord("turnout.api", logging.ERROR, __file__, 1, "sweep failed", (), None)
    logs.IdsFilter().filter(record)
    line = json.loads(logs.JsonFormatter().format(record))
    assert "task_id" not in line and "worker_id" not in line
    assert line["msg"] == "sweep failed" and line["level"] == "error"


def test_an_unknown_log_format_is_one_line_naming_the_option(cluster: Cluster) -> None:
    out = cluster.cli("worker", "turnout.demo:app", "--log-format", "yaml")
    assert out.returncode == 2
    assert out.stderr.startswith("error: --log-format: 'yaml' is not one of text, json")
    assert "Traceback" not in out.stderr


def test_up_passes_its_log_format_to_its_local_worker(tmp_path: Path, processes: Processes) -> None:
    import sys

    from tests.conftest import free_port

    port, home = free_port(), tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNOUT_")}
    env.update(TURNOUT_HOME=str(home), PYTHONUNBUFFERED="1")
    log = tmp_path / "up.log"
    processes.start([sys.executable, "-m", "turnout.cli", "up", "--gpus", "none", "--port", str(port),
                     "--home", str(home), "--log-format", "json", "-v"], env, log)  # fmt: skip
    registered = wait_for_line(
        log, lambda line: line["msg"].startswith("registered as"), "from the local worker"
    )
    assert registered["worker_id"].startswith("w_") and registered["logger"] == "turnout.worker"
