"""The dashboard against what workers and tenants may send it, in-process: what one worker's GPUs hold is
never shown on another's, whatever UUIDs they report, and a page's path cannot become markup."""

from __future__ import annotations

from typing import Any

import pytest

from tests.inprocess.conftest import GPU_SHOUT, Api, Served

pytestmark = pytest.mark.anyio


def _holds(snapshot: dict[str, Any], worker_id: str) -> list[dict[str, Any]]:
    [worker] = [w for w in snapshot["workers"] if w["id"] == worker_id]
    return [a for g in worker["gpus"] for a in g["allocations"]]


async def test_a_task_on_one_workers_gpu_is_not_shown_on_anothers_gpu_of_the_same_uuid(api: Api) -> None:
    # Given two workers whose GPUs report one UUID (fake GPUs are GPU-fake-0 on every host), and a task on one
    first, second = await api.worker(GPU_SHOUT, gpus=1), await api.worker(GPU_SHOUT, gpus=1)
    task = await api.submit(gpu="require")
    [leased] = (await first.lease())["tasks"]
    assert leased["id"] == task["id"] and leased["gpus"]["uuids"] == ["GPU-fake-0"]
    # When the dashboard and /metrics are read
    snapshot = (await api.client.get("/v1/dashboard")).json()
    metrics = (await api.client.get("/metrics")).text
    # Then the hold is on the worker that runs it, and the other worker's GPU is free
    assert [a["task_id"] for a in _holds(snapshot, first.id)] == [task["id"]]
    assert _holds(snapshot, second.id) == []
    allocated = [line for line in metrics.splitlines()
                 if line.startswith("turnout_gpu_memory_allocated_bytes{") and 'gpu="GPU-fake-0"' in line]  # fmt: skip
    assert sorted(float(line.rsplit(" ", 1)[1]) > 0 for line in allocated) == [False, True], allocated


def test_a_task_pages_path_is_escaped_not_markup(served: Served) -> None:
    page = served.call("GET", '/tasks/"><img src=x onerror=alert(1)>', "")
    assert page.status_code == 200
    assert "<img" not in page.text and "&lt;img src=x onerror=alert(1)&gt;" in page.text
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
