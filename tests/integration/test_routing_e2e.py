"""Routing end to end: real controller, real workers (fake GPUs), real HTTP."""

from __future__ import annotations

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


def test_require_without_a_gpu_worker_fails_no_capacity_after_placement_timeout(cluster: Cluster) -> None:
    cluster.start_worker(APP, gpus="none", name="cpu")
    task = cluster.submit("work", {}, gpu="require", placement_timeout_s=1)
    done = cluster.result(task["id"], wait=20)
    assert done["state"] == "failed"
    assert done["error"]["type"] == "no_capacity"
    assert done["attempts"] == 0


def test_prefer_waits_for_a_busy_gpu_then_falls_back_after_gpu_wait_s(cluster: Cluster) -> None:
    cluster.start_worker(APP, gpus="fake:1x24Gi", name="gpu", extra=["--cpus", "1"])
    cluster.start_worker(APP, gpus="none", name="cpu")
    busy = cluster.submit("work", {"sleep": 4}, gpu="require")
    cluster.result(busy["id"], wait=0)
    waiting = cluster.submit("work", {}, gpu="prefer", gpu_wait_s=1)
    done = cluster.result(waiting["id"], wait=20)
    assert done["state"] == "succeeded"
    assert done["device"] == "cpu"
    assert done["routing"]["reason"].startswith("gpu queue wait")


def test_gpu_only_capability_with_prefer_waits_for_gpu_worker_that_arrives_later(cluster: Cluster) -> None:
    task = cluster.submit("gpuonly", {}, gpu="prefer", placement_timeout_s=30)
    cluster.start_worker(APP, gpus="fake:1x24Gi", name="late-gpu")
    done = cluster.result(task["id"], wait=20)
    assert done["state"] == "succeeded"
    assert done["device"] == "gpu"
