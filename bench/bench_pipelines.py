"""Warm pools, batching and pipeline overhead on the demo's real model (all-MiniLM-L6-v2 on this CPU).

1. warm against cold: submit-to-result latency of one classify_text task on a warm process (model loaded)
   against one that must start a process and load the model (idle_timeout_s=0; each task waits until the pool
   is empty). Aim: warm at least 20x faster.
2. batched against unbatched: texts per second through one process, max_batch_size 32 against 1. Aim: >= 3x.
3. pipeline overhead: a 3-stage pipeline of no-op stages, end to end (start to finished run, seen by a client)
   less the sum of its stages' run seconds, next to one no-op task's submit-to-result less its run seconds, in
   the same cluster; each in one request that answers once it ended (`?wait=`), as a client that wants the
   result at once sends it. Aim: the run adds no more than one single task's overhead in all, not one per stage.

    python -m bench --only pipelines [--quick]           all three parts
    python -m bench.bench_pipelines --overhead [--quick]  only part 3 (no model is loaded)
    python -m bench.bench_pipelines --gpu [--quick]       parts 1 and 2 on a real NVIDIA GPU (`gpu: require`)
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import Processes, TurnoutCluster, exit_on_sigterm

CONFIG = """
pipelines:
  noop3:
    stages:
      - {capability: noop, gpu: never}
      - {capability: noop, gpu: never}
      - {capability: noop, gpu: never}
"""
TEXTS = [
    "The food was amazing and the staff were friendly.", "The service was slow and the soup was cold.",
    "Absolutely loved the film, the acting was superb.", "Worst purchase I have ever made, it broke at once.",
]  # fmt: skip


def _result(http: httpx.Client, task_id: str, timeout_s: float = 600) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        task = http.get(f"/v1/tasks/{task_id}/result", params={"wait": 30}).json()
        if task["state"] in ("succeeded", "failed", "cancelled"):
            return task
    raise TimeoutError(f"task {task_id} did not end in {timeout_s:g} s")


def _one(http: httpx.Client, capability: str, data: Any, gpu: str = "never") -> tuple[float, dict[str, Any]]:
    """One task, submitted and waited for in one request (`POST /v1/tasks?wait=`), as a run is started and
    waited for (`POST /v1/pipelines/{name}/runs?wait=`): equal work for the overhead comparison."""
    started = time.perf_counter()
    body = {"capability": capability, "input": data, "gpu": gpu}
    task = http.post("/v1/tasks", params={"wait": 60}, json=body).json()
    done = task if task["state"] in ("succeeded", "failed", "cancelled") else _result(http, task["id"])
    return time.perf_counter() - started, done


def _pool_size(http: httpx.Client, key: str) -> int:
    workers = http.get("/v1/workers").json()["workers"]
    return sum(int((w.get("pools") or {}).get(key, {}).get("size", 0)) for w in workers)


def run(quick: bool = False, overhead_only: bool = False, gpu: bool = False) -> dict[str, Any]:
    """`gpu`: the model parts on this host's real GPU (the worker finds it with `--gpus auto`), no overhead part."""
    procs = Processes()
    with tempfile.TemporaryDirectory(prefix="bench-pipelines-") as tmp:
        config = Path(tmp) / "turnout.yaml"
        config.write_text(CONFIG)
        c = TurnoutCluster(Path(tmp), procs, heartbeat_s=0.5, controller_args=["--config", str(config)])
        try:
            c.start_controller()
            c.start_worker(
                "bench.model_app:app", "w", extra=["--cpus", "2", *(["--gpus", "auto"] if gpu else [])]
            )
            http = httpx.Client(base_url=c.url, headers=c.headers, timeout=120)
            out: dict[str, Any] = {}
            placement = "require" if gpu else "never"
            if not overhead_only:  # the model parts first, as they always ran
                out["warm_cold"] = _warm_cold(http, 3 if quick else 5, placement)
                out["batching"] = _batching(http, 64 if quick else 256, placement)
            if not gpu:
                out["pipeline_overhead"] = _overhead(http, 10 if quick else 30)
            return out
        finally:
            procs.stop_all()


def _warm_cold(http: httpx.Client, n: int, gpu: str) -> dict[str, Any]:
    _, first = _one(http, "classify_warm", {"text": TEXTS[0]}, gpu)  # loads the model once
    warm = [_one(http, "classify_warm", {"text": TEXTS[i % 4]}, gpu)[0] for i in range(n * 4)]
    cold = []
    pool = "classify_cold:gpu" if gpu == "require" else "classify_cold:cpu"
    for i in range(n):
        deadline = time.monotonic() + 30
        while _pool_size(http, pool) and time.monotonic() < deadline:
            time.sleep(0.1)  # idle_timeout_s=0: wait until its last process is gone, so this task starts one
        seconds, task = _one(http, "classify_cold", {"text": TEXTS[i % 4]}, gpu)
        assert task["cold_start_s"] and task["cold_start_s"] > 0.5, task
        cold.append(seconds)
    w, c = statistics.median(warm), statistics.median(cold)
    return {"warm_p50_s": round(w, 4), "cold_p50_s": round(c, 3), "cold_over_warm": round(c / w, 1),
            "warm_n": len(warm), "cold_n": len(cold), "device": first.get("device"),
            "model_device": (first.get("output") or {}).get("model_device")}  # fmt: skip


def _throughput(http: httpx.Client, capability: str, n: int, gpu: str) -> float:
    _one(http, capability, {"text": TEXTS[0]}, gpu)  # warm: the model is loaded before timing
    body = {
        "tasks": [{"capability": capability, "input": {"text": TEXTS[i % 4]}, "gpu": gpu} for i in range(n)]
    }
    started = time.perf_counter()
    tasks = http.post("/v1/tasks/batch", json=body).json()["tasks"]
    for t in tasks:
        assert _result(http, t["id"])["state"] == "succeeded"
    return n / (time.perf_counter() - started)


def _batching(http: httpx.Client, n: int, gpu: str) -> dict[str, Any]:
    one = _throughput(http, "classify_warm", n, gpu)
    many = _throughput(http, "classify_batched", n, gpu)
    return {"texts": n, "unbatched_per_s": round(one, 1), "batched_32_per_s": round(many, 1),
            "batched_over_unbatched": round(many / one, 2)}  # fmt: skip


def _overhead(http: httpx.Client, n: int) -> dict[str, Any]:
    singles, runs = [], []
    for _ in range(3):
        _one(http, "noop", None)
    for _ in range(n):
        seconds, task = _one(http, "noop", None)
        singles.append(seconds - (task["run_s"] or 0))
        started = time.perf_counter()
        run = http.post("/v1/pipelines/noop3/runs", params={"wait": 60}, json={"input": {}}).json()
        while run["state"] == "running":
            run = http.get(f"/v1/pipeline-runs/{run['id']}", params={"wait": 30}).json()
        elapsed = time.perf_counter() - started
        assert run["state"] == "succeeded", run
        runs.append(elapsed - sum(s["run_s"] or 0 for s in run["stages"]))
    single, pipe = statistics.median(singles), statistics.median(runs)
    return {"runs": n, "single_task_overhead_p50_ms": round(single * 1000, 1),
            "pipeline_3_stage_overhead_p50_ms": round(pipe * 1000, 1),
            "pipeline_over_single": round(pipe / single, 2)}  # fmt: skip


def summary(result: dict[str, Any]) -> str:
    lines = []
    if "pipeline_overhead" in result:
        o = result["pipeline_overhead"]
        lines.append(
            f"  no-op overhead p50: single task {o['single_task_overhead_p50_ms']} ms, 3-stage pipeline "
            f"{o['pipeline_3_stage_overhead_p50_ms']} ms: {o['pipeline_over_single']}x a single task's (aim <= 1x)"
        )
    if "warm_cold" in result:
        wc, b = result["warm_cold"], result["batching"]
        lines[:0] = [
            f"  classify_text warm p50 {wc['warm_p50_s'] * 1000:.1f} ms, cold p50 {wc['cold_p50_s']:.2f} s: "
            f"warm {wc['cold_over_warm']}x faster (aim >= 20x)",
            f"  classify_text {b['texts']} texts: unbatched {b['unbatched_per_s']}/s, batched (32) "
            f"{b['batched_32_per_s']}/s: {b['batched_over_unbatched']}x (aim >= 3x)",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    import json

    exit_on_sigterm()
    result = run(quick="--quick" in sys.argv, overhead_only="--overhead" in sys.argv, gpu="--gpu" in sys.argv)
    print(summary(result))
    print(json.dumps(result, indent=2))
