"""Shared-GPU memory enforcement: which running tasks use more than their share."""

from __future__ import annotations

from turnout.gpu.devices import GpuMetrics, GpuProcess
from turnout.worker.gpuwatch import SharedTask, memory_over_limit

GiB = 2**30


def test_a_task_over_its_share_is_named_with_its_usage() -> None:
    tasks = [SharedTask("t1", 100, ("GPU-a",), 4 * GiB), SharedTask("t2", 200, ("GPU-a",), 4 * GiB)]
    metrics = [GpuMetrics("GPU-a", processes=(GpuProcess(100, 3 * GiB), GpuProcess(201, 5 * GiB)))]
    # t2's memory is held by its child 201: descendants count
    assert memory_over_limit(tasks, metrics, {100: set(), 200: {201}}) == {"t2": 5 * GiB}


def test_usage_on_other_gpus_does_not_count() -> None:
    tasks = [SharedTask("t1", 100, ("GPU-a",), 1 * GiB)]
    metrics = [GpuMetrics("GPU-b", processes=(GpuProcess(100, 9 * GiB),))]
    assert memory_over_limit(tasks, metrics, {}) == {}


def test_usage_exactly_at_the_limit_is_allowed() -> None:
    tasks = [SharedTask("t1", 100, ("GPU-a",), 2 * GiB)]
    metrics = [GpuMetrics("GPU-a", processes=(GpuProcess(100, 2 * GiB),))]
    assert memory_over_limit(tasks, metrics, {}) == {}
