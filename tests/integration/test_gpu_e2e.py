"""GPU behaviour end to end with fake GPUs: OOM retries elsewhere, shares are enforced, faults quarantine."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from tests.conftest import Cluster
from turnout.gpu.fake import write_fake_state

APP = "tests.apps.testapp:app"


def _worker(cluster: Cluster, name: str) -> dict:
    return next(w for w in cluster.api("GET", "/v1/workers").json()["workers"] if w["name"] == name)


def _heartbeats(cluster: Cluster, name: str, count: int, showing: Callable[[dict], bool],
                timeout_s: float = 30) -> list[dict]:  # fmt: skip
    """The worker as the controller recorded it after each of `count` distinct heartbeats that satisfy `showing`.

    Polled with a deadline. A poll may miss a beat, but every beat returned is a real one: each has its own
    `last_heartbeat`, and that heartbeat carried the metrics and quarantine list shown with it.
    """
    beats: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(beats) < count:
        assert time.monotonic() < deadline, f"{len(beats)} of {count} heartbeats from {name} in {timeout_s} s"
        worker = _worker(cluster, name)
        if showing(worker):
            beats.setdefault(worker["last_heartbeat"], worker)
        time.sleep(0.1)
    return list(beats.values())


def _gpu0_reports_xid(xid: list[int]) -> Callable[[dict], bool]:
    return lambda worker: (worker["gpus"][0]["metrics"] or {}).get("xid_errors") == xid


def _after(iso_time: str) -> Callable[[dict], bool]:
    return lambda worker: datetime.fromisoformat(worker["last_heartbeat"]) > datetime.fromisoformat(iso_time)


def test_gpu_oom_is_retried_on_another_gpu_not_the_same_one(cluster: Cluster) -> None:
    cluster.start_worker(APP, gpus="fake:2x24Gi", name="two-gpus")
    done = cluster.result(cluster.submit("oom", {}, gpu="require")["id"])
    assert done["state"] == "succeeded", done
    assert done["attempts"] == 2
    first = done["routing"]["avoid_gpus"]
    assert done["output"]["gpus"] and done["output"]["gpus"][0] not in first
    assert done["output"]["limit"] == str(8 * 2**30)  # a shared task learns its memory limit
    assert abs(float(done["output"]["fraction"]) - 8 / 24) < 1e-3


def test_gpu_oom_with_no_other_gpu_falls_back_to_cpu_where_allowed(cluster: Cluster) -> None:
    cluster.start_worker(APP, gpus="fake:1x24Gi", name="one-gpu")
    done = cluster.result(cluster.submit("oom", {}, gpu="prefer")["id"])
    assert done["state"] == "succeeded", done
    assert done["device"] == "cpu"
    assert done["routing"]["reason"].startswith("gpu out of memory on GPU-fake-0")


def test_a_task_over_its_gpu_memory_share_is_stopped(cluster: Cluster, tmp_path: Path) -> None:
    state = tmp_path / "gpus.json"
    cluster.start_worker(APP, gpus=f"fake:1x24Gi@{state}", name="shared")
    task = cluster.submit("hog", {"state": str(state), "bytes": 6 * 2**30}, gpu="require", max_retries=0)
    done = cluster.result(task["id"], wait=30)
    assert done["state"] == "failed"
    assert done["error"]["type"] == "gpu_memory_exceeded"


def test_a_hardware_fault_quarantines_the_gpu_until_a_canary_passes(cluster: Cluster, tmp_path: Path) -> None:
    state = tmp_path / "gpus.json"
    cluster.start_worker(APP, gpus=f"fake:1x24Gi@{state}", name="faulty", extra=["--canary-backoff-s", "1"])
    write_fake_state(state, "GPU-fake-0", xid=[79], fell_off_bus=True)
    deadline = time.monotonic() + 20
    while not _worker(cluster, "faulty")["gpus"][0]["quarantined"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "bus" in _worker(cluster, "faulty")["gpus"][0]["quarantined"]
    # nothing new is placed on it: a GPU-only task still waits through two more heartbeats of the quarantine
    waiting = cluster.submit("gpuonly", {}, gpu="require", placement_timeout_s=60)
    beats = _heartbeats(cluster, "faulty", 2, _after(waiting["created_at"]))
    assert all("bus" in (b["gpus"][0]["quarantined"] or "") for b in beats), beats
    assert cluster.api("GET", f"/v1/tasks/{waiting['id']}").json()["state"] == "queued"
    # the fault clears; the canary passes; the GPU comes back and the task runs
    write_fake_state(state, "GPU-fake-0", xid=[], fell_off_bus=False)
    done = cluster.result(waiting["id"], wait=30)
    assert done["state"] == "succeeded", done
    assert not _worker(cluster, "faulty")["gpus"][0]["quarantined"]


def test_an_application_xid_does_not_quarantine(cluster: Cluster, tmp_path: Path) -> None:
    state = tmp_path / "gpus.json"
    cluster.start_worker(APP, gpus=f"fake:1x24Gi@{state}", name="appfault")
    write_fake_state(
        state, "GPU-fake-0", xid=[31]
    )  # an illegal address in one program: not the device's fault
    # three heartbeats that carried the Xid (so the worker's health check saw it) and, with it, no quarantine
    beats = _heartbeats(cluster, "appfault", 3, _gpu0_reports_xid([31]))
    assert [(b["state"], b["gpus"][0]["quarantined"]) for b in beats] == [("healthy", None)] * 3
    done = cluster.result(cluster.submit("gpuonly", {}, gpu="require")["id"])
    assert (done["state"], done["device"], done["gpus"]) == ("succeeded", "gpu", ["GPU-fake-0"]), done


def test_turnout_gpus_lists_fake_gpus_with_mig_devices(cluster: Cluster) -> None:
    out = cluster.cli("gpus", "--gpus", "fake:1xA100-40Gi-mig:3g.20gb,2g.10gb", "--json")
    assert out.returncode == 0, out.stderr
    gpus = json.loads(out.stdout)["gpus"]
    assert len(gpus) == 1 and gpus[0]["mig_mode"]
    assert [m["profile"] for m in gpus[0]["mig_devices"]] == ["3g.20gb", "2g.10gb"]
    bad = cluster.cli("gpus", "--gpus", "fake:banana")
    assert bad.returncode == 2 and "gpus" in bad.stderr and "Traceback" not in bad.stderr


def test_shared_gpu_tasks_pack_onto_the_worker_already_in_use(cluster: Cluster) -> None:
    cluster.start_worker(APP, gpus="fake:1x24Gi", name="left")
    cluster.start_worker(APP, gpus="fake:1x24Gi", name="right")
    first = cluster.submit("share", {"sleep": 8}, gpu="require")
    deadline = time.monotonic() + 20
    while cluster.api("GET", f"/v1/tasks/{first['id']}").json()["state"] not in ("leased", "running"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    holder = cluster.api("GET", f"/v1/tasks/{first['id']}").json()["worker"]
    others = [cluster.submit("share", {"sleep": 0}, gpu="require") for _ in range(3)]
    for t in others:
        done = cluster.result(t["id"], wait=30)
        assert done["state"] == "succeeded"
        assert done["worker"] == holder  # packed next to the running share, not spread to the idle GPU
