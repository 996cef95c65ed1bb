"""`/metrics` after a known workload says what the API says: counts, run times, cost, queues, GPUs, workers.

A real controller (with prices), a CPU worker, a fake-GPU worker and a worker that is killed mid-task.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Cluster, Processes
from turnout.dashboard.view import reason_class

GIB = 1024**3
PRICES = "prices:\n  cpu: 0.0002\n  gpu: 0.0015\n"


@pytest.fixture
def priced(tmp_path: Path, processes: Processes) -> Cluster:
    """A controller with prices configured, so tasks carry cost_usd."""
    config = tmp_path / "turnout.yaml"
    config.write_text(PRICES)
    c = Cluster(
        tmp_path, processes, f"sqlite:///{tmp_path / 'turnout.db'}", extra_args=["--config", str(config)]
    )
    c.start_controller()
    return c


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(cluster: Cluster) -> Samples:
    resp = httpx.get(f"{cluster.url}/metrics", timeout=30)  # no token: scrapers carry none
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def series(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def all_tasks(cluster: Cluster, **filters: Any) -> list[dict[str, Any]]:
    return cluster.api("GET", "/v1/tasks", params={"limit": 1000, **filters}).json()["tasks"]


def wait_for(check: Any, what: str, timeout_s: float = 30) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_metrics_after_a_known_workload_match_the_api(priced: Cluster) -> None:
    c = priced
    c.start_worker("turnout.demo:app", name="cpu-box")
    c.start_worker("tests.apps.testapp:app", gpus="fake:1xA100-40Gi,1xA100-40Gi-mig:3g.20gb", name="gpu-box")
    # Given: five tasks that succeed on the CPU, two that fail, one that runs on the GPU, one that holds it
    done = [c.submit("echo", {"i": i}) for i in range(5)] + [c.submit("fail") for _ in range(2)]
    done.append(c.submit("work", {"sleep": 0}, gpu="require"))
    for t in done:
        assert c.result(t["id"])["state"] in ("succeeded", "failed")
    holder = c.submit("work", {"sleep": 60}, gpu="require")
    # ... and queued work nobody serves, one per device class
    ghosts = [
        c.submit("ghost", None, gpu=g, placement_timeout_s=600)
        for g in ("never", "never", "require", "prefer")
    ]
    wait_for(
        lambda: c.api("GET", f"/v1/tasks/{holder['id']}").json()["state"] == "running", "the GPU task to run"
    )

    # When: Prometheus scrapes
    m = scrape(c)

    # Then: finished tasks by final state, as the API lists them
    for cap, state, device in (
        ("echo", "succeeded", "cpu"),
        ("fail", "failed", "cpu"),
        ("work", "succeeded", "gpu"),
    ):
        listed = all_tasks(c, capability=cap, state=state)
        assert value(m, "turnout_tasks_finished_total", capability=cap, state=state, device=device) == len(
            listed
        )
    echo = all_tasks(c, capability="echo", state="succeeded")
    assert len(echo) == 5
    # the run-seconds histogram: count, sum and buckets from the tasks' own run_s
    runs = [t["run_s"] for t in echo]
    assert value(m, "turnout_task_run_seconds_count", capability="echo", device="cpu") == 5
    assert value(m, "turnout_task_run_seconds_sum", capability="echo", device="cpu") == pytest.approx(
        sum(runs), abs=1e-5
    )
    for le in ("0.01", "0.1", "1.0", "+Inf"):
        expected = sum(1 for r in runs if le == "+Inf" or r <= float(le))
        assert value(m, "turnout_task_run_seconds_bucket", capability="echo", device="cpu", le=le) == expected
    # cost, priced per device class
    assert all(t["cost_usd"] is not None for t in echo)
    assert value(m, "turnout_task_cost_usd_total", capability="echo", device="cpu") == pytest.approx(
        sum(t["cost_usd"] for t in echo), rel=1e-6
    )
    # queues per capability and device class
    queued = all_tasks(c, capability="ghost", state="queued")
    by_class = Counter({"never": "cpu", "require": "gpu", "prefer": "any"}[t["gpu"]] for t in queued)
    assert by_class == {"cpu": 2, "gpu": 1, "any": 1}
    for cls, n in by_class.items():
        assert value(m, "turnout_queue_depth", capability="ghost", device_class=cls) == n
    assert value(m, "turnout_tasks_active", capability="work", device="gpu") == 1
    # routing decisions, one per lease, by device and reason
    decided = Counter(
        (t["routing"]["device"], reason_class(t["routing"]["reason"])) for t in all_tasks(c) if t["routing"]
    )
    assert {
        (dict(k)["device"], dict(k)["reason"]): v
        for k, v in series(m, "turnout_routing_decisions_total").items()
    } == decided
    # GPUs: total and measured from the worker's report, allocated from what the running task holds
    gpu_box = next(w for w in c.api("GET", "/v1/workers").json()["workers"] if w["name"] == "gpu-box")
    gpu = gpu_box["gpus"][0]
    labels = {"worker": "gpu-box", "gpu": gpu["uuid"], "index": "0", "model": gpu["name"], "kind": "gpu"}
    assert value(m, "turnout_gpu_memory_total_bytes", **labels) == gpu["memory_total_bytes"] == 40 * GIB
    assert value(m, "turnout_gpu_memory_allocated_bytes", **labels) == 40 * GIB  # gpu: 1 holds it whole
    assert value(m, "turnout_gpu_tenant_memory_allocated_bytes", **labels, tenant="default") == 40 * GIB
    assert value(m, "turnout_gpu_memory_used_bytes", **labels) == gpu["metrics"]["memory_used_bytes"]
    assert value(m, "turnout_gpu_temperature_celsius", **labels) == gpu["metrics"]["temperature_c"]
    assert value(m, "turnout_gpu_quarantined", **labels) == 0
    mig = gpu_box["gpus"][1]["mig_devices"][0]  # a MIG device is its own series, under its parent's index
    mig_labels = {
        **labels,
        "gpu": mig["uuid"],
        "index": "1",
        "model": f"{gpu['name']} 3g.20gb",
        "kind": "mig",
    }
    assert value(m, "turnout_gpu_memory_total_bytes", **mig_labels) == mig["memory_total_bytes"] == 20 * GIB
    assert value(m, "turnout_gpu_memory_allocated_bytes", **mig_labels) == 0
    workers = c.api("GET", "/v1/workers").json()["workers"]
    assert (
        value(m, "turnout_workers", state="healthy")
        == sum(1 for w in workers if w["state"] == "healthy")
        == 2
    )
    assert value(m, "turnout_worker_active_tasks", worker="gpu-box", worker_id=gpu_box["id"]) == 1
    assert value(m, "turnout_lease_expiries_total") == 0
    for t in [holder, *ghosts]:
        c.api("POST", f"/v1/tasks/{t['id']}/cancel")


def test_a_worker_that_dies_mid_task_counts_one_lease_expiry(cluster: Cluster) -> None:
    doomed = cluster.start_worker("tests.apps.testapp:app", name="doomed")
    task = cluster.submit("count", {"sleep": 60}, max_retries=0)
    wait_for(
        lambda: cluster.api("GET", f"/v1/tasks/{task['id']}").json()["state"] == "running", "the task to run"
    )
    os.killpg(doomed.pid, signal.SIGKILL)  # no leave, no more heartbeats
    lost = cluster.result(task["id"], wait=60)
    assert lost["error"]["type"] == "worker_lost"
    m = scrape(cluster)
    assert value(m, "turnout_lease_expiries_total") == 1
    assert value(m, "turnout_tasks_finished_total", capability="count", state="failed", device="cpu") == 1
    workers = cluster.api("GET", "/v1/workers").json()["workers"]
    assert (
        value(m, "turnout_workers", state="unhealthy")
        == sum(1 for w in workers if w["state"] == "unhealthy")
        == 1
    )


def test_metrics_use_a_registry_per_app_so_two_controllers_in_one_process_do_not_collide(
    tmp_path: Path,
) -> None:
    from turnout.api.metrics import Metrics
    from turnout.config import ControllerSettings
    from turnout.controller import Controller
    from turnout.store import open_store

    stores = [open_store(f"sqlite:///{tmp_path / f'{i}.db'}") for i in range(2)]
    try:
        first, second = (Metrics(Controller(s, ControllerSettings())) for s in stores)
        first.routing.labels("cpu", "gpu: never").inc()
        assert b'turnout_routing_decisions_total{device="cpu",reason="gpu: never"} 1.0' in first.render()
        assert b"turnout_routing_decisions_total{" not in second.render()
    finally:
        for s in stores:
            s.close()


def test_the_grafana_dashboard_queries_only_series_the_controller_exports(cluster: Cluster) -> None:
    import json
    import re

    from tests.conftest import REPO

    resp = httpx.get(f"{cluster.url}/metrics", timeout=30)
    families = {f.name: f.type for f in text_string_to_metric_families(resp.text)}
    dashboard = json.loads((REPO / "examples" / "grafana" / "turnout.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    used = {name for e in exprs for name in re.findall(r"\bturnout_[a-z_]+", e)}
    for name in sorted(used):
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        if base in families and families[base] == "histogram":
            continue
        base = re.sub(r"_total$", "", name)
        assert base in families, f"{name} is queried by the dashboard but not exported"
    assert {"turnout_queue_depth", "turnout_task_run_seconds", "turnout_gpu_memory_used_bytes"} <= set(
        families
    )
