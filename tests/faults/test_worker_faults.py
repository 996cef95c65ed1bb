"""Faults of the worker side: the whole tree of a worker holding GPU leases SIGKILLed at once."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import psutil

from tests.conftest import Cluster
from tests.faults.conftest import (
    APP,
    FaultReport,
    completed_runs,
    gpus_left_allocated,
    read_runs,
    wait_until_gone,
)


def test_sigkill_of_a_worker_tree_holding_gpu_leases(
    cluster: Cluster, tmp_path: Path, fault_report: FaultReport
) -> None:
    # Given a victim holding four GPU tasks (shares of its fake GPU) and a rescuer with room for all of them
    log = tmp_path / "runs.log"
    victim = cluster.start_worker(APP, name="victim", gpus="fake:1xA100-40Gi", extra=["--cpus", "4"])
    tasks = [
        cluster.submit("sleep", {"seconds": 3, "log": str(log), "n": i}, gpu="require", max_retries=2)
        for i in range(4)
    ]
    ids = {t["id"] for t in tasks}
    deadline = time.monotonic() + 30
    while {t for w, t, _ in read_runs(log) if w == "start"} != ids and time.monotonic() < deadline:
        time.sleep(0.05)
    assert {t for w, t, _ in read_runs(log) if w == "start"} == ids, "the victim never started all four"

    # When its agent, handler processes and their children are SIGKILLed together, mid-run
    tree = [psutil.Process(victim.pid), *psutil.Process(victim.pid).children(recursive=True)]
    killed_at = time.time()
    for p in tree:
        with contextlib.suppress(ProcessLookupError):  # a short-lived helper may have exited meanwhile
            os.kill(p.pid, signal.SIGKILL)
    # the rescuer starts after the kill: on a loaded machine its start can outlast the tasks' 3 s, and the
    # victim would have finished them before it was killed (recover_s includes the rescuer's start)
    cluster.start_worker(APP, name="rescuer", gpus="fake:1xA100-40Gi", extra=["--cpus", "4"])

    # Then every task completes once on the rescuer, nothing of the victim lives on, and no GPU stays held
    done = [cluster.result(t["id"], wait=60) for t in tasks]
    restarts = [ts for w, t, ts in read_runs(log) if w == "start" and ts > killed_at and t in ids]
    fault_report.recover_s = max(restarts) - killed_at if len(restarts) == len(ids) else None
    fault_report.accepted_lost = sum(1 for d in done if d["state"] != "succeeded")
    fault_report.committed_twice = sum(1 for n in completed_runs(log).values() if n > 1)
    fault_report.processes_left = len(wait_until_gone(tree))
    fault_report.gpus_left_allocated = gpus_left_allocated(cluster)
    fault_report.notes.append(f"{len(tree)} processes killed")
    fault_report.check()
    assert {d["worker"] for d in done} == {cluster.wait_for_worker("rescuer")["id"]}
    assert all(d["attempts"] == 2 for d in done), [d["attempts"] for d in done]
