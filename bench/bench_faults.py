"""The worker-SIGKILL fault, measured on Turnout and Celery with one protocol, side by side in one run.

    python -m bench --only faults [--quick]

Protocol (both systems at their defaults, each given 2 execution slots):
- 50 tasks that each sleep 2 s are submitted at once to one worker with 2 slots (Turnout: a `cpu=1`
  capability on a worker with `--cpus 2`; Celery: prefork `--concurrency 2`, Redis as broker and backend);
- 3 s after the first submit the worker's whole process tree is SIGKILLed (agent, handler processes,
  their children) at once; 2 s later a new worker is started; the run is watched for 240 s.
Figures, from each task's run log (a start line and an end line per run; see `bench/fault_app.py`):
- exactly once: tasks that finished successfully with exactly one completed run;
- lost: tasks not finished when the watch ends; duplicated: tasks whose handler completed more than once;
- seconds from the kill until every task that the kill interrupted has started again (and the first one);
- processes left: processes of the killed tree still alive 5 s after the kill.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.common import REPO, Processes, TurnoutCluster, log_tail

N_TASKS, TASK_S, KILL_AFTER_S, RESTART_AFTER_S, WATCH_S = 50, 2.0, 3.0, 2.0, 240.0
QUICK = (20, 1.0, 2.0, 2.0, 60.0)
REDIS_URL = os.environ.get("BENCH_CELERY_REDIS", "redis://127.0.0.1:6379/14")


def kill_tree(root_pid: int) -> list[psutil.Process]:
    """SIGKILL a process and all its descendants at once; returns them (to check later that none lives)."""
    try:
        root = psutil.Process(root_pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    return tree


def still_alive(tree: list[psutil.Process]) -> list[int]:
    alive = []
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:  # is_running() also checks pid reuse
                alive.append(p.pid)
    return alive


def read_runs(log: Path) -> list[tuple[str, str, float]]:
    """(what, task id, epoch s) per line of the run log."""
    if not log.exists():
        return []
    out = []
    for line in log.read_text().splitlines():
        what, task_id, _pid, ts = line.split()
        out.append((what, task_id, float(ts)))
    return out


def figures(ids: list[str], finished: set[str], runs: list[tuple[str, str, float]], killed_at: float,
            left: list[int]) -> dict[str, Any]:  # fmt: skip
    """The bench's figures from the run log and which tasks the system reports finished."""
    ends: dict[str, int] = {}
    for what, task_id, _ in runs:
        if what == "end":
            ends[task_id] = ends.get(task_id, 0) + 1
    before = [(w, t) for w, t, ts in runs if ts < killed_at]
    started_before = {t for w, t in before if w == "start"}
    ended_before = {t for w, t in before if w == "end"}
    interrupted = started_before - ended_before
    restarted = {}
    for what, task_id, ts in runs:
        if what == "start" and ts >= killed_at and task_id in interrupted and task_id not in restarted:
            restarted[task_id] = ts - killed_at
    return {
        "tasks": len(ids),
        "exactly_once": sum(1 for t in ids if t in finished and ends.get(t) == 1),
        "lost": sum(1 for t in ids if t not in finished),
        "duplicated": sum(1 for t in ids if ends.get(t, 0) > 1),
        "interrupted_by_kill": len(interrupted),
        "interrupted_restarted": len(restarted),
        "first_rerun_s": round(min(restarted.values()), 2) if restarted else None,
        "all_rerun_s": round(max(restarted.values()), 2) if len(restarted) == len(interrupted) and restarted
        else None,
        "processes_left": len(left),
    }  # fmt: skip


def _watch(done: Callable[[], set[str]], ids: list[str], watch_s: float, started: float) -> set[str]:
    finished: set[str] = set()
    while time.monotonic() - started < watch_s:
        finished = done()
        if len(finished) >= len(ids):
            break
        time.sleep(0.5)
    return finished


# ---- Turnout -----------------------------------------------------------------------------------


def bench_turnout(n: int, task_s: float, kill_after_s: float, restart_after_s: float, watch_s: float) -> dict[str, Any]:  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="turnout-faults-"))
    procs = Processes()
    log = tmp / "runs.log"
    try:
        cluster = TurnoutCluster(tmp, procs)  # default 5 s heartbeats, as a user runs it
        cluster.start_controller()
        victim = cluster.start_worker("bench.fault_app:app", "victim", extra=["--cpus", "2"])
        body = {"tasks": [{"capability": "sleep", "input": {"seconds": task_s, "log": str(log), "n": i}}
                          for i in range(n)]}  # fmt: skip
        started = time.monotonic()
        resp = httpx.post(f"{cluster.url}/v1/tasks/batch", json=body, headers=cluster.headers, timeout=60)
        resp.raise_for_status()
        ids = [t["id"] for t in resp.json()["tasks"]]
        time.sleep(max(0.0, started + kill_after_s - time.monotonic()))
        killed_at = time.time()
        tree = kill_tree(victim.pid)
        time.sleep(restart_after_s)
        cluster.start_worker("bench.fault_app:app", "restarted", extra=["--cpus", "2"])
        time.sleep(max(0.0, killed_at + 5 - time.time()))
        left = still_alive(tree)

        def done() -> set[str]:
            tasks = httpx.get(f"{cluster.url}/v1/tasks", params={"limit": 1000}, headers=cluster.headers,
                              timeout=30).json()["tasks"]  # fmt: skip
            return {t["id"] for t in tasks if t["state"] == "succeeded"}

        finished = _watch(done, ids, watch_s, started)
        return {"system": "turnout", "heartbeat_s": cluster.heartbeat_s,
                **figures(ids, finished, read_runs(log), killed_at, left)}  # fmt: skip
    except Exception as exc:
        return {"system": "turnout", "error": f"{type(exc).__name__}: {exc}"}
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


# ---- Celery ------------------------------------------------------------------------------------


def bench_celery(n: int, task_s: float, kill_after_s: float, restart_after_s: float, watch_s: float) -> dict[str, Any]:  # fmt: skip
    try:
        import redis
        from celery.result import AsyncResult
    except ImportError as exc:
        return {"system": "celery", "skipped": f"celery is not installed (pip install -e '.[bench]'): {exc}"}
    try:
        redis.Redis.from_url(REDIS_URL, socket_timeout=2).flushdb()
    except Exception as exc:
        return {"system": "celery", "skipped": f"no Redis at {REDIS_URL}: {exc}"}
    env = {**os.environ, "BENCH_CELERY_REDIS": REDIS_URL, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    os.environ["BENCH_CELERY_REDIS"] = REDIS_URL
    from bench.celery_app import app, sleep_logged

    tmp = Path(tempfile.mkdtemp(prefix="celery-faults-"))
    log = tmp / "runs.log"
    procs = Processes()

    def start_worker(name: str) -> Any:
        argv = [sys.executable, "-m", "celery", "-A", "bench.celery_app", "worker", "--pool", "prefork",
                "--concurrency", "2", "--loglevel", "WARNING", "-n", f"{name}-{os.getpid()}@%h"]  # fmt: skip
        proc = procs.start(argv, env, tmp / f"celery-{name}.log")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            replies = app.control.ping(timeout=0.5) or []
            if any(name in key for r in replies for key in r):
                return proc
        why = "exited" if proc.poll() is not None else "did not answer ping in 60 s"
        tail = log_tail(tmp / f"celery-{name}.log", 1500)
        raise RuntimeError(f"celery worker {name} {why}; its log ends:\n{tail}")

    try:
        victim = start_worker("victim")
        started = time.monotonic()
        results = [sleep_logged.delay({"seconds": task_s, "log": str(log), "n": i}) for i in range(n)]
        ids = [r.id for r in results]
        time.sleep(max(0.0, started + kill_after_s - time.monotonic()))
        killed_at = time.time()
        tree = kill_tree(victim.pid)
        time.sleep(restart_after_s)
        start_worker("restarted")
        time.sleep(max(0.0, killed_at + 5 - time.time()))
        left = still_alive(tree)

        def done() -> set[str]:
            return {i for i in ids if AsyncResult(i, app=app).state == "SUCCESS"}

        finished = _watch(done, ids, watch_s, started)
        return {"system": "celery", "version": __import__("celery").__version__, "settings": "defaults, prefork -c 2",
                **figures(ids, finished, read_runs(log), killed_at, left)}  # fmt: skip
    except Exception as exc:
        return {"system": "celery", "error": f"{type(exc).__name__}: {exc}"}
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(Exception):
            app.close()


def run(quick: bool = False) -> dict[str, Any]:
    n, task_s, kill_after_s, restart_after_s, watch_s = QUICK if quick else (
        N_TASKS, TASK_S, KILL_AFTER_S, RESTART_AFTER_S, WATCH_S)  # fmt: skip
    protocol = {"tasks": n, "task_s": task_s, "slots": 2, "kill_after_s": kill_after_s,
                "restart_after_s": restart_after_s, "watch_s": watch_s}  # fmt: skip
    return {
        "protocol": protocol,
        "turnout": bench_turnout(n, task_s, kill_after_s, restart_after_s, watch_s),
        "celery": bench_celery(n, task_s, kill_after_s, restart_after_s, watch_s),
    }


def summary(result: dict[str, Any]) -> str:
    p = result["protocol"]
    lines = [f"  {p['tasks']} tasks of {p['task_s']} s on {p['slots']} slots; whole worker tree SIGKILLed at "
             f"{p['kill_after_s']} s, restarted {p['restart_after_s']} s later, watched {p['watch_s']:.0f} s"]  # fmt: skip
    for key in ("turnout", "celery"):
        r = result[key]
        if "skipped" in r or "error" in r:
            lines.append(f"  {key}: {r.get('skipped') or r.get('error')}")
            continue
        lines.append(
            f"  {key:<8} exactly once {r['exactly_once']}/{r['tasks']}, lost {r['lost']}, duplicated "
            f"{r['duplicated']}; interrupted {r['interrupted_by_kill']}, running again: first "
            f"{r['first_rerun_s']} s, all {r['all_rerun_s']} s; processes left {r['processes_left']}"
        )
    return "\n".join(lines)
