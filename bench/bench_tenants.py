"""Fairness between tenants: a calm tenant's submit-to-result latency, alone and while another tenant floods.

One controller (limits `"*": {submit_per_s: 200, reserved_share: 0.25}`: the DESIGN.md default rate, and a
quarter of each shared worker kept for a tenant with work; `flood-50` at 50 a second) and two shared-pool
workers of the demo app, each offering 0.4 cores, so four 0.1-core tasks at a time each: eight slots in all.
The same cluster serves every phase.

- alone: the calm tenant runs `noop` tasks one after another (POST, then GET .../result?wait=10).
- flood at 50/s, then at 200/s: the flooding tenant submits `sleep` tasks of 0.1 s from several concurrent
  clients as fast as they can, never waiting out a 429 (a hostile client; its 429s are held, as any such
  tenant's are: `refusal_hold_s`, README). The pool runs at most 80 of
  them a second; at 200 a second the flooding tenant's queue grows. After a settling time (at 200/s, long
  enough for its queue to grow deep), the calm tenant measures again, the very same tasks.
- after each flood, the flooding tenant's queued tasks are cancelled and its running ones end, so the
  next phase starts as the first did.

Phases interleave, `rounds` times: alone, flood at 50/s, alone, flood at 200/s; then alone once more. Each
ratio is the flood phases' pooled p50 over the alone phases' pooled p50 (per round too: against the alone
phase just before it). Each phase also records the CPU the controller used (in % of one core) and the
host's load, since on a small shared host the flood's own clients and the controller's work compete with
the calm tenant's.

The claim (issue 10): under the flood, the calm tenant's p50 stays within 2x of its unloaded p50.

    python -m bench --only tenants [--quick]
    from bench.bench_tenants import run    run(quick=False, reserved_share=0.25) -> dict (None: no reservation)
"""

from __future__ import annotations

import asyncio
import multiprocessing
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.common import Processes, TurnoutCluster, percentile

NAME = "tenants"
AIM_P50_RATIO = 2.0
RESERVED_SHARE = 0.25  # one of each worker's four slots
FLOOD_CLIENTS = 4
DRAIN_CLIENTS = 8


def config(reserved_share: float | None) -> str:
    share = f", reserved_share: {reserved_share}" if reserved_share is not None else ""
    return (
        f'limits:\n  "*": {{submit_per_s: 200{share}}}\n  flood-50: {{submit_per_s: 50}}\n'
        "  over: {submit_per_s: 0.01, refusal_hold_s: 0}\n"
    )


PARTS = ("post", "queue", "finish", "answer")  # where a sample's time went, in order (see _latency)


def _latency(url: str, token: str, n: int, warmup: int) -> dict[str, Any]:
    """n sequential `noop` tasks after `warmup`: each sample from the POST to its result in hand, and its
    parts: `post` (the POST alone: the door and the commit), `queue` (its queue_s: created to started),
    `finish` (started to finished: the run, the report, its commit), `answer` (finished to the result in
    the client's hand: the long poll's wake-up). Wall clocks of one host; the parts overlap a little."""
    samples: list[float] = []
    parts: dict[str, list[float]] = {name: [] for name in PARTS}
    failed = 0
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
        for i in range(warmup + n):
            t0 = time.perf_counter()
            task_id = client.post("/v1/tasks", json={"capability": "noop"}).json()["id"]
            t1 = time.perf_counter()
            task = client.get(f"/v1/tasks/{task_id}/result", params={"wait": 10}).json()
            t2, now = time.perf_counter(), time.time()
            if i >= warmup:
                samples.append(t2 - t0)
                finished = _epoch(task["finished_at"])
                started = _epoch(task["started_at"]) if task["started_at"] else finished
                parts["post"].append(t1 - t0)
                parts["queue"].append(task.get("queue_s") or 0.0)
                parts["finish"].append(finished - started)
                parts["answer"].append(now - finished)
                failed += task["state"] != "succeeded"
    return {"samples": samples, "parts": parts, "failed": failed}


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _stats(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """Percentiles of the pooled samples of these phases (ms), the p50 of each part, the phases' CPU and load."""
    samples = [x for p in phases for x in p["samples"]]
    return {
        "n": len(samples), "failed": sum(p["failed"] for p in phases),
        "p50_ms": _ms(percentile(samples, 50)), "p90_ms": _ms(percentile(samples, 90)),
        "p99_ms": _ms(percentile(samples, 99)), "max_ms": _ms(max(samples)),
        "parts_p50_ms": {name: _ms(percentile([x for p in phases for x in p["parts"][name]], 50)) for name in PARTS},
        "p50_ms_each": [_ms(percentile(p["samples"], 50)) for p in phases],
        "controller_cpu_pct": [p["controller_cpu_pct"] for p in phases], "host_load": [p["host_load"] for p in phases],
    }  # fmt: skip


def _ms(seconds: float) -> float:
    return round(1000 * seconds, 2)


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


def _drain(url: str, token: str, timeout_s: float = 120) -> int:
    """Cancel a tenant's queued tasks and wait until none of its tasks is leased or running; returns how many
    were cancelled. The phase after a flood then starts as the first phase did."""

    async def cancel_all() -> int:
        cancelled = 0
        async with httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30
        ) as http:
            sem = asyncio.Semaphore(DRAIN_CLIENTS)

            async def cancel(task_id: str) -> None:
                async with sem:
                    await http.post(f"/v1/tasks/{task_id}/cancel")

            while True:
                resp = await http.get("/v1/tasks", params={"state": "queued", "limit": 1000})
                page = resp.json()["tasks"]
                if not page:
                    return cancelled
                await asyncio.gather(*(cancel(t["id"]) for t in page))
                cancelled += len(page)

    deadline = time.monotonic() + timeout_s
    cancelled = asyncio.run(cancel_all())
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as http:
        while time.monotonic() < deadline:
            busy = [t for state in ("leased", "running", "queued")
                    for t in http.get("/v1/tasks", params={"state": state, "limit": 1}).json()["tasks"]]  # fmt: skip
            if not busy:
                return cancelled
            time.sleep(0.1)
    raise RuntimeError(f"the flooding tenant's tasks did not end within {timeout_s:g} s")


def _refusal_cost(url: str, token: str, controller: psutil.Process, n: int) -> dict[str, Any]:
    """The controller's CPU per refused submission: a tenant over its rate (one submission in 100 s) sends n
    more from FLOOD_CLIENTS concurrent connections; CPU seconds the controller used over the 429s. Its refusals
    are not held (`refusal_hold_s: 0`): this measures what each one costs, answered at once."""

    async def send_all() -> list[int]:
        limits = httpx.Limits(max_connections=FLOOD_CLIENTS, max_keepalive_connections=FLOOD_CLIENTS)
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30,
                                     limits=limits) as http:  # fmt: skip
            codes: list[int] = []

            async def client(count: int) -> None:
                for _ in range(count):
                    resp = await http.post(
                        "/v1/tasks", json={"capability": "sleep", "input": {"seconds": 0.1}}
                    )
                    codes.append(resp.status_code)

            await asyncio.gather(*(client(n // FLOOD_CLIENTS) for _ in range(FLOOD_CLIENTS)))
            return codes

    first = httpx.post(f"{url}/v1/tasks", headers={"Authorization": f"Bearer {token}"}, timeout=30,
                       json={"capability": "noop"})  # takes its one token (if left), and has its token cached  # fmt: skip
    if first.status_code not in (201, 429):
        raise RuntimeError(f"a submission of tenant `over` answered {first.status_code}: {first.text}")
    cpu0, t0 = sum(controller.cpu_times()[:2]), time.perf_counter()
    codes = asyncio.run(send_all())
    cpu, elapsed = sum(controller.cpu_times()[:2]) - cpu0, time.perf_counter() - t0
    refused = codes.count(429)
    if refused < len(codes) * 0.99:
        raise RuntimeError(f"expected only 429s, got {sorted(set(codes))}")
    return {"refused": refused, "controller_cpu_us_each": round(1e6 * cpu / refused, 1),
            "per_s": round(refused / elapsed, 1)}  # fmt: skip


def _alone(url: str, token: str, n: int, warmup: int, controller: psutil.Process) -> dict[str, Any]:
    with _Cpu(controller) as cpu:
        out = _latency(url, token, n, warmup)
    return {**out, "controller_cpu_pct": cpu.pct, "host_load": cpu.load}


def _flooded(
    cluster: TurnoutCluster, tokens: dict[str, str], tenant: str, settle_s: float, n: int, warmup: int,
    controller: psutil.Process,
) -> dict[str, Any]:  # fmt: skip
    with _Flood(cluster.url, tokens[tenant]) as flood:
        time.sleep(settle_s)  # let the flood settle (and, at 200/s, its queue grow deep)
        backlog_before = _queued(cluster.url, cluster.token)
        calm = _alone(cluster.url, tokens["calm"], n, warmup, controller)
        backlog_after = _queued(cluster.url, cluster.token)
    if flood.accepted == 0 or flood.proc.exitcode not in (0, None):
        raise RuntimeError(
            f"the flood did not run (exit code {flood.proc.exitcode}, {flood.accepted} accepted)"
        )
    cancelled = _drain(cluster.url, tokens[tenant])
    return {**calm, "backlog": [backlog_before, backlog_after], "cancelled_after": cancelled,
            "accepted_per_s": round(flood.accepted / flood.elapsed_s, 1),
            "refused_per_s": round(flood.refused / flood.elapsed_s, 1), "other": flood.other}  # fmt: skip


def run(
    quick: bool = False, timeout_s: float = 300, reserved_share: float | None = RESERVED_SHARE
) -> dict[str, Any]:
    n, warmup, backlog_s, rounds = (40, 10, 3.0, 1) if quick else (150, 20, 8.0, 2)
    procs = Processes()
    with tempfile.TemporaryDirectory(prefix="turnout-bench-tenants-") as tmp:
        cluster = TurnoutCluster(
            Path(tmp), procs, controller_args=["--config", str(Path(tmp) / "turnout.yaml")]
        )
        (Path(tmp) / "turnout.yaml").write_text(config(reserved_share))
        try:
            cluster.start_controller()
            for name in ("pool-1", "pool-2"):
                cluster.start_worker("turnout.demo:app", name, extra=["--cpus", "0.4"])
            tokens = {}
            for tenant in ("calm", "flood", "flood-50", "over"):
                made = httpx.post(f"{cluster.url}/v1/tokens", headers=cluster.headers, timeout=30,
                                  json={"role": "submit", "tenant": tenant}).json()  # fmt: skip
                tokens[tenant] = made["token"]
            assert cluster.controller is not None
            controller = psutil.Process(cluster.controller.pid)
            alone: list[dict[str, Any]] = []
            flooded: dict[str, list[dict[str, Any]]] = {"flood_50": [], "flood_200": []}
            before: dict[str, list[dict[str, Any]]] = {"flood_50": [], "flood_200": []}  # alone, just before
            for _ in range(rounds):
                for phase, tenant, settle_s in (
                    ("flood_50", "flood-50", 2.0),
                    ("flood_200", "flood", backlog_s),
                ):
                    alone.append(_alone(cluster.url, tokens["calm"], n, warmup, controller))
                    before[phase].append(alone[-1])
                    flooded[phase].append(_flooded(cluster, tokens, tenant, settle_s, n, warmup, controller))
            alone.append(_alone(cluster.url, tokens["calm"], n, warmup, controller))
            unloaded = _stats(alone)
            out: dict[str, Any] = {"config": config(reserved_share).strip(), "workers": 2, "slots": 8,
                                   "flood_clients": FLOOD_CLIENTS, "rounds": rounds, "unloaded": unloaded}  # fmt: skip
            for phase, runs in flooded.items():
                calm = _stats(runs)
                out[phase] = {
                    "calm": calm,
                    "backlog": [r["backlog"] for r in runs],
                    "cancelled_after": [r["cancelled_after"] for r in runs],
                    "submissions": {"accepted_per_s": [r["accepted_per_s"] for r in runs],
                                    "refused_per_s": [r["refused_per_s"] for r in runs],
                                    "other": sum(r["other"] for r in runs)},
                    "p50_ratio": round(calm["p50_ms"] / unloaded["p50_ms"], 2),
                    "p50_ratio_each": [round(percentile(r["samples"], 50) / percentile(b["samples"], 50), 2)
                                       for r, b in zip(runs, before[phase], strict=True)],
                }  # fmt: skip
            out["refusals"] = _refusal_cost(cluster.url, tokens["over"], controller, 500 if quick else 2000)
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
    lines = [f"  calm tenant alone ({result['rounds']} rounds + 1): p50 {u['p50_ms']} ms (each {u['p50_ms_each']}), "
             f"p99 {u['p99_ms']} ms (parts p50 {u['parts_p50_ms']}; "
             f"controller {u['controller_cpu_pct']}% CPU, load {u['host_load']})"]  # fmt: skip
    for phase in ("flood_50", "flood_200"):
        p, c, s = result[phase], result[phase]["calm"], result[phase]["submissions"]
        met = "met" if result["meets_aim"][phase] else "NOT met"
        lines += [
            f"  {phase}: calm p50 {c['p50_ms']} ms (each {c['p50_ms_each']}), p99 {c['p99_ms']} ms (parts p50 "
            f"{c['parts_p50_ms']}; controller {c['controller_cpu_pct']}% CPU, "
            f"load {c['host_load']})",
            f"    p50 ratio {p['p50_ratio']} (each round {p['p50_ratio_each']}; aim <= {result['aim_p50_ratio']}): "
            f"{met}; flood {s['accepted_per_s']}/s accepted, {s['refused_per_s']}/s refused (429); "
            f"its queue {p['backlog']}, cancelled after {p['cancelled_after']}",
        ]  # fmt: skip
    r = result["refusals"]
    lines.append(
        f"  refused submissions: {r['refused']} at {r['per_s']}/s, controller CPU {r['controller_cpu_us_each']} us each"
    )
    return "\n".join(lines)
