"""`turnout worker --prefetch N` on a real controller and worker: the worker holds tasks beyond its slots,
never runs more at once than its cores allow, a task cancelled while it waits there never starts, and a worker
that stops gives back what waits there, uncharged, for another worker to run; tasks waiting there survive a
controller killed and restarted, and each runs once."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from tests.conftest import Cluster
from tests.faults.conftest import read_runs

APP = "tests.apps.testapp:app"
SLOTS = 2  # --cpus 0.2 with `logged_sleep` asking cpu=0.1 (the app's smallest variant)
PREFETCH = 3


def max_overlap(runs: list[tuple[str, str, float]]) -> int:
    """The most runs between their start and end lines at once."""
    running = most = 0
    for what, _task, _at in sorted(runs, key=lambda r: (r[2], r[0] == "start")):  # an end before a start
        running += 1 if what == "start" else -1
        most = max(most, running)
    return most


def test_a_worker_holds_prefetch_tasks_waiting_runs_only_its_slots_and_drops_one_cancelled_while_waiting(
    cluster: Cluster, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    cluster.start_worker(APP, extra=["--cpus", "0.2", "--prefetch", str(PREFETCH)])
    ids = [cluster.submit("logged_sleep", {"seconds": 1.5, "log": str(log)})["id"] for _ in range(8)]

    def states() -> list[str]:
        return [cluster.api("GET", f"/v1/tasks/{t}").json()["state"] for t in ids]

    deadline = time.monotonic() + 15
    while (held := sum(s in ("leased", "running") for s in states())) < SLOTS + PREFETCH:
        assert time.monotonic() < deadline, f"the worker holds {held} tasks, not {SLOTS + PREFETCH}"
        time.sleep(0.05)
    assert states()[SLOTS + PREFETCH :] == ["queued"] * (8 - SLOTS - PREFETCH)  # no more than that
    started = {t for what, t, _ in read_runs(log) if what == "start"}
    assert len(started) <= SLOTS, "the tasks beyond its slots wait"

    waiting = ids[SLOTS + PREFETCH - 1]  # the last one it took: behind the others
    assert waiting not in started
    assert cluster.api("POST", f"/v1/tasks/{waiting}/cancel").json()["state"] == "cancelled"
    results = {t: cluster.result(t, wait=60)["state"] for t in ids}
    assert results == {t: "cancelled" if t == waiting else "succeeded" for t in ids}

    runs = read_runs(log)
    assert waiting not in {t for _, t, _ in runs}, "cancelled while it waited: it never started"
    assert sorted(t for what, t, _ in runs if what == "end") == sorted(t for t in ids if t != waiting)
    assert max_overlap(runs) == SLOTS  # its slots were used, and never more


def test_a_stopping_worker_finishes_what_runs_and_gives_back_what_waits_there_which_another_runs(
    cluster: Cluster, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    worker = cluster.start_worker(APP, name="leaving", extra=["--cpus", "0.2", "--prefetch", str(PREFETCH)])
    ids = [
        cluster.submit("logged_sleep", {"seconds": 2, "log": str(log)}, max_retries=0)["id"] for _ in range(5)
    ]
    deadline = time.monotonic() + 15
    while sum(cluster.api("GET", f"/v1/tasks/{t}").json()["state"] in ("leased", "running") for t in ids) < 5:
        assert time.monotonic() < deadline, "the worker never held all five"
        time.sleep(0.05)
    worker.send_signal(signal.SIGTERM)  # it drains: what runs may finish, what waits goes back
    assert worker.wait(timeout=30) == 0
    ran = [t for what, t, _ in read_runs(log) if what == "end"]
    assert len(ran) == SLOTS and {t for _, t, _ in read_runs(log)} == set(
        ran
    )  # the waiting ones never started
    states = {t: cluster.api("GET", f"/v1/tasks/{t}").json()["state"] for t in ids}
    assert states == {t: "succeeded" if t in ran else "queued" for t in ids}  # not failed: none ran there
    cluster.start_worker(APP, name="next", extra=["--cpus", "1"])
    assert {t: cluster.result(t, wait=60)["state"] for t in ids} == {t: "succeeded" for t in ids}
    assert sorted(t for what, t, _ in read_runs(log) if what == "end") == sorted(ids)  # each ran once


def test_tasks_waiting_ahead_survive_a_controller_killed_and_restarted_and_each_runs_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    cluster.start_worker(APP, extra=["--cpus", "0.2", "--prefetch", str(PREFETCH)])
    ids = [cluster.submit("logged_sleep", {"seconds": 1, "log": str(log)})["id"] for _ in range(7)]
    deadline = time.monotonic() + 15
    while sum(cluster.api("GET", f"/v1/tasks/{t}").json()["state"] in ("leased", "running") for t in ids) < 5:
        assert time.monotonic() < deadline, "the worker never held five"
        time.sleep(0.05)
    cluster.kill_controller()  # SIGKILL, with two running and three waiting on the worker
    time.sleep(1.0)
    cluster.start_controller()  # the same database and port: the worker reconnects
    # the worker reports what ran meanwhile and goes on with what waited: each task ends, and runs, once
    assert {t: cluster.result(t, wait=60)["state"] for t in ids} == {t: "succeeded" for t in ids}
    ends = [t for what, t, _ in read_runs(log) if what == "end"]
    assert sorted(ends) == sorted(ids)
    assert max_overlap(read_runs(log)) == SLOTS
