"""Leases, lost workers, restarts: every accepted task completes exactly once."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil

from tests.conftest import Cluster, pid_alive

APP = "tests.apps.testapp:app"


def _runs(log: Path) -> list[str]:
    return [line.split()[0] for line in log.read_text().splitlines()] if log.exists() else []


def test_sigkill_of_a_worker_requeues_its_tasks_which_complete_once_elsewhere(
    cluster: Cluster, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    victim = cluster.start_worker(APP, name="victim", extra=["--cpus", "1"])
    victim_id = cluster.wait_for_worker("victim")["id"]
    tasks = [
        cluster.submit("count", {"log": str(log), "sleep_first_attempt": 60, "n": i}, timeout_s=120)
        for i in range(4)
    ]
    ids = {t["id"] for t in tasks}
    deadline = time.monotonic() + 20
    while len(set(_runs(log))) < 4 and time.monotonic() < deadline:  # all four started on the victim
        time.sleep(0.1)
    assert set(_runs(log)) == ids
    handlers = [p.pid for p in psutil.Process(victim.pid).children(recursive=True)]
    assert handlers

    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    cluster.start_worker(APP, name="rescuer")
    done = [cluster.result(t["id"], wait=30) for t in tasks]
    assert all(d["state"] == "succeeded" for d in done), done
    assert victim_id not in {d["worker"] for d in done}
    assert all(d["attempts"] == 2 for d in done)
    runs = _runs(log)
    assert sorted(runs) == sorted(
        list(ids) * 2
    )  # once on the victim (killed), once on the rescuer: no third run
    # the victim's handler processes died with it
    deadline = time.monotonic() + 10
    while any(pid_alive(pid) for pid in handlers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in handlers if pid_alive(pid)]
    assert (
        time.monotonic() - killed_at < 3 * cluster.heartbeat_s + 15
    )  # three heartbeats plus the work (generous)


def test_grandchildren_of_a_handler_die_when_the_worker_is_killed(cluster: Cluster, tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    worker = cluster.start_worker(APP, name="victim")
    cluster.submit("spawn", {"pidfile": str(pidfile)}, max_retries=0)
    deadline = time.monotonic() + 20
    while not pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    handler, grandchild = (int(x) for x in pidfile.read_text().split())
    os.kill(worker.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while (pid_alive(handler) or pid_alive(grandchild)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(handler)
    assert not pid_alive(grandchild)


def test_controller_sigkill_and_restart_loses_no_accepted_task(cluster: Cluster) -> None:
    # no worker has registered yet: placement_timeout_s says these tasks wait for one
    waiting = {"capability": "count", "placement_timeout_s": 60}
    body = {"tasks": [{**waiting, "input": {"n": i}} for i in range(200)]}
    accepted = cluster.api("POST", "/v1/tasks/batch", json=body).json()["tasks"]
    single = cluster.submit("count", {"n": "single"}, placement_timeout_s=60)
    cluster.kill_controller()  # SIGKILL right after the API answered
    cluster.start_controller()
    listed = cluster.api("GET", "/v1/tasks", params={"limit": 1000}).json()["tasks"]
    assert {t["id"] for t in listed} == {t["id"] for t in accepted} | {single["id"]}
    cluster.start_worker(APP, name="after-restart")
    for t in [*accepted[:5], single]:
        assert cluster.result(t["id"], wait=60)["state"] == "succeeded"


def test_thousand_tasks_through_two_workers_nothing_lost_or_duplicated(
    cluster: Cluster, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    # slower heartbeats than the other tests: on a loaded CI machine a 0.5 s beat can slip past three periods
    # while forty handler processes start, and a worker thought lost re-runs its tasks (at least once, by design)
    cluster.start_worker(APP, name="a", heartbeat_s=3.0)
    cluster.start_worker(APP, name="b", heartbeat_s=3.0)
    ids: list[str] = []
    for start in range(0, 1000, 250):
        body = {
            "tasks": [
                {"capability": "count", "input": {"n": i, "log": str(log)}} for i in range(start, start + 250)
            ]
        }
        ids += [t["id"] for t in cluster.api("POST", "/v1/tasks/batch", json=body).json()["tasks"]]
    assert len(set(ids)) == 1000
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        left = cluster.api("GET", "/v1/tasks", params={"state": "queued", "limit": 1}).json()["tasks"]
        running = cluster.api("GET", "/v1/tasks", params={"state": "running", "limit": 1}).json()["tasks"]
        leased = cluster.api("GET", "/v1/tasks", params={"state": "leased", "limit": 1}).json()["tasks"]
        if not (left or running or leased):
            break
        time.sleep(0.5)
    done = []
    cursor = None
    while True:
        page = cluster.api(
            "GET", "/v1/tasks", params={"limit": 1000, **({"cursor": cursor} if cursor else {})}
        ).json()
        done += page["tasks"]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert len(done) == 1000
    bad = [t for t in done if t["state"] != "succeeded" or t["attempts"] != 1]
    assert not bad, bad[:3]
    assert sorted(t["output"]["n"] for t in done) == list(range(1000))
    runs = _runs(log)
    assert len(runs) == 1000 and set(runs) == set(ids)  # each ran exactly once
    assert len({t["worker"] for t in done}) == 2  # both workers took part
