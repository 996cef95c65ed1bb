"""Fairness between tenants: a calm tenant's submit-to-result latency, alone and while another tenant floods.

One controller (limits `"*": {submit_per_s: 200}`, the DESIGN.md default) and two shared-pool workers of
the demo app, each offering 0.4 cores, so four 0.1-core tasks at a time each: eight slots in all.

- unloaded: the calm tenant runs `noop` tasks one after another (POST, then GET .../result?wait=10).
- flood: the flooding tenant submits `sleep` tasks of 0.1 s from several concurrent clients as fast as
  they can, never waiting out a 429 (a hostile client). The pool runs at most 80 of them a second, and
  200 a second are admitted, so the flooding tenant's queue grows by over 100 a second. Once it is deep,
  the calm tenant measures again.

The claim (issue 10): under the flood, the calm tenant's p50 stays within 2x of its unloaded p50. Without
per-tenant rate limits and round-robin leasing, its tasks would wait behind the flood's whole backlog.

    python -m bench --only tenants [--quick]
    from bench.bench_tenants import run           run(quick=False) -> dict
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import Processes, TurnoutCluster, percentile

NAME = "tenants"
AIM_P50_RATIO = 2.0
CONFIG = 'limits:\n  "*": {submit_per_s: 200}\n'
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


class _Flood:
    """Concurrent clients submitting as fast as they can until stopped, ignoring Retry-After."""

    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url, token
        self.accepted = self.refused = self.other = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.started = 0.0
        self.elapsed_s = 0.0

    async def _client(self, http: httpx.AsyncClient) -> None:
        body = {"capability": "sleep", "input": {"seconds": 0.1}}
        while not self.stop.is_set():
            resp = await http.post("/v1/tasks", json=body)
            if resp.status_code == 201:
                self.accepted += 1
            elif resp.status_code == 429:
                self.refused += 1
            else:
                self.other += 1

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=FLOOD_CLIENTS, max_keepalive_connections=FLOOD_CLIENTS)
        async with httpx.AsyncClient(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"},
                                     timeout=30, limits=limits) as http:  # fmt: skip
            await asyncio.gather(*(self._client(http) for _ in range(FLOOD_CLIENTS)))

    def __enter__(self) -> _Flood:
        self.started = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=60)
        self.elapsed_s = time.perf_counter() - self.started


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
            for tenant in ("calm", "flood"):
                made = httpx.post(f"{cluster.url}/v1/tokens", headers=cluster.headers, timeout=30,
                                  json={"role": "submit", "tenant": tenant}).json()  # fmt: skip
                tokens[tenant] = made["token"]
            out: dict[str, Any] = {
                "config": CONFIG.strip(),
                "workers": 2,
                "slots": 8,
                "flood_clients": FLOOD_CLIENTS,
            }
            out["unloaded"] = _latency(cluster.url, tokens["calm"], n, warmup)
            with _Flood(cluster.url, tokens["flood"]) as flood:
                time.sleep(backlog_s)  # let the flood's queue grow deep before measuring
                out["backlog_before"] = _queued(cluster.url, cluster.token)
                out["flood"] = _latency(cluster.url, tokens["calm"], n, warmup)
                out["backlog_after"] = _queued(cluster.url, cluster.token)
            out["flood_submissions"] = {
                "accepted": flood.accepted, "refused_429": flood.refused, "other": flood.other,
                "seconds": round(flood.elapsed_s, 2), "accepted_per_s": round(flood.accepted / flood.elapsed_s, 1),
                "refused_per_s": round(flood.refused / flood.elapsed_s, 1),
            }  # fmt: skip
            ratio = out["flood"]["p50_ms"] / out["unloaded"]["p50_ms"]
            out["p50_ratio"] = round(ratio, 2)
            out["aim_p50_ratio"] = AIM_P50_RATIO
            out["meets_aim"] = ratio <= AIM_P50_RATIO and out["flood"]["failed"] == 0
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
    u, f, s = result["unloaded"], result["flood"], result["flood_submissions"]
    return "\n".join([
        f"  calm tenant p50 / p99: unloaded {u['p50_ms']} / {u['p99_ms']} ms, under flood {f['p50_ms']} / {f['p99_ms']} ms",
        f"  of which the POST (p50): {u['submit_p50_ms']} -> {f['submit_p50_ms']} ms; queue_s (p50): "
        f"{u['queue_p50_ms']} -> {f['queue_p50_ms']} ms",
        f"  p50 ratio {result['p50_ratio']} (aim <= {result['aim_p50_ratio']}): {'met' if result['meets_aim'] else 'NOT met'}",
        f"  flood: {s['accepted_per_s']}/s accepted, {s['refused_per_s']}/s refused with 429; "
        f"queue {result['backlog_before']} -> {result['backlog_after']} tasks",
    ])  # fmt: skip
