"""`GET /metrics` after a small workload, in-process (conftest.py): every family the controller exports, parsed
by prometheus-client's own parser, with its name, its type and a value the workload decides.

The workload: a CPU worker runs one task that succeeds and one that fails; a GPU worker holds one GPU task;
a third worker falls silent holding a task (one lease expiry, by moving the clock, never by sleeping), and
that task waits in the queue again.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.inprocess.conftest import CPU_SHOUT, GPU_SHOUT, Api, Worker
from turnout.dashboard.view import reason_class

pytestmark = pytest.mark.anyio
GIB = 2**30
READINGS = {"uuid": "GPU-fake-0", "utilization_pct": 40.0, "memory_used_bytes": 5 * GIB, "temperature_c": 61.0,
            "power_w": 250.0}  # fmt: skip

# every family /metrics exports, and its Prometheus type: a new family without a row here fails the test
FAMILIES = {
    "turnout_queue_depth": "gauge",
    "turnout_tasks_active": "gauge",
    "turnout_tasks_finished": "counter",
    "turnout_task_cost_usd": "counter",
    "turnout_task_run_seconds": "histogram",
    "turnout_tenant_cost_usd": "counter",
    "turnout_pipeline_runs": "gauge",
    "turnout_routing_decisions": "counter",
    "turnout_routing_decisions_created": "gauge",  # prometheus-client's creation time of each counter child
    "turnout_lease_expiries": "counter",
    "turnout_worker_channel_requests": "counter",  # no child here: in-process workers speak HTTP only
    "turnout_worker_channels_open": "gauge",
    "turnout_workers": "gauge",
    "turnout_worker_active_tasks": "gauge",
    "turnout_worker_heartbeat_age_seconds": "gauge",
    "turnout_gpu_memory_total_bytes": "gauge",
    "turnout_gpu_memory_allocated_bytes": "gauge",
    "turnout_gpu_tenant_memory_allocated_bytes": "gauge",
    "turnout_gpu_memory_used_bytes": "gauge",
    "turnout_gpu_utilization_ratio": "gauge",
    "turnout_gpu_temperature_celsius": "gauge",
    "turnout_gpu_power_watts": "gauge",
    "turnout_gpu_quarantined": "gauge",
}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(api: Api) -> tuple[dict[str, str], Samples]:
    """(family name -> type, (sample name, labels) -> value), as Prometheus would read them. No token."""
    resp = await api.client.get("/metrics", headers={"Authorization": ""})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    types: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(resp.text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return types, samples


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


async def gpu_heartbeat(worker: Worker) -> None:
    resp = await worker.post("heartbeat", {"metrics": {"gpus": [READINGS]}})
    assert resp.status_code == 200, resp.text


async def workload(api: Api) -> dict[str, Any]:
    cpu = await api.worker(CPU_SHOUT)
    gpu = await api.worker(GPU_SHOUT, gpus=1)
    doomed = await api.worker(CPU_SHOUT)
    ok, bad = await api.submit(gpu="never"), await api.submit(gpu="never", max_retries=0)
    leased = {t["id"]: t for t in (await cpu.lease(max_tasks=2))["tasks"]}
    await cpu.complete(leased[ok["id"]], {"text": "HI"})
    await cpu.complete(leased[bad["id"]], error={"type": "boom", "message": "no"})
    held = await api.submit(gpu="require")
    assert [t["id"] for t in (await gpu.lease())["tasks"]] == [held["id"]]
    lost = await api.submit(gpu="never")
    assert [t["id"] for t in (await doomed.lease(max_tasks=1))["tasks"]] == [lost["id"]]
    for _ in range(4):  # three heartbeats and more pass; `doomed` says nothing
        api.clock.advance(1.0)
        await cpu.heartbeat()
        await gpu_heartbeat(gpu)
    assert await api.sweep()
    assert (await api.task(lost["id"]))["state"] == "queued"
    return {"cpu": cpu, "gpu": gpu, "doomed": doomed, "ok": ok, "bad": bad, "held": held}


async def test_every_family_has_its_name_type_and_a_value_the_workload_decides(api: Api) -> None:
    # Given a small workload that leaves one task of each fate
    w = await workload(api)
    # When Prometheus scrapes
    types, m = await scrape(api)
    # Then each family is there, with its conventional name and type
    assert types == FAMILIES
    # queue depth by capability and device class; tasks in flight
    assert value(m, "turnout_queue_depth", capability="shout", device_class="cpu") == 1
    assert value(m, "turnout_tasks_active", capability="shout", device="gpu") == 1
    # tasks by final state, and the run-seconds histogram of those that ran
    assert value(m, "turnout_tasks_finished_total", capability="shout", state="succeeded", device="cpu") == 1
    assert value(m, "turnout_tasks_finished_total", capability="shout", state="failed", device="cpu") == 1
    assert value(m, "turnout_task_run_seconds_count", capability="shout", device="cpu") == 2
    assert value(m, "turnout_task_run_seconds_sum", capability="shout", device="cpu") == pytest.approx(0.5)
    assert value(m, "turnout_task_run_seconds_bucket", capability="shout", device="cpu", le="0.1") == 0
    assert value(m, "turnout_task_run_seconds_bucket", capability="shout", device="cpu", le="0.25") == 2
    assert value(m, "turnout_task_run_seconds_bucket", capability="shout", device="cpu", le="+Inf") == 2
    assert value(m, "turnout_task_cost_usd_total", capability="shout", device="cpu") == 0  # no prices set
    # routing decisions by device and reason: one per lease, as the tasks record them
    tasks = (await api.client.get("/v1/tasks", params={"limit": 100})).json()["tasks"]
    decided = Counter((t["routing"]["device"], reason_class(t["routing"]["reason"])) for t in tasks)
    counted = {
        (dict(labels)["device"], dict(labels)["reason"]): n
        for (name, labels), n in m.items()
        if name == "turnout_routing_decisions_total"
    }
    assert counted == decided
    assert sum(counted.values()) == 4  # ok, bad, held, and lost's first lease
    # lease expiries, and the workers' states and load
    assert value(m, "turnout_lease_expiries_total") == 1
    assert value(m, "turnout_workers", state="healthy") == 2
    assert value(m, "turnout_workers", state="unhealthy") == 1
    assert value(m, "turnout_worker_active_tasks", worker="w", worker_id=w["gpu"].id) == 1
    assert value(m, "turnout_worker_active_tasks", worker="w", worker_id=w["doomed"].id) == 0
    assert value(m, "turnout_worker_heartbeat_age_seconds", worker="w", worker_id=w["gpu"].id) == 0
    # per GPU: memory allocated (gpu: 1 holds it whole) and used (as its worker measured it)
    gpu = {"worker": "w", "gpu": "GPU-fake-0", "index": "0", "model": "Fake H100", "kind": "gpu"}
    assert value(m, "turnout_gpu_memory_total_bytes", **gpu) == 80 * GIB
    assert value(m, "turnout_gpu_memory_allocated_bytes", **gpu) == 80 * GIB
    assert value(m, "turnout_gpu_tenant_memory_allocated_bytes", **gpu, tenant="default") == 80 * GIB
    assert value(m, "turnout_gpu_memory_used_bytes", **gpu) == 5 * GIB
    assert value(m, "turnout_gpu_utilization_ratio", **gpu) == pytest.approx(0.4)
    assert value(m, "turnout_gpu_temperature_celsius", **gpu) == 61.0
    assert value(m, "turnout_gpu_power_watts", **gpu) == 250.0
    assert value(m, "turnout_gpu_quarantined", **gpu) == 0


async def test_a_scrape_needs_no_token_and_an_idle_controller_exports_zeros(api: Api) -> None:
    types, m = await scrape(api)
    assert value(m, "turnout_lease_expiries_total") == 0
    assert value(m, "turnout_workers", state="healthy") == 0
    assert {"turnout_queue_depth", "turnout_task_run_seconds", "turnout_gpu_memory_used_bytes"} <= set(types)
