"""Controller replicas on PostgreSQL next to one controller on SQLite, in one run on one machine.

Setups, one at a time, each on a fresh database, each with two `turnout worker turnout.demo:app` processes:

- `sqlite`: one controller on a SQLite file (the embedded default);
- `postgres-1`: one controller on PostgreSQL;
- `postgres-2`: two controllers on one PostgreSQL database, one worker on each, submissions alternating.

Figures per setup: no-op throughput (N tasks in batches of 500, submitted round robin over the replicas,
timed from the first submit to the `finished_at` of the last one to finish, all must succeed) and the p50 of single tasks submitted one after another (submit, then
`GET /result?wait=10` on the same replica). Then, on two PostgreSQL replicas with one worker polling
replica B only: the p50 of a task submitted on A and leased through B (it reaches B's parked long poll by
LISTEN/NOTIFY), against the p50 of the same task submitted on B.

Aims: PostgreSQL with one controller within 2x of SQLite's throughput; two controllers faster than one;
the cross-replica p50 within 2x of the same-replica p50. Ratios are printed and written to
bench/results/replicas.json. On a 2-core machine every process of a setup shares those two cores with the
database, so a second controller adds contention as well as capacity.

    python -m bench --only replicas [--quick]
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from bench.common import Processes, TurnoutCluster, percentile

NAME = "replicas"
PG_URL = os.environ.get("TURNOUT_BENCH_POSTGRES") or os.environ.get(
    "TURNOUT_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test"
)
BATCH = 500
POLL_S = 0.5


@contextlib.contextmanager
def _pg_database() -> Iterator[str]:
    """A fresh PostgreSQL database for one setup, dropped afterwards."""
    import sqlalchemy as sa

    from turnout.store.sql import normalise_url

    admin = sa.create_engine(normalise_url(PG_URL), isolation_level="AUTOCOMMIT")
    name = f"turnout_bench_{secrets.token_hex(4)}"
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield PG_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@contextlib.contextmanager
def _setup(db: str | None, controllers: int, workers_on: list[int]) -> Iterator[list[TurnoutCluster]]:
    """`controllers` replicas on `db` (None: a SQLite file), sharing one home, and a worker on each replica
    index in `workers_on`."""
    procs = Processes()
    tmp = Path(tempfile.mkdtemp(prefix="turnout-bench-replicas-"))
    try:
        replicas = []
        for i in range(controllers):
            (tmp / f"r{i}").mkdir()
            r = TurnoutCluster(
                tmp / f"r{i}", procs, db=db or f"sqlite:///{tmp / 'turnout.db'}", home=tmp / "home"
            )
            r.start_controller()
            replicas.append(r)
        for n, i in enumerate(workers_on):
            replicas[i].start_worker("turnout.demo:app", f"w{n}")
        yield replicas
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


def _left(replica: TurnoutCluster, client: httpx.Client) -> int:
    total = 0
    for line in client.get(f"{replica.url}/metrics").text.splitlines():
        if line.startswith(("turnout_queue_depth{", "turnout_tasks_active{")):
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


def _throughput(replicas: list[TurnoutCluster], n: int, timeout_s: float) -> dict[str, Any]:
    """N no-op tasks in batches, submitted round robin over the replicas; timed from the first submit to the
    last task's `finished_at` (the controllers judge time by the database's clock, this host's). Whether
    all are done is asked every POLL_S only: a tight poll of /metrics would load the controller it measures."""
    body = {"tasks": [{"capability": "noop"} for _ in range(BATCH)]}
    ids: list[str] = []
    headers = replicas[0].headers
    with httpx.Client(headers=headers, timeout=60) as client:
        started_at = time.time()
        for i, start in enumerate(range(0, n, BATCH)):
            size = min(BATCH, n - start)
            target = replicas[i % len(replicas)]
            resp = client.post(
                f"{target.url}/v1/tasks/batch",
                json=body if size == BATCH else {"tasks": body["tasks"][:size]},
            )
            resp.raise_for_status()
            ids += [t["id"] for t in resp.json()["tasks"]]
        submit_s = time.time() - started_at
        deadline = time.monotonic() + timeout_s
        while _left(replicas[0], client):
            if time.monotonic() > deadline:
                raise TimeoutError("tasks still in flight at the deadline")
            time.sleep(POLL_S)
    succeeded, last_finished_at = _succeeded(replicas[0], ids)
    elapsed = last_finished_at - started_at
    return {"tasks": n, "elapsed_s": round(elapsed, 3), "submit_s": round(submit_s, 3),
            "tasks_per_s": round(n / elapsed, 1), "all_succeeded": succeeded}  # fmt: skip


def _succeeded(replica: TurnoutCluster, ids: list[str]) -> tuple[bool, float]:
    """Whether every task of `ids` succeeded, and when the last of them finished (epoch seconds)."""
    wanted = set(ids)
    seen: set[str] = set()
    last = 0.0
    cursor: str | None = None
    with httpx.Client(headers=replica.headers, timeout=60) as client:
        while True:
            params: dict[str, Any] = {
                "state": "succeeded",
                "limit": 1000,
                **({"cursor": cursor} if cursor else {}),
            }
            body = client.get(f"{replica.url}/v1/tasks", params=params).json()
            for t in body["tasks"]:
                if t["id"] in wanted:
                    seen.add(t["id"])
                    last = max(last, datetime.fromisoformat(t["finished_at"]).timestamp())
            cursor = body.get("next_cursor")
            if not cursor:
                return seen == wanted, last


def _latency(submit_to: TurnoutCluster, wait_on: TurnoutCluster, n: int, warmup: int) -> dict[str, Any]:
    samples: list[float] = []
    failed = 0
    with httpx.Client(headers=submit_to.headers, timeout=30) as client:
        for i in range(warmup + n):
            t0 = time.perf_counter()
            task_id = client.post(f"{submit_to.url}/v1/tasks", json={"capability": "noop"}).json()["id"]
            task = client.get(f"{wait_on.url}/v1/tasks/{task_id}/result", params={"wait": 10}).json()
            dt = time.perf_counter() - t0
            if i >= warmup:
                samples.append(dt)
                failed += task["state"] != "succeeded"
    return {"n": len(samples), "failed": failed, "p50_ms": round(1000 * percentile(samples, 50), 2),
            "p90_ms": round(1000 * percentile(samples, 90), 2), "p99_ms": round(1000 * percentile(samples, 99), 2)}  # fmt: skip


def _measure(db: str | None, controllers: int, n: int, n_latency: int, timeout_s: float) -> dict[str, Any]:
    with _setup(db, controllers, workers_on=[i % controllers for i in range(2)]) as replicas:
        _throughput(replicas, 200, timeout_s)  # warm the handler pools
        out = {"controllers": controllers, "workers": 2, "batch": _throughput(replicas, n, timeout_s)}
        out["latency"] = _latency(replicas[0], replicas[0], n_latency, warmup=20)
        return out


def _cross_replica(db: str, n_latency: int) -> dict[str, Any]:
    """Two replicas, one worker on replica B: tasks submitted on A (and waited for on A) against tasks
    submitted on B (and waited for on B)."""
    with _setup(db, 2, workers_on=[1]) as (a, b):
        _latency(b, b, 20, warmup=0)
        same = _latency(b, b, n_latency, warmup=10)
        cross = _latency(a, a, n_latency, warmup=10)
    return {"same_replica": same, "cross_replica": cross, "ratio": round(cross["p50_ms"] / same["p50_ms"], 2)}


def _pg_ok() -> str | None:
    try:
        with _pg_database():
            return None
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"


def run(quick: bool = False, timeout_s: float = 300) -> dict[str, Any]:
    n, n_latency = (1000, 60) if quick else (5000, 200)
    out: dict[str, Any] = {"params": {"tasks": n, "n_latency": n_latency, "batch": BATCH, "quick": quick},
                           "machine": {"cpus": os.cpu_count(), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}}  # fmt: skip
    why_not = _pg_ok()
    out["sqlite"] = _measure(None, 1, n, n_latency, timeout_s)
    if why_not is not None:
        out["postgres"] = {"skipped": f"no PostgreSQL at {PG_URL}: {why_not}"}
        return out
    with _pg_database() as db:
        out["postgres-1"] = _measure(db, 1, n, n_latency, timeout_s)
    with _pg_database() as db:
        out["postgres-2"] = _measure(db, 2, n, n_latency, timeout_s)
    with _pg_database() as db:
        out["cross_replica"] = _cross_replica(db, n_latency)
    sq, p1, p2 = (out[k]["batch"]["tasks_per_s"] for k in ("sqlite", "postgres-1", "postgres-2"))
    out["ratios"] = {
        "postgres1_over_sqlite_throughput": round(p1 / sq, 2), "postgres2_over_postgres1_throughput": round(p2 / p1, 2),
        "postgres1_over_sqlite_p50": round(out["postgres-1"]["latency"]["p50_ms"] / out["sqlite"]["latency"]["p50_ms"], 2),
        "cross_over_same_replica_p50": out["cross_replica"]["ratio"],
    }  # fmt: skip
    r = out["ratios"]
    out["aims"] = {"postgres1_within_2x_of_sqlite": r["postgres1_over_sqlite_throughput"] >= 0.5,
                   "two_controllers_faster_than_one": r["postgres2_over_postgres1_throughput"] > 1.0,
                   "cross_replica_p50_within_2x": r["cross_over_same_replica_p50"] <= 2.0}  # fmt: skip
    out["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return out


def summary(result: dict[str, Any]) -> str:
    lines = [f"  {result['machine']['cpus']} cpus, load {result['machine']['loadavg_at_start'][0]} at start"]
    for key in ("sqlite", "postgres-1", "postgres-2"):
        r = result.get(key)
        if not r or "batch" not in r:
            continue
        b, lat = r["batch"], r["latency"]
        lines.append(f"  {key:<11} {r['controllers']} controller(s): {b['tasks_per_s']:>7.1f} tasks/s "
                     f"(all ok: {b['all_succeeded']})  p50 {lat['p50_ms']:.2f} ms  p99 {lat['p99_ms']:.2f} ms")  # fmt: skip
    if "postgres" in result:
        lines.append(f"  postgres: {result['postgres']['skipped']}")
    if "cross_replica" in result:
        c = result["cross_replica"]
        lines.append(f"  submitted on A, leased through B: p50 {c['cross_replica']['p50_ms']:.2f} ms; same replica "
                     f"{c['same_replica']['p50_ms']:.2f} ms ({c['ratio']}x)")  # fmt: skip
    if "ratios" in result:
        lines.append(f"  ratios: {result['ratios']}")
        lines.append(f"  aims: {result['aims']}")
    return "\n".join(lines)


if __name__ == "__main__":
    import json

    print(json.dumps(run(quick="--quick" in sys.argv), indent=2))
