"""Two controller replicas on one PostgreSQL database, four workers split across them, 5,000 tasks, and one
replica SIGKILLed and started again mid-run: every task completes exactly once and none is lost.

Each worker talks to one replica only, as workers behind two addresses do. Submissions go to both. The
handler appends its task id to a log once it has run (the ground truth for "ran exactly once"); the
database says each task succeeded once (its conditional updates commit one result per task). Heartbeats
every 5 s give a replica that restarts within 15 s back its own workers before the other replica could
judge them lost, so nothing needs to run twice.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.conftest import Cluster, Processes
from tests.faults.conftest import FaultReport

pytestmark = [pytest.mark.postgres, pytest.mark.slow]
APP = "tests.apps.replica_app:app"
TASKS = 5000
BATCH = 1000


def _finished(cluster: Cluster) -> tuple[int, int]:
    """(terminal tasks, tasks not yet terminal), from the replica's /metrics (read from the database)."""
    done = left = 0
    for line in httpx.get(f"{cluster.url}/metrics", timeout=30).text.splitlines():
        if line.startswith("turnout_tasks_finished_total{"):
            done += int(float(line.rsplit(" ", 1)[1]))
        elif line.startswith(("turnout_queue_depth{", "turnout_tasks_active{")):
            left += int(float(line.rsplit(" ", 1)[1]))
    return done, left


def _succeeded_ids(cluster: Cluster) -> list[str]:
    ids: list[str] = []
    cursor: str | None = None
    while True:
        params = {"state": "succeeded", "limit": 1000, **({"cursor": cursor} if cursor else {})}
        body = cluster.api("GET", "/v1/tasks", params=params).json()
        ids += [t["id"] for t in body["tasks"]]
        cursor = body["next_cursor"]
        if not cursor:
            return ids


@pytest.mark.timeout(330)  # 35-45 s on a quiet 2-core machine; well past 120 s when the machine is shared
def test_two_replicas_with_one_sigkilled_mid_run_complete_5000_tasks_exactly_once(
    pg_url: str, tmp_path: Path, processes: Processes, fault_report: FaultReport
) -> None:
    # Given two replicas on one database (the second reusing the first's admin token), two workers on each
    a = Cluster(tmp_path / "a", processes, pg_url, heartbeat_s=5.0)
    b = Cluster(tmp_path / "b", processes, pg_url, heartbeat_s=5.0)
    (tmp_path / "a").mkdir()
    (tmp_path / "b" / "home").mkdir(parents=True)
    a.start_controller()
    shutil.copy(tmp_path / "a" / "home" / "admin.token", tmp_path / "b" / "home" / "admin.token")
    b.start_controller()
    for replica, names in ((a, ("a1", "a2")), (b, ("b1", "b2"))):
        for name in names:
            replica.start_worker(APP, name=name, extra=["--cpus", "1"])
    log = tmp_path / "runs.log"
    log.touch()

    # When 5,000 tasks are submitted in batches, alternately to each replica
    accepted: list[str] = []
    t0 = time.monotonic()
    for i in range(TASKS // BATCH):
        replica = (a, b)[i % 2]
        body = {"tasks": [{"capability": "tick", "input": {"log": str(log)}} for _ in range(BATCH)]}
        resp = replica.api("POST", "/v1/tasks/batch", json=body)
        assert resp.status_code == 201, resp.text
        accepted += [t["id"] for t in resp.json()["tasks"]]
    # and replica A is SIGKILLed once a fifth of them are done, and started again at once
    deadline = time.monotonic() + 120
    while _finished(b)[0] < TASKS // 5:
        assert time.monotonic() < deadline, "the first fifth did not finish in time"
        time.sleep(0.1)
    a.kill_controller()
    killed = time.monotonic()
    a.start_controller()
    fault_report.recover_s = time.monotonic() - killed
    deadline = time.monotonic() + 160
    while _finished(b) != (TASKS, 0):
        assert time.monotonic() < deadline, f"not all done: {_finished(b)}"
        time.sleep(0.2)

    fault_report.notes.append(f"all terminal {time.monotonic() - t0:.1f} s after the first submit")
    # Then every accepted task succeeded, and each handler ran to the end exactly once
    succeeded = set(_succeeded_ids(a))
    runs = Counter(log.read_text().split())
    fault_report.accepted_lost = len(set(accepted) - succeeded)
    fault_report.committed_twice = sum(1 for n in runs.values() if n > 1)
    fault_report.notes.append(f"{len(accepted)} accepted, {len(succeeded)} succeeded, {len(runs)} ran")
    assert len(accepted) == TASKS and succeeded == set(accepted)
    assert set(runs) == set(accepted)
    fault_report.check()
