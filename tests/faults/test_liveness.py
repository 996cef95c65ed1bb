"""Liveness, end to end: a dead worker's work moves on at once, a live one's never does.

A worker process that dies closes its connection to the controller, which re-queues its tasks within a
second or two; a worker that merely goes silent (its host gone, its socket left open) is judged by its
heartbeats; a controller that restarts after a long outage re-runs nothing the workers kept running; a
lease whose answer never reached its worker goes back to the queue.

The task logs a `start` and an `end` line per run (`logged_sleep`), so "ran once" and "completed twice"
are read from the handler's own log, not from the controller's record.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.conftest import Cluster
from tests.faults.conftest import (
    FaultReport,
    completed_runs,
    gpus_left_allocated,
    read_runs,
    wait_until_gone,
)

APP = "tests.apps.testapp:app"


def starts(log: Path) -> list[str]:
    """Task ids in the order their handler started."""
    return [task_id for what, task_id, _ in read_runs(log) if what == "start"]


def committed_twice(log: Path) -> int:
    return sum(1 for n in completed_runs(log).values() if n > 1)


def tree_of(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def poll(check: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(every_s)


def task_state(cluster: Cluster, task_id: str) -> dict[str, Any]:
    return cluster.api("GET", f"/v1/tasks/{task_id}").json()


def worker_named(cluster: Cluster, name: str) -> dict[str, Any]:
    return next(w for w in cluster.api("GET", "/v1/workers").json()["workers"] if w["name"] == name)


def test_tasks_of_a_sigkilled_worker_run_again_on_another_within_seconds_not_heartbeats(
    cluster: Cluster, tmp_path: Path, fault_report: FaultReport
) -> None:
    log = tmp_path / "runs.log"
    beat_s = 5.0  # three heartbeats would be 15 s: what is measured here cannot come from them
    victim = cluster.start_worker(APP, name="victim", heartbeat_s=beat_s, extra=["--cpus", "1"])
    task = cluster.submit("logged_sleep", {"log": str(log), "first_attempt_s": 120}, timeout_s=300)
    poll(lambda: starts(log) == [task["id"]], 30, "the task started on the victim")
    cluster.start_worker(APP, name="rescuer", heartbeat_s=beat_s)
    tree = tree_of(victim.pid)  # its agent, the warm handler process running the task, their helpers

    os.kill(victim.pid, signal.SIGKILL)  # the agent alone: the rest must die with it
    killed_at = time.monotonic()
    poll(lambda: len(starts(log)) == 2, 3 * beat_s, "the task started again on the rescuer", every_s=0.01)
    elapsed_s = time.monotonic() - killed_at

    done = cluster.result(task["id"], wait=30)
    fault_report.recover_s = elapsed_s  # from the SIGKILL to the handler's start on the rescuer
    fault_report.accepted_lost = int(done["state"] != "succeeded")
    fault_report.committed_twice = committed_twice(log)
    fault_report.processes_left = len(wait_until_gone(tree))
    fault_report.gpus_left_allocated = gpus_left_allocated(cluster)
    fault_report.notes.append(f"agent of {len(tree)} processes SIGKILLed; heartbeat {beat_s:g} s")
    fault_report.check()
    assert elapsed_s < beat_s  # well inside the three heartbeats (15 s) a silent worker gets
    assert done["state"] == "succeeded" and done["attempts"] == 2
    assert worker_named(cluster, "victim")["state"] == "unhealthy"
    assert starts(log) == [task["id"], task["id"]]
    assert completed_runs(log) == {task["id"]: 1}  # the killed run never reached its end


def test_a_worker_that_goes_silent_with_its_connection_open_is_judged_by_heartbeats(
    cluster: Cluster, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    worker = cluster.start_worker(APP, name="silent")
    task = cluster.submit("logged_sleep", {"log": str(log), "seconds": 120}, timeout_s=300)
    poll(lambda: starts(log) == [task["id"]], 30, "the task started")
    os.kill(worker.pid, signal.SIGSTOP)  # like a host that vanished: no heartbeats, and no close either
    stopped_at = time.monotonic()
    try:
        poll(lambda: worker_named(cluster, "silent")["state"] == "unhealthy", 15, "the worker judged lost")
        elapsed_s = time.monotonic() - stopped_at
        print(f"\nsilent worker judged lost after {elapsed_s:.2f} s (heartbeat {cluster.heartbeat_s:g} s)")
        # three heartbeats after the last one, which came at most one period before it stopped
        assert elapsed_s >= 2 * cluster.heartbeat_s
        assert task_state(cluster, task["id"])["state"] == "queued"
    finally:
        os.kill(worker.pid, signal.SIGCONT)


def test_a_controller_down_longer_than_three_heartbeats_reruns_nothing_the_workers_kept_running(
    cluster: Cluster, tmp_path: Path, fault_report: FaultReport
) -> None:
    log = tmp_path / "runs.log"
    cluster.start_worker(APP, name="steady", extra=["--cpus", "1"])  # room for a second task beside it
    task = cluster.submit("logged_sleep", {"log": str(log), "seconds": 6}, timeout_s=120)
    poll(lambda: starts(log) == [task["id"]], 30, "the task started")

    assert cluster.controller is not None
    controller = tree_of(cluster.controller.pid)
    cluster.kill_controller()
    killed_at = time.monotonic()
    time.sleep(4 * cluster.heartbeat_s)  # the outage itself: longer than three heartbeats
    cluster.start_controller()
    restarted_at = time.monotonic()
    # work runs again once the worker is back in touch: a task submitted now starts beside the kept one
    fresh = cluster.submit("logged_sleep", {"log": str(log)}, timeout_s=120)
    poll(lambda: fresh["id"] in starts(log), 30, "a task submitted after the restart started", every_s=0.01)
    recover_s = time.monotonic() - restarted_at

    done = cluster.result(task["id"], wait=60)
    fresh_done = cluster.result(fresh["id"], wait=30)
    fault_report.recover_s = recover_s
    fault_report.accepted_lost = sum(1 for d in (done, fresh_done) if d["state"] != "succeeded")
    fault_report.committed_twice = committed_twice(log)
    fault_report.processes_left = len(wait_until_gone(controller))
    fault_report.gpus_left_allocated = gpus_left_allocated(cluster)
    down_s, beat_s = restarted_at - killed_at, cluster.heartbeat_s
    fault_report.notes.append(f"down {down_s:.1f} s, heartbeat {beat_s:g} s; timed from the restart")
    fault_report.check()
    assert done["state"] == "succeeded", done
    assert done["attempts"] == 1
    assert starts(log).count(task["id"]) == 1  # exactly one run
    assert worker_named(cluster, "steady")["state"] == "healthy"


def test_a_lease_whose_answer_never_reached_its_worker_returns_to_the_queue(
    cluster: Cluster, tmp_path: Path, fault_report: FaultReport
) -> None:
    log = tmp_path / "runs.log"
    # Given a worker stand-in that asks for a lease and never sees the answer (lost on the way)
    variant = {"capability": "logged_sleep", "device": "cpu", "resources": {"cpu": 0.1}}
    body = {"name": "lossy", "host": "h", "cpu": 1, "memory": 2**30, "heartbeat_s": cluster.heartbeat_s,
            "variants": [variant]}  # fmt: skip
    registered = cluster.api("POST", "/v1/workers/register", json=body).json()
    lossy, me = registered["id"], {"X-Worker-Secret": registered["secret"]}
    task = cluster.submit("logged_sleep", {"log": str(log)}, max_retries=0)
    lost = cluster.api(
        "POST", f"/v1/workers/{lossy}/lease", json={"max_tasks": 1, "wait_s": 5}, headers=me
    ).json()
    lost_at = time.monotonic()
    assert [t["id"] for t in lost["tasks"]] == [task["id"]]  # the answer that is thrown away
    assert task_state(cluster, task["id"])["state"] == "leased"

    # When the stand-in goes on heartbeating and asking, without the task among those it holds
    def stand_in_reports() -> bool:
        cluster.api("POST", f"/v1/workers/{lossy}/heartbeat", json={}, headers=me)
        cluster.api("POST", f"/v1/workers/{lossy}/lease", json={"max_tasks": 0, "wait_s": 0, "running": []},
                    headers=me)  # fmt: skip
        return task_state(cluster, task["id"])["state"] == "queued"

    # Then the task goes back to the queue (the stand-in stays healthy), and a real worker runs it once,
    # though max_retries is 0: an attempt that never reached a worker spends no retry
    poll(stand_in_reports, 15, "the undelivered lease taken back", every_s=0.3)
    fault_report.recover_s = time.monotonic() - lost_at  # from the lost answer to the task queued again
    assert worker_named(cluster, "lossy")["state"] == "healthy"
    cluster.start_worker(APP, name="real")
    done = cluster.result(task["id"], wait=30)
    fault_report.accepted_lost = int(done["state"] != "succeeded")
    fault_report.committed_twice = committed_twice(log)
    fault_report.gpus_left_allocated = gpus_left_allocated(cluster)
    fault_report.notes.append("the lease's holder is a stand-in over HTTP: no process to outlive it")
    fault_report.check()
    assert done["state"] == "succeeded" and done["worker"] != lossy
    assert starts(log) == [task["id"]]


def test_a_lifeline_is_held_open_for_a_registered_worker_and_refused_once_it_left(cluster: Cluster) -> None:
    body = {"name": "held", "host": "h", "cpu": 1, "memory": 2**30, "variants": []}
    registered = cluster.api("POST", "/v1/workers/register", json=body).json()
    worker_id, me = registered["id"], {"X-Worker-Secret": registered["secret"]}
    headers = {"Authorization": f"Bearer {cluster.token}", **me}
    url = f"{cluster.url}/v1/workers/{worker_id}/lifeline"
    with httpx.stream("GET", url, headers=headers, timeout=10) as resp:
        assert resp.status_code == 200 and "content-length" not in resp.headers
        assert next(resp.iter_raw()) == b"."  # a ping; the response has no end of its own
    with httpx.stream("GET", url, headers={"Authorization": f"Bearer {cluster.token}"}, timeout=10) as resp:
        assert resp.status_code == 403  # the worker itself holds its lifeline: its token and its secret
    assert cluster.api("POST", f"/v1/workers/{worker_id}/leave", headers=me).status_code == 200
    with httpx.stream("GET", url, headers=headers, timeout=10) as resp:
        assert resp.status_code == 404
