"""Stopping a worker: the first SIGTERM drains (its running tasks may finish), a second stops them now.

An operator (or systemd, or a test's teardown) that cannot wait out a long task sends the signal again, as
with Celery's warm and cold shutdown: the worker stops its tasks, leaves, and the controller queues them
again at once, for another worker, instead of after three missed heartbeats.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import Cluster
from tests.integration.test_worker_reports import wait_for_state

APP = "tests.apps.testapp:app"


def test_a_second_sigterm_stops_a_draining_workers_task_which_is_queued_again_for_another(
    cluster: Cluster,
) -> None:
    worker = cluster.start_worker(APP, name="leaving")
    task = cluster.submit("work", {"sleep": 60}, max_retries=2)
    wait_for_state(cluster, task["id"], {"running"})
    worker.send_signal(signal.SIGTERM)
    time.sleep(1.5)
    assert worker.poll() is None, "one SIGTERM drains: the worker waits for its running task"
    assert cluster.api("GET", f"/v1/tasks/{task['id']}").json()["state"] == "running"

    stopped_at = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=15) == 0
    assert time.monotonic() - stopped_at < 10  # not the 30 s drain grace, nor the 60 s task
    log = (cluster.tmp / "worker-leaving.log").read_text()
    assert "a second signal: stopping the running tasks now" in log and "Traceback" not in log

    again = cluster.api("GET", f"/v1/tasks/{task['id']}").json()
    assert again["state"] == "queued" and again["attempts"] == 1, again
    nxt = cluster.start_worker(APP, name="next")
    wait_for_state(cluster, task["id"], {"running"})
    moved = cluster.api("GET", f"/v1/tasks/{task['id']}").json()
    assert moved["attempts"] == 2 and moved["worker"] == cluster.wait_for_worker("next")["id"], moved
    assert cluster.api("POST", f"/v1/tasks/{task['id']}/cancel").status_code == 200
    assert nxt.poll() is None


def test_the_scratch_directory_a_sigkilled_worker_left_is_removed_by_the_next_worker_of_its_host(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # the workers' temporary directory: this test's alone

    def scratches() -> set[Path]:
        return {p for p in temp.iterdir() if p.name.startswith("turnout-worker-")}

    killed = cluster.start_worker(APP, name="killed")
    (left,) = scratches()
    os.killpg(killed.pid, signal.SIGKILL)  # no chance to remove its own
    killed.wait(timeout=10)
    assert left.exists()
    cluster.start_worker(APP, name="next")
    (own,) = scratches()
    assert own != left and not left.exists()
    assert cluster.result(cluster.submit("count", {"n": 1})["id"])["state"] == "succeeded"


def test_a_worker_whose_controller_never_answered_stops_at_once_on_sigterm(tmp_path: Path) -> None:
    from tests.conftest import REPO, Processes, free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNOUT_")}
    env.update(TMPDIR=str(tmp_path), TURNOUT_TOKEN="tnt_none", PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{REPO}")
    procs = Processes()
    log = tmp_path / "worker.log"
    try:
        worker = procs.start([sys.executable, "-m", "turnout.cli", "worker", APP, "--gpus", "none",
                              "--controller", f"http://127.0.0.1:{free_port()}"], env, log)  # fmt: skip
        deadline = time.monotonic() + 30
        while "controller not reachable" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.poll() is None, log.read_text()
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=10) == 0, log.read_text()  # it waited for the controller forever before
    finally:
        procs.stop_all()
    assert "Traceback" not in log.read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("turnout-worker-")]  # its scratch went too


def test_a_variant_whose_setup_fails_fails_each_task_with_the_reason_and_the_worker_serves_on(
    cluster: Cluster,
) -> None:
    worker = cluster.start_worker("tests.apps.setup_app:app", name="setup")
    failed = [cluster.result(cluster.submit("unloadable", {}, max_retries=0)["id"]) for _ in range(3)]
    for task in failed:
        assert task["state"] == "failed", task
        assert task["error"]["type"] == "setup_failed"
        assert "no weights at /models/absent.bin for cpu" in task["error"]["message"]
    assert cluster.result(cluster.submit("fine", {})["id"])["state"] == "succeeded"  # the rest serves on

    def unloadable_runners() -> set[int]:
        found = set()
        for proc in psutil.Process(worker.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if proc.status() != psutil.STATUS_ZOMBIE and "unloadable" in proc.cmdline():
                    found.add(proc.pid)
        return found

    leaving = unloadable_runners()  # the last task's process may still be on its way out
    started: set[int] = (
        set()
    )  # a pool restarting the failing setup on its own would show here, again and again
    for _ in range(20):
        started |= unloadable_runners() - leaving
        time.sleep(0.05)
    assert not started
