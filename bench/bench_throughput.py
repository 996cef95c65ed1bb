"""No-op throughput and submit-to-result latency: Turnout on SQLite next to Celery on the local Redis.

One run, one machine, one workload, one system at a time (never both at once):

- Turnout: a controller subprocess on a fresh SQLite file and two `turnout worker turnout.demo:app`
  subprocesses. Throughput is N no-op tasks submitted with `POST /v1/tasks/batch`, timed from the first
  submit until every one is terminal; all must have succeeded. For reference, the same with one
  `POST /v1/tasks` per task from a few concurrent clients.
- Celery 5: Redis as broker and result backend (db 15, flushed first), two `celery worker` processes,
  throughput of `group(...).apply_async()` of N no-op tasks timed until every result is ready. Both
  prefork concurrency 1 (one child per worker, two in all) and Celery's default concurrency (one child
  per core: two per worker, four in all) are measured; the faster is the yardstick, so the ratio is
  the one least flattering to Turnout.
- Latency: single tasks one after another, submit to result. Turnout: `POST /v1/tasks` then
  `GET /v1/tasks/{id}/result?wait=10` on one keep-alive client. Celery: `noop.delay().get()`.

Ratios are turnout / celery: above 1 is better for throughput, below 1 is better for latency.
Durability differs and favours Celery: Turnout fsyncs every accepted task and state change; Redis runs
with its own persistence settings (usually none, or a snapshot now and then).

    python -m bench --only throughput [--quick] [--profile]
    from bench.bench_throughput import run           run(quick=False, profile=False) -> dict

With `profile=True`, py-spy records the controller and both workers (and their handler processes)
during the Turnout batch phase; collapsed stacks land in `bench/results/profile-*.txt` and the hottest
frames in the result.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.common import REPO, RESULTS, Processes, TurnoutCluster, log_tail, percentile

NAME = "throughput"
REDIS_URL = "redis://127.0.0.1:6379/15"
AIM_THROUGHPUT_RATIO = 1.5
NONTERMINAL = ("queued", "leased", "running")


# ---- Turnout -----------------------------------------------------------------------------------


def _nonterminal(client: httpx.Client) -> int:
    """Tasks not yet terminal, from `/metrics` (queued, and leased or running)."""
    total = 0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(("turnout_queue_depth{", "turnout_tasks_active{")):
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


def _wait_all_terminal(client: httpx.Client, last_id: str, deadline: float) -> None:
    """Long-poll the last task submitted, then confirm nothing is left in flight.

    Tasks of equal priority are leased oldest first, so when the last is done nearly all are; the
    few stragglers are polled for every 20 ms.
    """
    while time.monotonic() < deadline:
        left = max(0.1, min(10.0, deadline - time.monotonic()))
        task = client.get(f"/v1/tasks/{last_id}/result", params={"wait": left}, timeout=left + 10).json()
        if task["state"] in ("succeeded", "failed", "cancelled"):
            break
    while time.monotonic() < deadline:
        if _nonterminal(client) == 0:
            return
        time.sleep(0.02)
    raise TimeoutError("tasks still in flight at the deadline")


def _count_states(client: httpx.Client, ids: set[str]) -> Counter[str]:
    """States of the given tasks (paging through `GET /v1/tasks` for each terminal state)."""
    states: Counter[str] = Counter()
    for state in ("succeeded", "failed", "cancelled", *NONTERMINAL):
        cursor: str | None = None
        while True:
            params: dict[str, Any] = {"state": state, "limit": 1000, **({"cursor": cursor} if cursor else {})}
            body = client.get("/v1/tasks", params=params).json()
            states[state] += sum(1 for t in body["tasks"] if t["id"] in ids)
            cursor = body.get("next_cursor")
            if not cursor:
                break
    return states


def _tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its live descendants."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


class _Profiler:
    """py-spy recording a set of processes until stopped; raw collapsed stacks, one file per process."""

    def __init__(self, pids: dict[str, int], out_dir: Path, tag: str) -> None:
        self.files = {role: out_dir / f"profile-{tag}-{role}.txt" for role in pids}
        self.procs: list[subprocess.Popen[bytes]] = []
        py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        for role, pid in pids.items():
            argv = [py_spy, "record", "--pid", str(pid), "--format", "raw", "--rate", "200", "--nonblocking",
                    "--subprocesses", "-o", str(self.files[role])]  # fmt: skip
            self.procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        time.sleep(1.0)  # py-spy attaches in well under a second

    def stop(self) -> dict[str, Any]:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        errors = []
        for p in self.procs:
            try:
                _, err = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            if p.returncode not in (0, -signal.SIGINT) and err:
                errors.append(err.decode(errors="replace")[-500:])
        out: dict[str, Any] = {"errors": errors}
        for role, path in self.files.items():
            if path.exists():
                out[role] = {"file": str(path.relative_to(REPO)), **_hot_frames(path)}
        return out


def _hot_frames(path: Path, top: int = 15) -> dict[str, Any]:
    """Self time and inclusive time per frame from py-spy's collapsed stacks (`a;b;c COUNT`)."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [f for f in stack.split(";") if not f.startswith("process ")]
        total += n
        if frames:
            own[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    pct = (lambda n: round(100.0 * n / total, 1)) if total else (lambda n: 0.0)
    return {
        "samples": total,
        "self": [[f, pct(n)] for f, n in own.most_common(top)],
        "inclusive": [[f, pct(n)] for f, n in inclusive.most_common(top * 2)],
    }


def _idle_cpu_pct(cluster: TurnoutCluster, seconds: float) -> dict[str, float]:
    """CPU each role burns with nothing to do (polling loops), in % of one core."""
    cpu0 = {role: _tree_cpu_s(pid) for role, pid in cluster.pids().items()}
    time.sleep(seconds)
    return {
        role: round(100 * (_tree_cpu_s(pid) - cpu0[role]) / seconds, 1)
        for role, pid in cluster.pids().items()
    }


def _turnout_batch(cluster: TurnoutCluster, n: int, batch_size: int, timeout_s: float) -> dict[str, Any]:
    body = {"tasks": [{"capability": "noop"} for _ in range(batch_size)]}
    ids: list[str] = []
    with httpx.Client(base_url=cluster.url, headers=cluster.headers, timeout=60) as client:
        cpu0 = {role: _tree_cpu_s(pid) for role, pid in cluster.pids().items()}
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        for start in range(0, n, batch_size):
            size = min(batch_size, n - start)
            resp = client.post(
                "/v1/tasks/batch", json=body if size == batch_size else {"tasks": body["tasks"][:size]}
            )
            resp.raise_for_status()
            ids.extend(t["id"] for t in resp.json()["tasks"])
        submitted_s = time.perf_counter() - t0
        _wait_all_terminal(client, ids[-1], deadline)
        elapsed = time.perf_counter() - t0
        cpu = {role: round(_tree_cpu_s(pid) - cpu0[role], 2) for role, pid in cluster.pids().items()}
        states = _count_states(client, set(ids))
    return {
        "tasks": n, "batch_size": batch_size, "elapsed_s": round(elapsed, 3), "submit_s": round(submitted_s, 3),
        "tasks_per_s": round(n / elapsed, 1), "submit_tasks_per_s": round(n / submitted_s, 1),
        "states": dict(states), "all_succeeded": states["succeeded"] == n, "cpu_s": cpu,
    }  # fmt: skip


def _turnout_single(cluster: TurnoutCluster, n: int, clients: int, timeout_s: float) -> dict[str, Any]:
    ids: list[str] = []

    async def submitter(http: httpx.AsyncClient, todo: list[int]) -> None:
        while todo:
            todo.pop()
            resp = await http.post("/v1/tasks", json={"capability": "noop"})
            resp.raise_for_status()
            ids.append(resp.json()["id"])

    async def submit_all() -> None:
        todo = list(range(n))
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(
            base_url=cluster.url, headers=cluster.headers, timeout=60, limits=limits
        ) as http:
            await asyncio.wait_for(
                asyncio.gather(*(submitter(http, todo) for _ in range(clients))), timeout_s
            )

    t0 = time.perf_counter()
    asyncio.run(submit_all())
    submitted_s = time.perf_counter() - t0
    with httpx.Client(base_url=cluster.url, headers=cluster.headers, timeout=60) as client:
        _wait_all_terminal(client, ids[-1], time.monotonic() + timeout_s)
        elapsed = time.perf_counter() - t0
        states = _count_states(client, set(ids))
    return {
        "tasks": n, "clients": clients, "elapsed_s": round(elapsed, 3), "submit_s": round(submitted_s, 3),
        "tasks_per_s": round(n / elapsed, 1), "submit_tasks_per_s": round(n / submitted_s, 1),
        "states": dict(states), "all_succeeded": states["succeeded"] == n,
    }  # fmt: skip


def _turnout_latency(cluster: TurnoutCluster, n: int, warmup: int) -> dict[str, Any]:
    samples: list[float] = []
    failed = 0
    with httpx.Client(base_url=cluster.url, headers=cluster.headers, timeout=30) as client:
        for i in range(warmup + n):
            t0 = time.perf_counter()
            task_id = client.post("/v1/tasks", json={"capability": "noop"}).json()["id"]
            task = client.get(f"/v1/tasks/{task_id}/result", params={"wait": 10}).json()
            dt = time.perf_counter() - t0
            if i >= warmup:
                samples.append(dt)
                failed += task["state"] != "succeeded"
    return _latency_summary(samples, failed)


def _latency_summary(samples: list[float], failed: int) -> dict[str, Any]:
    return {
        "n": len(samples), "failed": failed,
        "p50_ms": round(1000 * percentile(samples, 50), 2), "p90_ms": round(1000 * percentile(samples, 90), 2),
        "p99_ms": round(1000 * percentile(samples, 99), 2), "max_ms": round(1000 * max(samples), 2),
    }  # fmt: skip


def bench_turnout(n_batch: int, batch_size: int, n_single: int, clients: int, n_latency: int, *,
                  profile: bool, timeout_s: float) -> dict[str, Any]:  # fmt: skip
    procs = Processes()
    with tempfile.TemporaryDirectory(prefix="turnout-bench-") as tmp:
        try:
            cluster = TurnoutCluster(Path(tmp), procs)
            cluster.start_controller()
            cluster.start_worker("turnout.demo:app", "bench-1")
            cluster.start_worker("turnout.demo:app", "bench-2")
            out: dict[str, Any] = {"workers": 2, "store": "sqlite"}
            out["warmup"] = _turnout_batch(cluster, 200, 100, timeout_s)["tasks_per_s"]  # warm handler pools
            out["idle_cpu_pct"] = _idle_cpu_pct(cluster, seconds=3.0)
            out["processes"] = {role: 1 + len(psutil.Process(pid).children(recursive=True))
                                for role, pid in cluster.pids().items()}  # fmt: skip
            profiles: dict[str, Any] = {}
            profiler = _Profiler(cluster.pids(), RESULTS, "turnout-batch") if profile else None
            try:
                out["batch"] = _turnout_batch(cluster, n_batch, batch_size, timeout_s)
            finally:
                if profiler is not None:
                    profiles["batch"] = profiler.stop()
            out["single"] = _turnout_single(cluster, n_single, clients, timeout_s)
            profiler = _Profiler(cluster.pids(), RESULTS, "turnout-latency") if profile else None
            try:
                out["latency"] = _turnout_latency(cluster, n_latency, warmup=20)
            finally:
                if profiler is not None:
                    profiles["latency"] = profiler.stop()
            if profiles:
                out["profile"] = profiles
            return out
        except Exception as exc:
            logs = {
                name: cluster.log_tail(name, 1500)
                for name in ("controller", "worker-bench-1", "worker-bench-2")
            }
            return {"error": f"{type(exc).__name__}: {exc}", "logs": logs}
        finally:
            procs.stop_all()


# ---- Celery ------------------------------------------------------------------------------------


def _redis_ok() -> str | None:
    """None when the local Redis answers, else why not."""
    try:
        import redis

        redis.Redis.from_url(REDIS_URL, socket_timeout=2).ping()
    except Exception as exc:  # ImportError, connection refused, auth: all mean "skip"
        return f"{type(exc).__name__}: {exc}"
    return None


def bench_celery(
    n_batch: int, n_latency: int, concurrencies: list[int | None], *, timeout_s: float
) -> dict[str, Any]:
    why_not = _redis_ok()
    if why_not is not None:
        return {"skipped": f"no Redis at {REDIS_URL}: {why_not}"}
    try:
        import celery  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"celery is not installed (pip install -e '.[bench]'): {exc}"}
    out: dict[str, Any] = {"version": __import__("celery").__version__, "broker": REDIS_URL, "backend": REDIS_URL,
                           "workers": 2, "runs": {}}  # fmt: skip
    for conc in concurrencies:
        label = f"prefork-c{conc}" if conc else f"prefork-c{os.cpu_count()}-default"
        out["runs"][label] = _celery_run(n_batch, n_latency, conc, timeout_s)
    return out


def _celery_run(n_batch: int, n_latency: int, concurrency: int | None, timeout_s: float) -> dict[str, Any]:
    import redis
    from celery import group

    from bench.celery_app import app, noop

    redis.Redis.from_url(REDIS_URL).flushdb()
    procs = Processes()
    env = {**os.environ, "BENCH_CELERY_REDIS": REDIS_URL, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    tmp = Path(tempfile.mkdtemp(prefix="celery-bench-"))
    try:
        for i in (1, 2):
            argv = [sys.executable, "-m", "celery", "-A", "bench.celery_app", "worker", "--pool", "prefork",
                    "--loglevel", "WARNING", "-n", f"bench{i}-{os.getpid()}@%h",
                    "--without-gossip", "--without-mingle", "--without-heartbeat"]  # fmt: skip
            if concurrency:
                argv += ["--concurrency", str(concurrency)]
            procs.start(argv, env, tmp / f"celery-{i}.log")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if len(app.control.ping(timeout=0.5) or []) >= 2:
                break
        else:
            logs = " | ".join(log_tail(tmp / f"celery-{i}.log", 800) for i in (1, 2))
            return {"error": f"celery workers did not answer ping: {logs}"}
        group(noop.s() for _ in range(200)).apply_async().get(timeout=timeout_s)  # warm up

        pids = [p.pid for p in procs.procs]
        cpu0 = sum(_tree_cpu_s(p) for p in pids)
        t0 = time.perf_counter()
        result = group(noop.s() for _ in range(n_batch)).apply_async()
        submitted_s = time.perf_counter() - t0
        values = result.get(timeout=timeout_s)
        elapsed = time.perf_counter() - t0
        cpu = sum(_tree_cpu_s(p) for p in pids) - cpu0
        ok = len(values) == n_batch and result.successful()
        batch = {"tasks": n_batch, "elapsed_s": round(elapsed, 3), "submit_s": round(submitted_s, 3),
                 "tasks_per_s": round(n_batch / elapsed, 1), "all_succeeded": ok, "worker_cpu_s": round(cpu, 2)}  # fmt: skip
        result.forget()

        samples: list[float] = []
        failed = 0
        for i in range(20 + n_latency):
            t0 = time.perf_counter()
            r = noop.delay()
            try:
                r.get(timeout=10)
            except Exception:
                failed += 1
            dt = time.perf_counter() - t0
            if i >= 20:
                samples.append(dt)
        return {
            "concurrency": concurrency or os.cpu_count(),
            "batch": batch,
            "latency": _latency_summary(samples, failed),
        }
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(Exception):
            app.close()


# ---- the comparison ----------------------------------------------------------------------------


def run(quick: bool = False, profile: bool = False, timeout_s: float = 300) -> dict[str, Any]:
    """Measure both systems; ratios compare Turnout with the faster Celery configuration per figure."""
    n_batch, batch_size, n_single, clients, n_latency = (
        (1000, 250, 300, 4, 100) if quick else (5000, 500, 1000, 4, 300)
    )
    started, load_at_start = time.time(), os.getloadavg()
    turnout = bench_turnout(
        n_batch, batch_size, n_single, clients, n_latency, profile=profile, timeout_s=timeout_s
    )
    celery = bench_celery(n_batch, n_latency, [1, None], timeout_s=timeout_s)
    out: dict[str, Any] = {
        "turnout_source": _source_state(),
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                    "loadavg_at_start": [round(x, 2) for x in load_at_start]},
        "params": {"n_batch": n_batch, "batch_size": batch_size, "n_single": n_single, "single_clients": clients,
                   "n_latency": n_latency, "quick": quick},
        "turnout": turnout, "celery": celery, "wall_s": round(time.time() - started, 1),
        "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
    }  # fmt: skip
    out["comparison"] = _compare(turnout, celery)
    return out


def _source_state() -> dict[str, Any]:
    """The commit measured, and whether src/ had uncommitted changes (figures then describe the working tree)."""

    def git(*args: str) -> str:
        proc = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
        return proc.stdout.strip()

    try:
        return {
            "commit": git("rev-parse", "--short", "HEAD"),
            "src_dirty": bool(git("status", "--porcelain", "src")),
        }
    except (OSError, subprocess.SubprocessError) as exc:
        return {"error": str(exc)}


def _compare(turnout: dict[str, Any], celery: dict[str, Any]) -> dict[str, Any]:
    runs = [r for r in celery.get("runs", {}).values() if "batch" in r and r["batch"]["all_succeeded"]]
    if "error" in turnout or not runs:
        return {"skipped": turnout.get("error") or celery.get("skipped") or "no successful Celery run"}
    best_tps = max(r["batch"]["tasks_per_s"] for r in runs)
    best_p50 = min(r["latency"]["p50_ms"] for r in runs)
    best_p99 = min(r["latency"]["p99_ms"] for r in runs)
    t_tps, t_single = turnout["batch"]["tasks_per_s"], turnout["single"]["tasks_per_s"]
    p50, p99 = turnout["latency"]["p50_ms"], turnout["latency"]["p99_ms"]
    return {
        "celery_tasks_per_s": best_tps, "celery_p50_ms": best_p50, "celery_p99_ms": best_p99,
        "throughput_batch_ratio": round(t_tps / best_tps, 2), "throughput_single_ratio": round(t_single / best_tps, 2),
        "p50_ratio": round(p50 / best_p50, 2), "p99_ratio": round(p99 / best_p99, 2),
        "meets_throughput_aim": t_tps >= AIM_THROUGHPUT_RATIO * best_tps, "meets_p50_aim": p50 <= best_p50,
    }  # fmt: skip


def summary(result: dict[str, Any]) -> str:
    """A few readable lines for `python -m bench`."""
    t, c, cmp = result["turnout"], result["celery"], result["comparison"]
    m = result["machine"]
    lines = [f"  {m['cpus']} cpus, load average {m['loadavg_at_start'][0]} at start, {result['loadavg_at_end'][0]} at end; "
             f"turnout {result['turnout_source']}"]  # fmt: skip
    if "error" in t:
        lines.append(f"  turnout: ERROR {t['error']}")
    else:
        b, s, lat = t["batch"], t["single"], t["latency"]
        lines.append(f"  turnout batch   {b['tasks']:>5} tasks  {b['tasks_per_s']:>8.1f} tasks/s  "
                     f"(submit {b['submit_tasks_per_s']:.0f}/s, all ok: {b['all_succeeded']}, cpu s {b['cpu_s']})")  # fmt: skip
        lines.append(f"  turnout single  {s['tasks']:>5} tasks  {s['tasks_per_s']:>8.1f} tasks/s  "
                     f"({s['clients']} clients, all ok: {s['all_succeeded']})")  # fmt: skip
        lines.append(
            f"  turnout latency p50 {lat['p50_ms']:.2f} ms  p99 {lat['p99_ms']:.2f} ms  (n={lat['n']})"
        )
    if "skipped" in c:
        lines.append(f"  celery: skipped ({c['skipped']})")
    for label, r in c.get("runs", {}).items():
        if "error" in r:
            lines.append(f"  celery {label}: ERROR {r['error'][:300]}")
            continue
        b, lat = r["batch"], r["latency"]
        lines.append(f"  celery {label:<18} {b['tasks_per_s']:>8.1f} tasks/s  p50 {lat['p50_ms']:.2f} ms  "
                     f"p99 {lat['p99_ms']:.2f} ms  (all ok: {b['all_succeeded']})")  # fmt: skip
    if "skipped" in cmp:
        lines.append(f"  ratios: skipped ({cmp['skipped']})")
    else:
        lines.append(f"  ratio turnout/celery: throughput batch {cmp['throughput_batch_ratio']}x "
                     f"(aim >= {AIM_THROUGHPUT_RATIO}: {'met' if cmp['meets_throughput_aim'] else 'NOT met'}), "
                     f"single {cmp['throughput_single_ratio']}x; p50 {cmp['p50_ratio']}x "
                     f"(aim <= 1: {'met' if cmp['meets_p50_aim'] else 'NOT met'}), p99 {cmp['p99_ratio']}x")  # fmt: skip
    if "idle_cpu_pct" in t:
        lines.append(f"  turnout idle cpu % of a core: {t['idle_cpu_pct']}  processes: {t['processes']}")
    for phase, prof in t.get("profile", {}).items():
        lines.append(
            f"  profile {phase}: {', '.join(v['file'] for v in prof.values() if isinstance(v, dict))}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(run(quick="--quick" in sys.argv, profile="--profile" in sys.argv), indent=2))
