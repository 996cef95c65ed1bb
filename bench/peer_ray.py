"""The Ray peer of the peer bench, run as its own process so its cluster starts and ends with it.

    python -m bench.peer_ray '{"n": 1000, "n_latency": 100, "n_gpu": 1000, "n_gpu_default": 40,
                               "temp_dir": "/tmp/rayp-x", "timeout_s": 600}'

prints one line `PEER_RESULT {json}` last. `ray.init(num_cpus=2, num_gpus=2)`: no-op tasks asking `num_cpus=1`
get exactly two execution slots (two workers, prestarted and warmed before timing), like Turnout's two warm
handler processes and Celery's prefork -c 2. Ray has no batch submit, so its bulk and one-by-one phases both
call `.remote()` per task; bulk then waits with one `ray.get` of the list, one-by-one with one per task.

The quarter-GPU case asks `num_gpus=0.25, num_cpus=0.25` (eight at once on two GPUs). Ray's default for GPU
tasks is `max_calls=1`, a fresh worker process per task; the timed phase uses `max_calls=0` (workers reused,
as Turnout's warm processes are), the faster yardstick, and a few tasks at the default are timed for reference.

CPU: the system is every process under the driver (GCS, raylet, workers); the driver itself is the client.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Any

from bench.peer_measure import CpuMeter, latency_figures, own_cpu_s, phase_figures

MARK = "PEER_RESULT "
WARMUP = 200


def _noop() -> None:
    return None


def _quarter() -> int:
    import ray

    return len(ray.get_gpu_ids())


def _succeeded(ray: Any, refs: list[Any], ok: Any, timeout_s: float, *, each: bool) -> int:
    """Successful results among `refs` (`ok(value)` says what success is), fetched with one `ray.get` of the
    list or (`each`) one per task; a task error or timeout counts as a failure."""
    if not each:
        try:
            return sum(1 for v in ray.get(refs, timeout=timeout_s) if ok(v))
        except Exception:  # one failed (RayTaskError) or time ran out: count them one by one
            timeout_s = 1.0
    good = 0
    for ref in refs:
        with contextlib.suppress(Exception):
            good += bool(ok(ray.get(ref, timeout=timeout_s)))
    return good


def _timed(ray: Any, fn: Any, n: int, ok: Any, timeout_s: float, *, one_get_per_task: bool) -> dict[str, Any]:
    cli0 = own_cpu_s()
    t0 = time.perf_counter()
    with CpuMeter({"ray": os.getpid()}, include_roots=False) as meter:
        refs = [fn.remote() for _ in range(n)]
        submit_s = time.perf_counter() - t0
        good = _succeeded(ray, refs, ok, timeout_s, each=one_get_per_task)
        elapsed = time.perf_counter() - t0
    cpu, client = meter.seconds()["ray"], own_cpu_s() - cli0 - meter.overhead_s
    return {**phase_figures(n, elapsed, submit_s, good, cpu_s=cpu, client_cpu_s=client),
            "processes_started": meter.started()}  # fmt: skip


def phases(ray: Any, params: dict[str, Any]) -> dict[str, Any]:
    timeout_s = float(params["timeout_s"])
    noop = ray.remote(num_cpus=1)(_noop)
    quarter = ray.remote(num_gpus=0.25, num_cpus=0.25, max_calls=0)(_quarter)
    quarter_default = ray.remote(num_gpus=0.25, num_cpus=0.25)(_quarter)
    is_none, one_gpu = (lambda v: v is None), (lambda v: v == 1)

    ray.get([noop.remote() for _ in range(WARMUP)], timeout=timeout_s)
    out: dict[str, Any] = {"version": ray.__version__, "slots": 2}
    out["bulk"] = _timed(ray, noop, params["n"], is_none, timeout_s, one_get_per_task=False)
    out["single"] = _timed(ray, noop, params["n"], is_none, timeout_s, one_get_per_task=True)
    samples, failed = [], 0
    for i in range(20 + params["n_latency"]):
        t0 = time.perf_counter()
        try:
            ray.get(noop.remote(), timeout=30)
        except Exception:
            failed += i >= 20
        if i >= 20:
            samples.append(time.perf_counter() - t0)
    out["latency"] = latency_figures(samples, failed)
    ray.get([quarter.remote() for _ in range(4 * 8)], timeout=timeout_s)  # eight workers up and warm
    out["quarter_gpu"] = {**_timed(ray, quarter, params["n_gpu"], one_gpu, timeout_s, one_get_per_task=False),
                          "max_calls": 0}  # fmt: skip
    if params.get("n_gpu_default"):
        out["quarter_gpu_default"] = {**_timed(ray, quarter_default, params["n_gpu_default"], one_gpu, timeout_s,
                                               one_get_per_task=False), "max_calls": 1}  # fmt: skip
    return out


def main(argv: list[str]) -> int:
    params = json.loads(argv[0])
    try:
        import ray
    except ImportError as exc:
        print(MARK + json.dumps({"skipped": f"not installed ({exc})"}), flush=True)
        return 0
    ray.init(
        num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=params["temp_dir"]
    )
    try:
        out = phases(ray, params)
    finally:
        ray.shutdown()
    print(MARK + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
