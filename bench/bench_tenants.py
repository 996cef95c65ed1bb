"""Fairness between tenants: a calm tenant's submit-to-result latency, alone and while another tenant floods.

One controller (limits `"*": {submit_per_s: 200}`, the DESIGN.md default, and `flood-50` at 50 a second)
and two shared-pool workers of the demo app, each offering 0.4 cores, so four 0.1-core tasks at a time
each: eight slots in all.

- unloaded: the calm tenant runs `noop` tasks one after another (POST, then GET .../result?wait=10).
- flood at 50/s, then at 200/s: the flooding tenant submits `sleep` tasks of 0.1 s from several concurrent
  clients as fast as they can, never waiting out a 429 (a hostile client). The pool runs at most 80 of
  them a second: at 50 a second it keeps up with slots mostly busy; at 200 a second the flooding tenant's
  queue grows by over 100 a second. Once it is deep, the calm tenant measures again.

Each phase also records the CPU the controller used (in % of one core) and the host's load, since on a
small shared host the flood's own clients and the controller's work compete with the calm tenant's.

The claim (issue 10): under the flood, the calm tenant's p50 stays within 2x of its unloaded p50. Without
per-tenant rate limits and round-robin leasing, its tasks would wait behind the flood's whole backlog.

    python -m bench --only tenants [--quick]
    from bench.bench_tenants import run           run(quick=False) -> dict
"""

from __future__ import annotations

import asyncio
import multiprocessing
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.common import Processes, TurnoutCluster, percentile

NAME = "tenants"
AIM_P50_RATIO = 2.0
CONFIG = 'limits:\n  "*": {submit_per_s: 200}\n  flood-50: {submit_per_s: 50}\n'
FLOOD_CLIENTS = 4


def _latency(url: str, token: str, n: int, warmup: int) -> dict[str, Any]:
    samples: list[float] = []
    submits: list[float] = []  # the POST alone: time at the door and in the commit
    queued: list[float] = []  # the task's own queue_s: accepted to leased
    failed = 0
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
        for i in range(warmup + n):
            t0 = time.perf_counter()
            task_id = client.post("/v1/tasks", json={"capability": "noop"}).json()["id"]
            t1 = time.perf_counter()
            task = client.get(f"/v1/tasks/{task_id}/result", params={"wait": 10}).json()
            dt = time.perf_counter() - t0
            if i >= warmup:
                samples.append(dt)
                submits.append(t1 - t0)
                queued.append(task.get("queue_s") or 0.0)
                failed += task["state"] != "succeeded"
    return {
        "n": len(samples), "failed": failed,
        "p50_ms": round(1000 * percentile(samples, 50), 2), "p90_ms": round(1000 * percentile(samples, 90), 2),
        "p99_ms": round(1000 * percentile(samples, 99), 2), "max_ms": round(1000 * max(samples), 2),
        "submit_p50_ms": round(1000 * percentile(submits, 50), 2), "queue_p50_ms": round(1000 * percentile(queued, 50), 2),
    }  # fmt: skip


def _flood(url: str, token: str, stop: Any, counts: Any) -> None:
    """The flooding clients, in a process of their own: in the measuring process they would take the GIL
    from the calm tenant's client and inflate what is measured."""

    async def client(http: httpx.AsyncClient) -> None:
        body = {"capability": "sleep", "input": {"seconds": 0.1}}
        while not stop.is_set():
            resp = await http.post("/v1/tasks", json=body)
            slot = {201: 0, 429: 1}.get(resp.status_code, 2)
            with counts.get_lock():
                counts[slot] += 1

    async def main() -> None:
        limits = httpx.Limits(max_connections=FLOOD_CLIENTS, max_keepalive_connections=FLOOD_CLIENTS)
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30,
                                     limits=limits) as http:  # fmt: skip
            await asyncio.gather(*(client(http) for _ in range(FLOOD_CLIENTS)))

    asyncio.run(main())


class _Flood:
    """Concurrent clients submitting as fast as they can until stopped, ignoring Retry-After."""

    def __init__(self, url: str, token: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.stop = ctx.Event()
        self.counts = ctx.Array("l", 3)  # accepted, refused (429), other
        self.proc = ctx.Process(target=_flood, args=(url, token, self.stop, self.counts), daemon=True)
        self.started = 0.0
        self.elapsed_s = 0.0

    @property
    def accepted(self) -> int:
        return int(self.counts[0])

    @property
    def refused(self) -> int:
        return int(self.counts[1])

    @property
    def other(self) -> int:
        return int(self.counts[2])

    def __enter__(self) -> _Flood:
        self.started = time.perf_counter()
        self.proc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.proc.join(timeout=60)
        if self.proc.is_alive():
            self.proc.kill()
        self.elapsed_s = time.perf_counter() - self.started


class _Cpu:
    """CPU a process used over a block, in % of one core, and the host's 1-minute load at its end."""

    def __init__(self, proc: psutil.Process) -> None:
        self.proc = proc
        self.pct = 0.0
        self.load = 0.0

    def __enter__(self) -> _Cpu:
        self.t0, self.cpu0 = time.perf_counter(), sum(self.proc.cpu_times()[:2])
        return self

    def __exit__(self, *exc: object) -> None:
        used = sum(self.proc.cpu_times()[:2]) - self.cpu0
        self.pct = round(100 * used / (time.perf_counter() - self.t0), 1)
        self.load = round(psutil.getloadavg()[0], 2)


def _queued(url: str, token: str) -> int:
    """Tasks queued, across tenants (the operator's view of /v1/capabilities)."""
    body = httpx.get(
        f"{url}/v1/capabilities", headers={"Authorization": f"Bearer {token}"}, timeout=30
    ).json()
    return sum(c["queue_depth"] for c in body["capabilities"])


def run(quick: bool = False, timeout_s: float = 300) -> dict[str, Any]:
    n, warmup, backlog_s = (40, 10, 3.0) if quick else (150, 20, 8.0)
    procs = Processes()
    with tempfile.TemporaryDirectory(prefix="turnout-bench-tenants-") as tmp:
        cluster = TurnoutCluster(
            Path(tmp), procs, controller_args=["--config", str(Path(tmp) / "turnout.yaml")]
        )
        (Path(tmp) / "turnout.yaml").write_text(CONFIG)
        try:
            cluster.start_controller()
            for name in ("pool-1", "pool-2"):
                cluster.start_worker("turnout.demo:app", name, extra=["--cpus", "0.4"])
            tokens = {}
            for tenant in ("calm", "flood", "flood-50"):
                made = httpx.post(f"{cluster.url}/v1/tokens", headers=cluster.headers, timeout=30,
                                  json={"role": "submit", "tenant": tenant}).json()  # fmt: skip
                tokens[tenant] = made["token"]
            out: dict[str, Any] = {
                "config": CONFIG.strip(),
                "workers": 2,
                "slots": 8,
                "flood_clients": FLOOD_CLIENTS,
            }
            assert cluster.controller is not None
            controller = psutil.Process(cluster.controller.pid)
            with _Cpu(controller) as cpu:
                out["unloaded"] = _latency(cluster.url, tokens["calm"], n, warmup)
            out["unloaded"]["controller_cpu_pct"], out["unloaded"]["host_load"] = cpu.pct, cpu.load
            for phase, tenant, wait_s in (("flood_50", "flood-50", 2.0), ("flood_200", "flood", backlog_s)):
                with _Flood(cluster.url, tokens[tenant]) as flood:
                    time.sleep(wait_s)  # let the flood settle (and, at 200/s, its queue grow deep)
                    backlog_before = _queued(cluster.url, cluster.token)
                    with _Cpu(controller) as cpu:
                        calm = _latency(cluster.url, tokens["calm"], n, warmup)
                    backlog_after = _queued(cluster.url, cluster.token)
                out[phase] = {
                    "calm": {**calm, "controller_cpu_pct": cpu.pct, "host_load": cpu.load},
                    "backlog": [backlog_before, backlog_after],
                    "submissions": {"accepted_per_s": round(flood.accepted / flood.elapsed_s, 1),
                                    "refused_per_s": round(flood.refused / flood.elapsed_s, 1), "other": flood.other},
                    "p50_ratio": round(calm["p50_ms"] / out["unloaded"]["p50_ms"], 2),
                }  # fmt: skip
            out["aim_p50_ratio"] = AIM_P50_RATIO
            out["meets_aim"] = {
                phase: out[phase]["p50_ratio"] <= AIM_P50_RATIO and out[phase]["calm"]["failed"] == 0
                for phase in ("flood_50", "flood_200")
            }
            return out
        except Exception as exc:
            logs = {
                name: cluster.log_tail(name, 1500)
                for name in ("controller", "worker-pool-1", "worker-pool-2")
            }
            return {"error": f"{type(exc).__name__}: {exc}", "logs": logs}
        finally:
            procs.stop_all()


def summary(result: dict[str, Any]) -> str:
    if "error" in result:
        return f"  error: {result['error']}"
    u = result["unloaded"]
    lines = [f"  calm tenant alone: p50 {u['p50_ms']} ms, p99 {u['p99_ms']} ms (POST {u['submit_p50_ms']} ms, "
             f"queue_s {u['queue_p50_ms']} ms; controller {u['controller_cpu_pct']}% CPU, load {u['host_load']})"]  # fmt: skip
    for phase in ("flood_50", "flood_200"):
        p, c, s = result[phase], result[phase]["calm"], result[phase]["submissions"]
        met = "met" if result["meets_aim"][phase] else "NOT met"
        lines += [
            f"  {phase}: calm p50 {c['p50_ms']} ms, p99 {c['p99_ms']} ms (POST {c['submit_p50_ms']} ms, queue_s "
            f"{c['queue_p50_ms']} ms; controller {c['controller_cpu_pct']}% CPU, load {c['host_load']})",
            f"    p50 ratio {p['p50_ratio']} (aim <= {result['aim_p50_ratio']}): {met}; flood {s['accepted_per_s']}/s "
            f"accepted, {s['refused_per_s']}/s refused (429); its queue {p['backlog'][0]} -> {p['backlog'][1]}",
        ]  # fmt: skip
    return "\n".join(lines)
