"""Faults of the controller: SIGKILL while submissions stream in, then a restart on the same database."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from tests.conftest import Cluster
from tests.faults.conftest import APP, FaultReport, completed_runs


def test_sigkill_of_the_controller_under_a_steady_stream_of_submissions(
    cluster: Cluster, tmp_path: Path, fault_report: FaultReport
) -> None:
    # Given a client submitting one task after another, and recording each submission the API accepted
    log = tmp_path / "runs.log"
    accepted: list[str] = []
    stop = threading.Event()
    headers = {"Authorization": f"Bearer {cluster.token}"}

    def submit_forever() -> None:
        n = 0
        with httpx.Client(base_url=cluster.url, headers=headers, timeout=5) as client:
            while not stop.is_set():
                body = {"capability": "sleep", "input": {"seconds": 0, "log": str(log), "n": n},
                        "placement_timeout_s": 120}  # fmt: skip
                try:
                    resp = client.post("/v1/tasks", json=body)
                except httpx.HTTPError:
                    time.sleep(0.02)  # the controller is down: no answer, so nothing was promised
                    continue
                if resp.status_code == 201:
                    accepted.append(resp.json()["id"])
                n += 1

    submitter = threading.Thread(target=submit_forever, daemon=True)
    submitter.start()
    try:
        deadline = time.monotonic() + 30
        while len(accepted) < 50 and time.monotonic() < deadline:
            time.sleep(0.02)
        # When the controller is SIGKILLed mid-stream and started again on the same SQLite file
        cluster.kill_controller()
        killed = time.monotonic()
        cluster.start_controller()
        fault_report.recover_s = time.monotonic() - killed
        headers["Authorization"] = f"Bearer {cluster.token}"
        deadline = time.monotonic() + 30
        count = len(accepted)
        while len(accepted) < count + 20 and time.monotonic() < deadline:  # the stream resumes
            time.sleep(0.02)
    finally:
        stop.set()
        submitter.join(timeout=10)

    # Then every submission that was answered 201 is there and runs exactly once
    cluster.start_worker(APP, name="after-restart", extra=["--cpus", "2"])
    results = {tid: cluster.result(tid, wait=60)["state"] for tid in accepted}
    fault_report.accepted_lost = sum(1 for s in results.values() if s != "succeeded")
    runs = completed_runs(log)
    fault_report.committed_twice = sum(1 for n in runs.values() if n > 1)
    fault_report.notes.append(f"{len(accepted)} accepted")
    fault_report.check()
    assert set(accepted) <= set(runs)
