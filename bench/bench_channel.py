"""The worker's leases and reports over the WebSocket channel against the same over HTTP, side by side.

Equal work in both: a fresh controller on SQLite (fsync'd) and ONE worker `--cpus 2` serving
`bench.peer_app:cpu_app` (a no-op asking `cpu=1`: two execution slots), the peer bench's phases (bulk submit,
one-by-one submits, sequential round trips for latency, CPU per task from /proc over the bulk phase). The
only difference is the worker's `--no-channel` in the HTTP rows. Repetitions alternate (channel, HTTP,
channel, ...); medians.

Then the cost of one call on each road, apart from any task: a stand-in worker sends the same request (an
empty lease poll that does not wait, an empty report, an empty event batch) CALLS times over HTTP (one
keep-alive client made as the worker makes its own, over Turnout's transport) and CALLS times over the channel, one at a time; the controller's CPU per call from
/proc, and the caller's own CPU per call beside it.

    python -m bench --only channel [--quick]      -> bench/results/channel.json
"""

from __future__ import annotations

import asyncio
import functools
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
from websockets.asyncio.client import ClientConnection, connect

from bench.bench_peers import cpu_phases, on_fresh_cluster
from bench.bench_throughput import _source_state
from bench.common import Processes, TurnoutCluster
from bench.peer_measure import own_cpu_s
from bench.peer_report import row
from turnout.tls import async_client

MODES = {"channel": (), "http": ("--no-channel",)}
COMPARED = ("bulk_tasks_per_s", "single_tasks_per_s", "p50_ms", "p99_ms", "cpu_ms_per_task")
REQUESTS = {"lease": {"max_tasks": 1, "running": [], "wait_s": 0}, "complete": {"results": []},
            "events": {"events": []}}  # fmt: skip
WARM_CALLS = 100


def run(quick: bool = False, timeout_s: float = 900) -> dict[str, Any]:
    reps = 1 if quick else 3
    params = {"n": 1000 if quick else 5000, "n_latency": 100 if quick else 300, "timeout_s": timeout_s}
    load0 = os.getloadavg()
    started = time.time()
    modes: dict[str, dict[str, Any]] = {mode: {"reps": []} for mode in MODES}
    for i in range(reps):
        for mode, worker_args in MODES.items():
            print(f"   rep {i + 1}/{reps}: {mode} ...", flush=True)
            with tempfile.TemporaryDirectory(prefix=f"channel-{mode}-") as tmp:
                rep = on_fresh_cluster(Path(tmp) / "cluster", "cpu_app", "none",
                                       lambda c: cpu_phases(c, params, False), worker_args)  # fmt: skip
            modes[mode]["reps"].append(rep)
    with tempfile.TemporaryDirectory(prefix="channel-calls-") as tmp:
        calls = per_call(Path(tmp), 500 if quick else 3000)
    return {
        "turnout_source": _source_state(), "params": {**params, "reps": reps}, **compare(modes),
        "calls": calls, "modes": modes, "wall_s": round(time.time() - started, 1),
        "loadavg_at_start": [round(x, 2) for x in load0],
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
    }  # fmt: skip


def per_call(tmp: Path, n: int) -> dict[str, Any]:
    """CPU ms per call, the controller's and the caller's, for each request in REQUESTS on each road."""
    procs = Processes()
    cluster = TurnoutCluster(tmp, procs)
    try:
        cluster.start_controller()
        return {"calls": n, **asyncio.run(_calls(cluster, n))}
    finally:
        procs.stop_all()


async def _calls(cluster: TurnoutCluster, n: int) -> dict[str, Any]:
    body = {"name": "stand-in", "host": "bench", "cpu": 4, "memory": 2**30, "heartbeat_s": 60,
            "variants": [{"capability": "nothing", "device": "cpu", "resources": {"cpu": 1}}]}  # fmt: skip
    answer = httpx.post(f"{cluster.url}/v1/workers/register", json=body, headers=cluster.headers).json()
    worker_id, proof = answer["id"], {**cluster.headers, "X-Worker-Secret": answer["secret"]}
    assert cluster.controller is not None
    controller = psutil.Process(cluster.controller.pid)
    out: dict[str, Any] = {}
    for call, request in REQUESTS.items():
        data = orjson.dumps(request)
        headers = {**proof, "Content-Type": "application/json"}
        # the worker's own client (`tls.async_client`, over Turnout's transport), as its HTTP calls go
        async with async_client(ca_cert=None, base_url=cluster.url, headers=headers) as http:
            post = functools.partial(_over_http, http, f"/v1/workers/{worker_id}/{call}", data)
            out[f"{call}_http"] = await _cost(post, controller, n)
        url = f"ws://127.0.0.1:{cluster.port}/v1/workers/{worker_id}/channel"
        async with connect(url, additional_headers=proof, compression=None) as ws:
            send = functools.partial(_over_channel, ws, b"1 %s\n%s" % (call.encode(), data))
            out[f"{call}_channel"] = await _cost(send, controller, n)
    return out


async def _over_http(http: httpx.AsyncClient, path: str, data: bytes) -> None:
    (await http.post(path, content=data)).raise_for_status()


async def _over_channel(ws: ClientConnection, frame: bytes) -> None:
    await ws.send(frame)
    answered = await ws.recv()
    assert isinstance(answered, bytes) and answered.startswith(b"1 200\n"), answered


async def _cost(one: Callable[[], Awaitable[None]], controller: psutil.Process, n: int) -> dict[str, float]:
    for _ in range(WARM_CALLS):
        await one()
    server0, client0, t0 = sum(controller.cpu_times()[:2]), own_cpu_s(), time.perf_counter()
    for _ in range(n):
        await one()
    return {"controller_cpu_ms": round(1000 * (sum(controller.cpu_times()[:2]) - server0) / n, 3),
            "caller_cpu_ms": round(1000 * (own_cpu_s() - client0) / n, 3),
            "wall_ms": round(1000 * (time.perf_counter() - t0) / n, 3)}  # fmt: skip


def compare(modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each mode's medians (`rows`), and the channel's over HTTP's for each figure (`channel_over_http`)."""
    rows = {mode: row(entry) for mode, entry in modes.items()}
    ratios = {
        figure: round(rows["channel"][figure] / rows["http"][figure], 2)
        for figure in COMPARED
        if rows["channel"].get(figure) and rows["http"].get(figure)
    }
    return {"rows": rows, "channel_over_http": ratios}


def summary(result: dict[str, Any]) -> str:
    rows, ratios = result["rows"], result["channel_over_http"]
    lines = [f"  {result['params']['n']:,} no-op tasks per phase, 2 slots, {result['params']['reps']} alternated "
             f"repetition(s), medians; load {result['loadavg_at_start'][0]} -> {result['loadavg_at_end'][0]}",
             "  figure                      channel       HTTP   channel/HTTP"]  # fmt: skip
    for figure in COMPARED:
        a, b = rows["channel"].get(figure), rows["http"].get(figure)
        lines.append(f"  {figure:<24} {_cell(a):>10} {_cell(b):>10}   {ratios.get(figure, '-')}")
    for mode in MODES:
        roles = rows[mode].get("cpu_ms_per_task_by_role") or {}
        lines.append(f"  CPU ms per task, {mode}: " + ", ".join(f"{r} {ms:.2f}" for r, ms in roles.items()))
        lines.append(f"  every task succeeded ({mode}): {rows[mode].get('all_succeeded')}")
    calls = result.get("calls")
    if calls:
        lines.append(
            f"  one call, {calls['calls']:,} times each: controller CPU ms / caller CPU ms / wall ms"
        )
        for call in REQUESTS:
            road = {r: calls[f"{call}_{r}"] for r in ("http", "channel")}
            lines.append(f"  {call:<9} " + "   ".join(
                f"{r} {c['controller_cpu_ms']:.3f} / {c['caller_cpu_ms']:.3f} / {c['wall_ms']:.3f}" for r, c in road.items()))  # fmt: skip
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"
