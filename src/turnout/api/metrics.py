"""`GET /metrics` (and `GET /healthz`): Prometheus series for everything the dashboard shows, through prometheus-client.

Two kinds of series, chosen by whether a number must survive a restart and agree across replicas:

- **Read from the store at scrape time** (`StateCollector`): queue depth, active tasks, finished tasks by
  final state, the run-seconds histogram and cost, workers by state, each GPU's memory (total, allocated,
  measured) and readings. The database holds every task and worker, so these are exact, survive a controller
  restart, and every replica behind a load balancer answers the same. The finished-task counters and the
  histogram come from one grouped scan of the task table per scrape.
- **Counted where the event happens, in this process** (`Metrics.routing`, the controller's
  `lease_expiries`, the worker channels): a routing decision is made once, at lease time, and only its last
  outcome is stored on the task; a lease expiry is a moment, not a state; a channel is a connection to this
  process. These reset when the controller restarts, which
  Prometheus' `rate()` and `increase()` handle; with several replicas, `sum()` them.

Each app has its own `CollectorRegistry` (never the global one), so several controllers can live in one
process, as they do in tests.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from turnout import __version__
from turnout.api.schemas import iso
from turnout.api.service import Service
from turnout.api.strictjson import StrictJsonRoute
from turnout.controller import Controller
from turnout.dashboard.view import GpuView, queue_views, reason_class, worker_views
from turnout.models import Lease, WorkerState

RUN_S_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
GPU_LABELS = ("worker", "gpu", "index", "model", "kind")  # kind: gpu (physical) or mig (a MIG device)
TERMINAL = ("succeeded", "failed", "cancelled")


class Metrics:
    """The app's registry: in-process counters, and the collector that reads the store when scraped."""

    def __init__(self, controller: Controller) -> None:
        self.registry = CollectorRegistry()
        self.routing = Counter(
            "turnout_routing_decisions",
            "Routing decisions made at lease time, by device and reason (numbers and GPU ids replaced by N, GPU).",
            ["device", "reason"],
            registry=self.registry,
        )
        self.channel_requests = Counter(
            "turnout_worker_channel_requests",
            "Worker protocol requests answered over the WebSocket channel rather than HTTP, by call.",
            ["call"],
            registry=self.registry,
        )
        self.channels_open = Gauge(
            "turnout_worker_channels_open", "Worker channels (WebSockets) open on this controller.",
            registry=self.registry,
        )  # fmt: skip
        self.registry.register(StateCollector(controller))

    def observe_leases(self, leases: Sequence[Lease]) -> None:
        for lease in leases:
            reason = lease.task.routing.reason if lease.task.routing else None
            self.routing.labels(lease.device.value, reason_class(reason)).inc()

    def render(self) -> bytes:
        """The exposition text; reads the store, so run it off the event loop."""
        return generate_latest(self.registry)


class StateCollector(Collector):
    def __init__(self, controller: Controller) -> None:
        self.ctrl = controller

    def collect(self) -> Iterator[Metric]:
        ctrl = self.ctrl
        now = ctrl.clock()
        yield from _task_metrics(ctrl.task_stats(run_s_buckets=RUN_S_BUCKETS))
        everyone = ctrl.all_workers()
        live = [w for w in everyone if w.state is not WorkerState.GONE]
        by_state = GaugeMetricFamily("turnout_workers", "Workers by state.", labels=["state"])
        for state in WorkerState:
            by_state.add_metric([state.value], sum(1 for w in everyone if w.state is state))
        yield by_state
        views = worker_views(live, ctrl.active_tasks(), viewer_tenant=None, now=now)
        active = GaugeMetricFamily("turnout_worker_active_tasks", "Tasks leased to or running on each worker.",
                                   labels=["worker", "worker_id"])  # fmt: skip
        age = GaugeMetricFamily("turnout_worker_heartbeat_age_seconds", "Seconds since each worker's last heartbeat.",
                                labels=["worker", "worker_id"])  # fmt: skip
        for v in views:
            active.add_metric([v.name, v.id], v.active_tasks)
            age.add_metric([v.name, v.id], v.heartbeat_age_s)
        yield active
        yield age
        yield from _gpu_metrics([(v.name, g) for v in views for g in v.gpus])
        yield from _run_metrics(ctrl)
        yield CounterMetricFamily(
            "turnout_lease_expiries",
            "Tasks taken back from workers that died: silent for three heartbeats or their connection gone "
            "(re-queued, or failed worker_lost). Counted by this controller since it started.",
            value=ctrl.lease_expiries,
        )


def _task_metrics(stats: list[dict[str, Any]]) -> Iterator[Metric]:
    depth = GaugeMetricFamily(
        "turnout_queue_depth",
        "Queued tasks by capability and the device class their gpu value allows (cpu, gpu, any).",
        labels=["capability", "device_class"],
    )
    running = GaugeMetricFamily(
        "turnout_tasks_active",
        "Leased or running tasks by capability and device.",
        labels=["capability", "device"],
    )
    for q in queue_views(stats):
        if q.queued:
            depth.add_metric([q.capability, q.device_class], q.queued)
        if q.running:
            running.add_metric([q.capability, q.device_class], q.running)
    finished = CounterMetricFamily(
        "turnout_tasks_finished",
        "Tasks that reached a final state, by capability, state and device (none: never ran).",
        labels=["capability", "state", "device"],
    )
    cost = CounterMetricFamily(
        "turnout_task_cost_usd", "Cost of finished tasks in USD (where prices are configured).",
        labels=["capability", "device"],
    )  # fmt: skip
    hist = HistogramMetricFamily(
        "turnout_task_run_seconds", "Run time of finished tasks.", labels=["capability", "device"]
    )
    sums: dict[tuple[str, str], tuple[list[int], int, float, float]] = {}
    counts: dict[tuple[str, str, str], int] = {}
    for row in stats:
        if row["state"] not in TERMINAL:
            continue
        device = row["device"] or "none"
        key3 = (row["capability"], row["state"], device)
        counts[key3] = counts.get(key3, 0) + row["count"]
        buckets, n, total, usd = sums.get(
            (row["capability"], device), ([0] * len(RUN_S_BUCKETS), 0, 0.0, 0.0)
        )
        sums[(row["capability"], device)] = (
            [a + b for a, b in zip(buckets, row["run_s_buckets"], strict=True)],
            n + row["run_s_count"],
            total + row["run_s_sum"],
            usd + row["cost_usd"],
        )
    for labels, n in sorted(counts.items()):
        finished.add_metric(list(labels), n)
    for (cap, device), (buckets, n, total, usd) in sorted(sums.items()):
        cost.add_metric([cap, device], usd)
        if n:
            pairs = [(_le(b), float(c)) for b, c in zip(RUN_S_BUCKETS, buckets, strict=True)]
            hist.add_metric([cap, device], [*pairs, ("+Inf", float(n))], sum_value=total)
    yield from (depth, running, finished, cost, hist)


def _run_metrics(ctrl: Controller) -> Iterator[Metric]:
    """Cost per capability and tenant, and pipeline runs by state: read from the store, like the task series."""
    cost = CounterMetricFamily("turnout_tenant_cost_usd", "Cost of tasks in USD, by capability and tenant.",
                               labels=["capability", "tenant"])  # fmt: skip
    for capability, tenant, usd in ctrl.cost_by_tenant():
        cost.add_metric([capability, tenant], usd)
    runs = GaugeMetricFamily(
        "turnout_pipeline_runs", "Pipeline runs by pipeline and state.", labels=["pipeline", "state"]
    )
    for pipeline, state, n in ctrl.run_counts():
        runs.add_metric([pipeline, state], n)
    yield from (cost, runs)


def _gpu_metrics(gpus: list[tuple[str, GpuView]]) -> Iterator[Metric]:
    def family(name: str, doc: str, extra: Sequence[str] = ()) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=[*GPU_LABELS, *extra])

    total = family("turnout_gpu_memory_total_bytes", "Memory of each GPU and MIG device.")
    allocated = family(
        "turnout_gpu_memory_allocated_bytes", "Memory granted to tasks on each GPU and MIG device."
    )
    by_tenant = family("turnout_gpu_tenant_memory_allocated_bytes", "Memory granted on each GPU, by tenant.",
                       ["tenant"])  # fmt: skip
    used = family("turnout_gpu_memory_used_bytes", "Memory measured in use on each physical GPU.")
    util = family("turnout_gpu_utilization_ratio", "GPU utilization, 0 to 1.")
    temp = family("turnout_gpu_temperature_celsius", "GPU temperature.")
    power = family("turnout_gpu_power_watts", "GPU power draw.")
    quarantined = family("turnout_gpu_quarantined", "1 while nothing new may be placed on the device.")
    for worker, g in gpus:
        units = [(g, "gpu"), *((m, "mig") for m in g.mig_devices)]
        for unit, kind in units:
            labels = [worker, unit.uuid, str(unit.index), unit.name, kind]
            total.add_metric(labels, unit.memory_total_bytes)
            allocated.add_metric(labels, unit.allocated_bytes)
            quarantined.add_metric(labels, 1 if unit.quarantined else 0)
            tenants: dict[str, int] = {}
            for a in unit.allocations:
                tenants[a.tenant] = tenants.get(a.tenant, 0) + a.memory_bytes
            for tenant, n in sorted(tenants.items()):
                by_tenant.add_metric([*labels, tenant], n)
        labels = [worker, g.uuid, str(g.index), g.name, "gpu"]
        for fam, value in ((used, g.memory_used_bytes), (temp, g.temperature_c), (power, g.power_w),
                           (util, None if g.utilization_pct is None else g.utilization_pct / 100)):  # fmt: skip
            if value is not None:
                fam.add_metric(labels, value)
    yield from (total, allocated, by_tenant, used, util, temp, power, quarantined)


def _le(bound: float) -> str:
    return repr(float(bound))


def router(service: Service, metrics: Metrics) -> APIRouter:
    """`GET /healthz` and `GET /metrics`, open to anyone: probes and scrapers carry no token."""
    api = APIRouter(route_class=StrictJsonRoute)

    @api.get("/healthz")
    async def healthz() -> dict[str, Any]:  # liveness, and the controller's clock (`turnout doctor`: skew)
        return {"ok": True, "version": __version__, "time": iso(time.time())}

    async def scrape() -> Response:
        return Response(await service.read(metrics.render), media_type=CONTENT_TYPE_LATEST)

    # any query string is ignored, as scrapers may add their own (no strict parameter check here)
    api.add_api_route(
        "/metrics", scrape, methods=["GET"], include_in_schema=False, route_class_override=APIRoute
    )
    return api
