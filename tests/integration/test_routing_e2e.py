"""Routing end to end: real controller, real workers (fake GPUs), real HTTP. (A `require` task no worker
can serve failing `no_capacity` needs no worker process: tests/inprocess/test_api_lifecycle.py.)"""

from __future__ import annotations

import time

from tests.conftest import Cluster

APP = "tests.apps.testapp:app"


def test_prefer_runs_on_the_gpu_variant_when_a_fake_gpu_worker_is_up(cluster: Cluster) -> None:
    cluster.start_worker(APP, gpus="fake:1x24Gi", name="gpu")
    task = cluster.result(cluster.submit("work", {}, gpu="prefer")["id"])
    assert task["state"] == "succeeded"
    assert task["device"] == "gpu"
    assert task["routing"] == {"requested": "prefer", "device": "gpu", "reason": "gpu available"}
    assert task["output"]["device"] == "cuda:0"
    assert task["output"]["env"] == task["gpus"][0]  # the process sees only its GPU


def test_prefer_falls_back_to_cpu_with_the_reason_when_no_gpu_worker_exists(cluster: Cluster) -> None:
    cluster.start_worker(APP, gpus="none", name="cpu")
    task = cluster.result(cluster.submit("work", {}, gpu="prefer")["id"])
    assert task["state"] == "succeeded"
    assert task["device"] == "cpu"
    assert task["routing"]["reason"] == "no healthy gpu worker"
    assert task["output"]["env"] == ""  # a CPU task sees no GPU


def test_never_stays_on_cpu_even_with_a_gpu_worker(cluster: Cluster) -> None:
    cluster.start_worker(APP, gpus="fake:1x24Gi", name="gpu")
    for _ in range(3):
        task = cluster.result(cluster.submit("work", {}, gpu="never")["id"])
        assert task["state"] == "succeeded"
        assert task["device"] == "cpu"
        assert task["gpus"] == []
        assert task["output"]["env"] == ""


def _running(cluster: Cluster, task_id: str, timeout_s: float = 20) -> dict:
    """The task once a worker runs it (polled with a deadline); it may pass through queued and leased only."""
    deadline = time.monotonic() + timeout_s
    while True:
        task = cluster.api("GET", f"/v1/tasks/{task_id}").json()
        if task["state"] == "running":
            return task
        assert task["state"] in ("queued", "leased"), task
        assert time.monotonic() < deadline, f"task not running after {timeout_s} s: {task}"
        time.sleep(0.05)


def test_prefer_waits_for_a_busy_gpu_then_falls_back_after_gpu_wait_s(cluster: Cluster) -> None:
    cluster.start_worker(APP, gpus="fake:1x24Gi", name="gpu", extra=["--cpus", "1"])
    cluster.start_worker(APP, gpus="none", name="cpu")
    workers = {w["name"]: w["id"] for w in cluster.api("GET", "/v1/workers").json()["workers"]}
    busy = _running(cluster, cluster.submit("work", {"sleep": 10}, gpu="require")["id"])
    assert (busy["worker"], busy["device"]) == (workers["gpu"], "gpu")  # the only GPU is taken
    waiting = cluster.submit("work", {}, gpu="prefer", gpu_wait_s=1)
    done = cluster.result(waiting["id"], wait=20)
    assert done["state"] == "succeeded"
    assert (done["device"], done["worker"]) == ("cpu", workers["cpu"])
    assert done["routing"]["reason"].startswith("gpu queue wait")
    assert done["queue_s"] >= 1.0  # it waited gpu_wait_s for the GPU before falling back
    assert cluster.api("POST", f"/v1/tasks/{busy['id']}/cancel").status_code == 200  # no need to sit it out


def test_gpu_only_capability_with_prefer_waits_for_gpu_worker_that_arrives_later(cluster: Cluster) -> None:
    task = cluster.submit("gpuonly", {}, gpu="prefer", placement_timeout_s=30)
    cluster.start_worker(APP, gpus="fake:1x24Gi", name="late-gpu")
    done = cluster.result(task["id"], wait=20)
    assert done["state"] == "succeeded"
    assert done["device"] == "gpu"
