"""`turnout worker --prefetch N` on a real controller and worker: the worker holds tasks beyond its slots,
never runs more at once than its cores allow, a task cancelled while it waits there never starts, and a worker
that stops gives back what waits there, uncharged, for another worker to run; tasks waiting there survive a
controller killed and restarted, and each runs once."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from tests.conftest import Cluster
from tests.faults.conftest import read_runs

APP = "tests.apps.testapp:app"
SLOTS = 2  # --cpus 0.2 with `logged_sleep` asking cpu=0.1 (the app's smallest variant)
PREFETCH = 3


def states(cluster: Cluster, ids: list[str]) -> list[str]:
    return [cluster.api("GET", f"/v1/tasks/{t}").json()["state"] for t in ids]


def wait_until_held(cluster: Cluster, ids: list[str], n: int) -> None:
    """Until `n` of these tasks are leased to (or running on) the worker: its slots and what it holds ahead."""
    deadline = time.monotonic() + 15
    while (held := sum(s in ("leased", "running") for s in states(cluster, ids))) < n:
        assert time.monotonic() < deadline, f"the worker holds {held} tasks, not {n}"
        time.sleep(0.05)


def start_holding(cluster: Cluster, log: Path, tasks: int, seconds: float, name: str = "w",
                  **options: object) -> tuple[subprocess.Popen[bytes], list[str]]:  # fmt: skip
    """A worker `--cpus 0.2 --prefetch 3` and `tasks` logged sleeps of `seconds`, once it holds all it may (or all
    of them): the worker, and the tasks' ids in the order submitted."""
    worker = cluster.start_worker(APP, name=name, extra=["--cpus", "0.2", "--prefetch", str(PREFETCH)])
    body = {"seconds": seconds, "log": str(log)}
    ids = [cluster.submit("logged_sleep", body, **options)["id"] for _ in range(tasks)]
    wait_until_held(cluster, ids, min(tasks, SLOTS + PREFETCH))
    return worker, ids


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
    _, ids = start_holding(cluster, log, 8, 1.5)
    held = SLOTS + PREFETCH
    assert states(cluster, ids)[held:] == ["queued"] * (8 - held)  # no more than that
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
    worker, ids = start_holding(cluster, log, 5, 2, name="leaving", max_retries=0)
    worker.send_signal(signal.SIGTERM)  # it drains: what runs may finish, what waits goes back
    assert worker.wait(timeout=30) == 0
    ran = [t for what, t, _ in read_runs(log) if what == "end"]
    never_started = {t for _, t, _ in read_runs(log)} == set(ran)  # the waiting ones
    assert len(ran) == SLOTS and never_started
    after = dict(zip(ids, states(cluster, ids), strict=True))
    assert after == {t: "succeeded" if t in ran else "queued" for t in ids}  # not failed: none ran there
    cluster.start_worker(APP, name="next", extra=["--cpus", "1"])
    assert {t: cluster.result(t, wait=60)["state"] for t in ids} == {t: "succeeded" for t in ids}
    assert sorted(t for what, t, _ in read_runs(log) if what == "end") == sorted(ids)  # each ran once


def test_tasks_waiting_ahead_survive_a_controller_killed_and_restarted_and_each_runs_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    _, ids = start_holding(cluster, log, 7, 1)
    cluster.kill_controller()  # SIGKILL, with two running and three waiting on the worker
    time.sleep(1.0)
    cluster.start_controller()  # the same database and port: the worker reconnects
    # the worker reports what ran meanwhile and goes on with what waited: each task ends, and runs, once
    assert {t: cluster.result(t, wait=60)["state"] for t in ids} == {t: "succeeded" for t in ids}
    ends = [t for what, t, _ in read_runs(log) if what == "end"]
    assert sorted(ends) == sorted(ids)
    assert max_overlap(read_runs(log)) == SLOTS


def test_by_default_a_worker_holds_waiting_only_tasks_the_controller_saw_end_quickly(
    cluster: Cluster, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    cluster.start_worker(APP, extra=["--cpus", "0.1"])  # one slot; `--prefetch auto`, the default
    for n in range(6):  # `count` ends in a moment: the controller learns it is short
        assert cluster.result(cluster.submit("count", {"n": n})["id"])["state"] == "succeeded"
    # its run time unknown yet, it runs in the slot
    slow = cluster.submit("logged_sleep", {"seconds": 5, "log": str(log)})["id"]
    wait_until_held(cluster, [slow], 1)
    quick = [cluster.submit("count", {"n": n})["id"] for n in range(4)]
    # short: they wait on the worker for the slot, not in the queue; as many as 0.1 s of their expected work
    # per core allows (a few ms each, more on a loaded host): one at least, never none as without prefetch
    wait_until_held(cluster, quick, 1)
    behind = cluster.submit("logged_sleep", {"seconds": 0.1, "log": str(log)})["id"]
    time.sleep(1.0)  # its run time is unknown: it stays in the queue while the slow one runs
    assert states(cluster, [slow, behind]) == ["running", "queued"]
    assert {cluster.result(t, wait=60)["state"] for t in [slow, *quick, behind]} == {"succeeded"}
    assert max_overlap(read_runs(log)) == 1  # one slot: never two at once


def test_by_default_a_gpu_task_waits_after_a_running_one_and_takes_its_share_never_five_quarters_at_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    cluster.start_worker(APP, extra=["--cpus", "1", "--gpus", "fake:1x80Gi"])  # four quarters of one GPU
    body = {"seconds": 0.05, "log": str(log)}
    learn = [
        cluster.submit("logged_share", body)["id"] for _ in range(4)
    ]  # the controller learns it is short
    assert {cluster.result(t)["state"] for t in learn} == {"succeeded"}
    batch = {"tasks": [{"capability": "logged_share", "input": body} for _ in range(32)]}
    ids = [t["id"] for t in cluster.api("POST", "/v1/tasks/batch", json=batch).json()["tasks"]]
    tasks = [cluster.result(t, wait=60) for t in ids]
    assert {t["state"] for t in tasks} == {"succeeded"}
    assert {len(t["output"]["gpus"]) for t in tasks} == {1}
    runs = read_runs(log)
    # the GPU shared (two quarters at once at least), never a fifth task on it; all four at once only where the
    # pool's fourth process came up before the 32 short tasks ran out, which a loaded host may not do
    assert 2 <= max_overlap(runs) <= 4
    starts = {t: at for what, t, at in runs if what == "start"}
    ends = {t: at for what, t, at in runs if what == "end"}
    audit = cluster.api("GET", "/v1/audit", params={"kind": "gpu_allocated", "limit": 500}).json()["audit"]
    # held ahead, each after a task on its share: it started once that one ended, never beside it
    followed = {r["task"]: r["after"] for r in audit if r.get("after")}
    assert followed, "no task was held waiting on the worker"
    assert all(starts[task] >= ends[leader] for task, leader in followed.items())
