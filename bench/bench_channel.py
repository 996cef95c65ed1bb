"""The worker's leases and reports over the WebSocket channel against the same over HTTP, side by side.

Equal work in both: a fresh controller on SQLite (fsync'd) and ONE worker `--cpus 2` serving
`bench.peer_app:cpu_app` (a no-op asking `cpu=1`: two execution slots), the peer bench's phases (bulk submit,
one-by-one submits, sequential round trips for latency, CPU per task from /proc over the bulk phase). The
only difference is the worker's `--no-channel` in the HTTP rows. Repetitions alternate (channel, HTTP,
channel, ...); medians.

    python -m bench --only channel [--quick]      -> bench/results/channel.json
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.bench_peers import cpu_phases, on_fresh_cluster
from bench.bench_throughput import _source_state
from bench.peer_report import row

MODES = {"channel": (), "http": ("--no-channel",)}
COMPARED = ("bulk_tasks_per_s", "single_tasks_per_s", "p50_ms", "p99_ms", "cpu_ms_per_task")


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
    return {
        "turnout_source": _source_state(), "params": {**params, "reps": reps}, **compare(modes),
        "modes": modes, "wall_s": round(time.time() - started, 1),
        "loadavg_at_start": [round(x, 2) for x in load0],
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
    }  # fmt: skip


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
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"
