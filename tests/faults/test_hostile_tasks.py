"""Faults a task brings with it: a handler that returns NaN, which strict JSON cannot carry.

One NaN used to stop a worker's reporting for good (tasks left `running` while it heartbeated). Here the
NaN task fails `invalid_output` naming the path, and the task queued behind it on the same one-slot worker
still runs, once. The other hostile task of issue 7, one that forks, calls `setsid` and is then killed,
is in test_containment.py.
"""

from __future__ import annotations

import signal
from datetime import datetime
from pathlib import Path

import psutil

from tests.conftest import Cluster
from tests.faults.conftest import FaultReport, completed_runs, gpus_left_allocated, wait_until_gone

APP = "tests.apps.testapp:app"


def finished_s(task: dict) -> float:
    """The controller's epoch seconds for when `task` ended (its `finished_at`)."""
    return datetime.fromisoformat(task["finished_at"].replace("Z", "+00:00")).timestamp()


def test_a_handler_returning_nan_fails_invalid_output_and_the_task_queued_behind_it_runs_once(
    cluster: Cluster, tmp_path: Path, fault_report: FaultReport
) -> None:
    # Given a worker with room for one task at a time, its `logged_sleep` handler process already warm
    log = tmp_path / "runs.log"
    worker = cluster.start_worker(APP, name="w", extra=["--cpus", "0.1"])
    warm = cluster.result(cluster.submit("logged_sleep", {"log": str(log), "n": 0})["id"])
    assert warm["state"] == "succeeded", warm

    # When a handler returns NaN while a normal task waits behind it
    bad = cluster.submit("bad_output", {"kind": "nan", "sleep": 1})
    good = cluster.submit("logged_sleep", {"log": str(log), "n": 1})
    bad_done = cluster.result(bad["id"], wait=30)
    good_done = cluster.result(good["id"], wait=30)

    # Then the NaN task fails naming the path, the next one succeeds on the same worker, and a stop
    # afterwards leaves nothing of either behind
    tree = [psutil.Process(worker.pid), *psutil.Process(worker.pid).children(recursive=True)]
    worker.send_signal(signal.SIGTERM)
    exit_code = worker.wait(timeout=30)
    ended = good_done["state"] == "succeeded" and bad_done["state"] == "failed"
    fault_report.recover_s = finished_s(good_done) - finished_s(bad_done) if ended else None
    fault_report.accepted_lost = int(good_done["state"] != "succeeded") + int(
        bad_done["state"] not in ("succeeded", "failed", "cancelled")  # a clear failure is not a loss
    )
    # the NaN handler returns each time it runs: a second attempt would be a second completion
    fault_report.committed_twice = int(bad_done["attempts"] > 1) + sum(
        1 for n in completed_runs(log).values() if n > 1
    )
    fault_report.processes_left = len(wait_until_gone(tree))
    fault_report.gpus_left_allocated = gpus_left_allocated(cluster)
    fault_report.notes.append(
        f"timed from the NaN task's end to the next one's; worker stopped after, exit {exit_code}"
    )
    fault_report.check()
    assert bad_done["state"] == "failed" and bad_done["attempts"] == 1, bad_done
    assert bad_done["error"]["type"] == "invalid_output", bad_done["error"]
    assert bad_done["error"]["field"] == "output.x"
    assert bad_done["error"]["message"].startswith("output.x: ")
    assert bad_done["output"] is None
    assert good_done["state"] == "succeeded" and good_done["output"] == {"n": 1}, good_done
    assert good_done["worker"] == bad_done["worker"] == warm["worker"]
    assert exit_code == 0, (cluster.tmp / "worker-w.log").read_text()[-3000:]
