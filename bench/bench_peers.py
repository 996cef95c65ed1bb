"""Turnout next to Celery and Ray, each given exactly two execution slots, in one run on this machine.

One system at a time, never two at once, repetitions interleaved (T, C, R, T, C, R, ...); medians:

- Turnout: a controller on a fresh SQLite file (fsync'd, the default) and ONE worker `--cpus 2` serving
  `bench.peer_app:cpu_app` (no-op, `cpu=1`, two warm handler processes), its defaults otherwise (`--prefetch
  auto`: it holds waiting up to 64 tasks the controller saw end quickly, 0.1 s of their work per core at most). Bulk: the SDK's `submit_batch` in
  chunks of 1,000; one-by-one: `AsyncClient.submit()` once per task from many concurrent callers.
- Celery: one worker, prefork -c 2, Redis broker and backend (db 15, flushed first), `bench.celery_app`.
  Bulk: `group(...).apply_async()`; one-by-one: `.delay()` per task.
- Ray: `bench.peer_ray` in its own process, `ray.init(num_cpus=2, num_gpus=2)`.

Each phase is timed from the first submit until every result is in, and every task is counted as succeeded
or not. Latency: sequential round trips, submit to result, each system's own way to submit and wait: Turnout's
`Client.run` (one request: the submission answers once the task ended), Celery's `.delay().get()`, Ray's
`ray.get(f.remote())`; beside Turnout's, alternated with it, the same `Client.run` over httpx's own transport
instead of Turnout's (`transport.py`). CPU per task: user + system CPU from /proc of the
system's processes (controller, worker agent, handlers; Celery's workers and the Redis server; Ray's GCS,
raylet and workers), read by `peer_measure.CpuMeter` through the bulk phase (processes that start or end
meanwhile included), divided by its tasks; the client's own share is beside it. The CPU aim is judged twice:
with the client's share (Ray's driver leases workers and pushes each task to one itself, work Turnout's
controller does, so the equal work is every process's) and without it.
Quarter-GPU case: a Turnout worker `--gpus fake:2x80Gi --cpus 2` (`bench.peer_app:gpu_app`) running tasks
`gpu: require` that ask `gpu: 0.25`, against Ray tasks `num_gpus=0.25` (eight at once in both).

    python -m bench --only peers [--quick] [--profile]      -> bench/results/peers.json and peers.md

`--quick`: 1,000 tasks, one repetition. `--profile`: py-spy records the controller and worker during
Turnout's first bulk phase. A peer that is not installed (or no Redis) gets a row that says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.bench_throughput import _Profiler, _source_state
from bench.common import REPO, RESULTS, Processes, TurnoutCluster
from bench.peer_measure import CpuMeter, latency_figures, own_cpu_s, phase_figures
from bench.peer_ray import MARK
from bench.peer_report import LABELS, markdown, summarize
from turnout.client import AsyncClient

NAME = "peers"
REDIS_URL = "redis://127.0.0.1:6379/15"
CHUNK = 1000  # the batch route's limit
CALLERS = 64  # concurrent one-by-one submitters
WARMUP = 200
NOT_INSTALLED = "not installed (pip install -e '.[bench]')"
NONTERMINAL = ("queued", "leased", "running")
TERMINAL = ("succeeded", "failed", "cancelled")
Good = Callable[[dict[str, Any]], bool]  # does a succeeded task show what the phase asked for?


# ---- Turnout -----------------------------------------------------------------------------------


async def _nonterminal(client: AsyncClient) -> int:
    text = (await client.http.get("/metrics")).text
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith(("turnout_queue_depth{", "turnout_tasks_active{")))  # fmt: skip


async def _all_done(client: AsyncClient, last_id: str, timeout_s: float) -> None:
    """Long-poll the last task submitted until it ends (tasks are leased oldest first, so nearly all have then
    ended too; a long poll costs the controller next to nothing), then poll `/metrics` for the stragglers."""
    deadline = time.monotonic() + timeout_s
    while (await client.get_result(last_id, wait=30))["state"] not in TERMINAL:
        if time.monotonic() > deadline:
            raise TimeoutError(f"task {last_id} still in flight after {timeout_s} s")
    while await _nonterminal(client):
        if time.monotonic() > deadline:
            raise TimeoutError(f"tasks still in flight after {timeout_s} s")
        await asyncio.sleep(0.02)


async def _count(client: AsyncClient, ids: set[str], good: Good) -> tuple[dict[str, int], int]:
    """How many of `ids` are in each state (paging `GET /v1/tasks` per state), and how many succeeded as
    `good` says they should have (on the right device, with the right output)."""
    states: Counter[str] = Counter()
    n_good = 0
    for state in (*TERMINAL, *NONTERMINAL):
        cursor: str | None = None
        while True:
            page = await client.tasks(state=state, limit=1000, cursor=cursor)
            for task in page["tasks"]:
                if task["id"] in ids:
                    states[state] += 1
                    n_good += state == "succeeded" and good(task)
            cursor = page.get("next_cursor")
            if not cursor:
                break
    return dict(states), n_good


def _on_cpu(task: dict[str, Any]) -> bool:
    return task.get("device") == "cpu"


def _held_a_quarter(task: dict[str, Any]) -> bool:
    """Ran on the GPU variant, and its handler saw exactly one GPU (its share's device)."""
    return task.get("device") == "gpu" and task.get("output") == {"gpus": 1}


async def _bulk(client: AsyncClient, cluster: TurnoutCluster, n: int, spec: dict[str, Any], good: Good,
                timeout_s: float, profile: bool = False) -> dict[str, Any]:  # fmt: skip
    roles = cluster.pids()
    profiler = _Profiler(roles, RESULTS, "peers-turnout-bulk") if profile else None
    cli0 = own_cpu_s()
    t0 = time.perf_counter()
    ids: list[str] = []
    try:
        with CpuMeter(roles) as meter:
            for start in range(0, n, CHUNK):
                ids += [h.id for h in await client.submit_batch([spec] * min(CHUNK, n - start))]
            submit_s = time.perf_counter() - t0
            await _all_done(client, ids[-1], timeout_s)
            elapsed = time.perf_counter() - t0
        cpu, client_cpu = meter.seconds(), own_cpu_s() - cli0 - meter.overhead_s
    finally:
        profiles = profiler.stop() if profiler is not None else None
    states, n_good = await _count(client, set(ids), good)
    out = phase_figures(n, elapsed, submit_s, n_good, cpu_s=sum(cpu.values()), client_cpu_s=client_cpu)
    out["cpu_ms_per_task_by_role"] = {role: round(1000 * s / n, 3) for role, s in cpu.items()}
    out["processes_started"] = meter.started()
    out["states"] = states
    if profiles is not None:
        out["profile"] = profiles
    return out


async def _one_by_one(client: AsyncClient, n: int, timeout_s: float) -> dict[str, Any]:
    ids: list[str] = []
    todo = iter(range(n))

    async def caller() -> None:
        for _ in todo:  # the callers share one iterator: n submits in all
            ids.append((await client.submit("noop")).id)

    t0 = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(caller() for _ in range(CALLERS))), timeout_s)
    submit_s = time.perf_counter() - t0
    await _all_done(client, ids[-1], timeout_s)
    elapsed = time.perf_counter() - t0
    states, n_good = await _count(client, set(ids), _on_cpu)
    return {**phase_figures(n, elapsed, submit_s, n_good), "callers": CALLERS, "states": states}


async def _latency(
    client: AsyncClient, n: int, httpx_own: AsyncClient
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Sequential round trips as `Client.run` makes them (one request); alternated with those, as `submit()`
    then `result()` (two), and as `Client.run` over httpx's own transport (`httpx_own`) instead of Turnout's
    (`transport.py`): equal work, one cluster."""

    async def two_requests() -> dict[str, Any]:
        return await (await client.submit("noop")).result(timeout=30)

    ways = (
        lambda: client.run("noop", timeout=30),
        two_requests,
        lambda: httpx_own.run("noop", timeout=30),
    )
    samples: tuple[list[float], ...] = tuple([] for _ in ways)
    failed = [0 for _ in ways]
    for i in range(20 + n):
        for k, way in enumerate(ways):
            t0 = time.perf_counter()
            task = await way()
            if i >= 20:
                samples[k].append(time.perf_counter() - t0)
                failed[k] += task["state"] != "succeeded"
    one, two, own = (latency_figures(s, f) for s, f in zip(samples, failed, strict=True))
    return one, two, own


def _handlers(cluster: TurnoutCluster) -> int:
    """Warm handler processes the worker agents started (each may hold a child of its own: not counted)."""
    return sum(1 for w in cluster.workers.values() for p in psutil.Process(w.pid).children()
               if "turnout.worker.runner" in p.cmdline())  # fmt: skip


async def cpu_phases(cluster: TurnoutCluster, params: dict[str, Any], profile: bool) -> dict[str, Any]:
    n, timeout_s = params["n"], params["timeout_s"]
    out: dict[str, Any] = {}
    async with AsyncClient(cluster.url, cluster.token) as client:
        await _bulk(client, cluster, WARMUP, {"capability": "noop"}, _on_cpu, timeout_s)
        out["handler_processes"] = _handlers(cluster)
        out["bulk"] = await _bulk(client, cluster, n, {"capability": "noop"}, _on_cpu, timeout_s, profile)
        out["single"] = await _one_by_one(client, n, timeout_s)
        async with AsyncClient(cluster.url, cluster.token, transport=httpx.AsyncHTTPTransport()) as httpx_own:
            out["latency"], out["latency_two_requests"], out["latency_httpx_transport"] = await _latency(
                client, params["n_latency"], httpx_own
            )
    return out


async def _quarter_phase(cluster: TurnoutCluster, params: dict[str, Any]) -> dict[str, Any]:
    quarter = {"capability": "noop_quarter", "gpu": "require", "resources": {"gpu": 0.25}}
    async with AsyncClient(cluster.url, cluster.token) as client:
        await _bulk(client, cluster, WARMUP, quarter, _held_a_quarter, params["timeout_s"])
        out = await _bulk(client, cluster, params["n_gpu"], quarter, _held_a_quarter, params["timeout_s"])
    return {**out, "handler_processes": _handlers(cluster)}


def on_fresh_cluster(
    tmp: Path,
    app: str,
    gpus: str,
    phases: Callable[[TurnoutCluster], Coroutine[Any, Any, dict[str, Any]]],
    worker_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Start a controller on a fresh SQLite file and one worker `--cpus 2 --gpus GPUS` (and `worker_args`)
    serving `app`, run `phases(cluster)`, stop both (also on failure, whose logs then come back in the result)."""
    procs = Processes()
    tmp.mkdir()
    cluster = TurnoutCluster(tmp, procs)
    try:
        cluster.start_controller()
        cluster.start_worker(
            f"bench.peer_app:{app}", "peers", extra=["--cpus", "2", "--gpus", gpus, *worker_args]
        )
        return asyncio.run(phases(cluster))
    except Exception as exc:
        logs = {role: cluster.log_tail(role, 1500) for role in ("controller", "worker-peers")}
        return {"error": f"{type(exc).__name__}: {exc}", "logs": logs}
    finally:
        procs.stop_all()


def turnout_rep(params: dict[str, Any], profile: bool) -> dict[str, Any]:
    """The CPU phases on one fresh controller and worker, then the quarter-GPU case on another (fake GPUs)."""
    with tempfile.TemporaryDirectory(prefix="peers-turnout-") as tmp:
        out = on_fresh_cluster(Path(tmp) / "cpu", "cpu_app", "none", lambda c: cpu_phases(c, params, profile))
        if "error" in out:
            return out
        quarter = on_fresh_cluster(
            Path(tmp) / "gpu", "gpu_app", "fake:2x80Gi", lambda c: _quarter_phase(c, params)
        )
        out["quarter_gpu"] = quarter
        if "error" in quarter:
            return {"error": f"quarter-GPU case: {quarter['error']}", "logs": quarter["logs"], **out}
        return out


# ---- Celery ------------------------------------------------------------------------------------


def installed(*modules: str) -> bool:
    """Whether these modules can be imported, without importing them (Ray's import alone takes seconds)."""
    try:
        return all(importlib.util.find_spec(m) is not None for m in modules)
    except (ImportError, ValueError):  # ValueError: blocked in sys.modules (None), or a spec-less stand-in
        return False


def celery_missing() -> str | None:
    """Why Celery cannot be measured here (not installed, no Redis), or None."""
    if not installed("celery", "redis"):
        return NOT_INSTALLED
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_timeout=2).ping()
    except redis.RedisError as exc:
        return f"no Redis at {REDIS_URL} ({exc})"
    return None


def _redis_info_cpu_s() -> float:
    """The Redis server's CPU seconds by its own account (INFO), for when its process is not visible here."""
    import redis

    info = redis.Redis.from_url(REDIS_URL).info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _celery_roots(worker_pid: int) -> dict[str, int]:
    """The processes Celery's CPU is read from: its worker tree, and the Redis server where /proc shows it."""
    import redis

    roots = {"celery": worker_pid}
    with contextlib.suppress(psutil.Error, KeyError, ValueError):
        pid = int(redis.Redis.from_url(REDIS_URL).info("server")["process_id"])
        psutil.Process(pid).cpu_times()
        roots["redis"] = pid
    return roots


def celery_rep(params: dict[str, Any]) -> dict[str, Any]:
    """One worker, prefork -c 2, on a flushed db 15; bulk, one-by-one and latency as for the others."""
    import redis
    from celery import group
    from celery.result import ResultSet

    from bench.celery_app import app, noop

    n, timeout_s = params["n"], params["timeout_s"]
    redis.Redis.from_url(REDIS_URL).flushdb()
    procs = Processes()
    env = {**os.environ, "BENCH_CELERY_REDIS": REDIS_URL, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    tmp = Path(tempfile.mkdtemp(prefix="peers-celery-"))
    try:
        argv = [sys.executable, "-m", "celery", "-A", "bench.celery_app", "worker", "--pool", "prefork",
                "--concurrency", "2", "--loglevel", "WARNING", "-n", f"peers-{os.getpid()}@%h",
                "--without-gossip", "--without-mingle", "--without-heartbeat"]  # fmt: skip
        worker = procs.start(argv, env, tmp / "celery.log")
        deadline = time.monotonic() + 60
        while not app.control.ping(timeout=0.5):
            if time.monotonic() > deadline or worker.poll() is not None:
                return {"error": f"celery worker did not answer: {(tmp / 'celery.log').read_text()[-1500:]}"}
        group(noop.s() for _ in range(WARMUP)).apply_async().get(timeout=timeout_s)
        out: dict[str, Any] = {"version": __import__("celery").__version__, "slots": 2}

        roots = _celery_roots(worker.pid)
        redis0, cli0 = _redis_info_cpu_s(), own_cpu_s()
        t0 = time.perf_counter()
        with CpuMeter(roots) as meter:
            result = group(noop.s() for _ in range(n)).apply_async()
            submit_s = time.perf_counter() - t0
            result.get(timeout=timeout_s, propagate=False)
            elapsed = time.perf_counter() - t0
        cpu = meter.seconds()
        if "redis" not in roots:
            cpu["redis"] = _redis_info_cpu_s() - redis0
        client = own_cpu_s() - cli0 - meter.overhead_s
        good = sum(1 for r in result.results if r.successful())
        out["bulk"] = phase_figures(n, elapsed, submit_s, good, cpu_s=sum(cpu.values()), client_cpu_s=client)
        out["bulk"]["cpu_ms_per_task_by_role"] = {role: round(1000 * s / n, 3) for role, s in cpu.items()}
        out["bulk"]["processes_started"] = meter.started()

        t0 = time.perf_counter()
        singles = ResultSet([noop.delay() for _ in range(n)])
        submit_s = time.perf_counter() - t0
        singles.get(timeout=timeout_s, propagate=False)
        elapsed = time.perf_counter() - t0
        out["single"] = phase_figures(n, elapsed, submit_s, sum(1 for r in singles.results if r.successful()))

        samples, failed = [], 0
        for i in range(20 + params["n_latency"]):
            t0 = time.perf_counter()
            r = noop.delay()
            r.get(timeout=30, propagate=False)
            if i >= 20:
                samples.append(time.perf_counter() - t0)
                failed += not r.successful()
        out["latency"] = latency_figures(samples, failed)
        return out
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


# ---- Ray -----------------------------------------------------------------------------------------


def _kill_leftovers(marker: str) -> None:
    """Ray starts some processes in sessions of their own: end every process whose command line names this
    run's temp dir (only ours do), by pid, once the driver is gone."""
    for proc in psutil.process_iter(["pid", "cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(marker in arg for arg in proc.info["cmdline"] or ()):
                proc.kill()


def ray_rep(params: dict[str, Any]) -> dict[str, Any]:
    """`bench.peer_ray` in its own process with its own temp dir; whatever it leaves behind is killed."""
    if not installed("ray"):
        return {"skipped": NOT_INSTALLED}
    temp_dir = tempfile.mkdtemp(prefix="rayp-")  # short: Ray's socket paths must fit in 107 bytes
    args = {k: params[k] for k in ("n", "n_latency", "n_gpu", "n_gpu_default", "timeout_s")}
    procs = Processes()
    log = Path(temp_dir) / "driver.log"
    try:
        driver = procs.start([sys.executable, "-m", "bench.peer_ray", json.dumps({**args, "temp_dir": temp_dir})],
                             {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
                             log)  # fmt: skip
        try:
            driver.wait(timeout=6 * params["timeout_s"])
        except subprocess.TimeoutExpired:
            return {"error": f"the Ray driver ran past {6 * params['timeout_s']} s"}
        text = log.read_text(errors="replace")
        found = [line[len(MARK) :] for line in text.splitlines() if line.startswith(MARK)]
        if not found:
            return {"error": f"the Ray driver exited {driver.returncode} without a result: {text[-1500:]}"}
        return dict(json.loads(found[-1]))
    finally:
        procs.stop_all()
        _kill_leftovers(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


# ---- the comparison ----------------------------------------------------------------------------


def run(quick: bool = False, profile: bool = False, timeout_s: float = 1800) -> dict[str, Any]:
    """Interleave the three systems' repetitions (T, C, R, T, C, R, ...), then judge the medians."""
    reps = 1 if quick else 3
    n = 1000 if quick else 10_000
    params = {"n": n, "n_gpu": n, "n_latency": 100 if quick else 500, "n_gpu_default": 40, "reps": reps,
              "chunk": CHUNK, "callers": CALLERS, "timeout_s": timeout_s, "quick": quick}  # fmt: skip
    started, load0 = time.time(), os.getloadavg()
    why_not_celery = celery_missing()
    systems: dict[str, dict[str, Any]] = {name: {"reps": []} for name in LABELS}
    if why_not_celery:
        systems["celery"] = {"skipped": why_not_celery}
    for i in range(reps):
        for name in LABELS:
            if "skipped" in systems[name]:
                continue
            print(f"   rep {i + 1}/{reps}: {name} ...", flush=True)
            if name == "turnout":
                rep = turnout_rep(params, profile and i == 0)
            elif name == "celery":
                rep = celery_rep(params)
            else:
                rep = ray_rep(params)
            if "skipped" in rep:
                systems[name] = rep
            else:
                systems[name]["reps"].append(rep)
    out: dict[str, Any] = {
        "turnout_source": _source_state(),
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                    "loadavg_at_start": [round(x, 2) for x in load0]},
        "params": params, "systems": systems, "wall_s": round(time.time() - started, 1),
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
    }  # fmt: skip
    out["summary"] = summarize(systems)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{NAME}.md").write_text(summary(out))
    return out


def summary(result: dict[str, Any]) -> str:
    """The Markdown tables (also written to bench/results/peers.md)."""
    p, m = result["params"], result["machine"]
    preface = (f"{p['n']:,} no-op tasks per phase, {p['reps']} interleaved repetition(s), medians; every system "
               f"with 2 execution slots; {m['cpus']} CPUs, load average {m['loadavg_at_start'][0]} at start, "
               f"{result['loadavg_at_end'][0]} at end; turnout {result['turnout_source']}")  # fmt: skip
    return markdown(result["summary"], preface)
