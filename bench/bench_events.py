"""Live events: throughput from one command worker to one SSE client, and the latency the path adds.

A real controller (SQLite) and a real worker run as subprocesses on loopback, serving one session-mode
preset whose program writes events as fast as it can (throughput) or one every few milliseconds with the
time it wrote it (latency). The client reads `GET /v1/tasks/{id}/events` with the SDK.

- events_per_s: text_delta events from the client's first to its last, over that time (aim: 20,000/s);
- latency_ms p50/p95: client receive time minus the program's write time, same host clock (aim: p50 < 10 ms);
- cpu_us_per_event: CPU each process spent per event during the flood, which does not depend on what else
  the host runs; 1e6 / the busiest process's figure is the rate this path reaches with a core per process.

    python bench/bench_events.py            prints JSON
    from bench.bench_events import run      run() -> dict
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from turnout.client import Client

AIM_EVENTS_PER_S = 20_000
AIM_P50_MS = 10.0
PROGRAM = """
import json, sys, time
out = sys.stdout
for line in sys.stdin:
    task = json.loads(line)
    if task["mode"] == "flood":
        for i in range(task["n"]):
            out.write('{"event": "text_delta", "delta": "tok%d "}\\n' % i)
        out.flush()
    else:
        for i in range(task["n"]):
            out.write(json.dumps({"event": "text_delta", "delta": "x", "sent": time.time()}) + "\\n")
            out.flush()
            time.sleep(task["gap_s"])
    out.write('{"event": "finish", "status": "completed"}\\n')
    out.flush()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as fh:
        return subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)  # fmt: skip


def _wait(predicate: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, OSError):
            if predicate():
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not come up")


def _cpu_s(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds per role; the worker's figure includes its children (the guard and the program)."""
    out = {"client": time.process_time()}
    for role, pid in pids.items():
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)] if role == "worker" else [proc]
        out[role] = sum(sum(p.cpu_times()[:2]) for p in procs if p.is_running())
    return out


def _throughput(client: Client, n: int, pids: dict[str, int]) -> dict[str, Any]:
    cpu0 = _cpu_s(pids)
    handle = client.submit("bench-events", {"mode": "flood", "n": n})
    first = last = 0.0
    count = 0
    for event in handle.events():
        if event["event"] == "text_delta":
            last = time.perf_counter()
            first = first or last
            count += 1
    cpu1 = _cpu_s(pids)
    per_event = {role: round((cpu1[role] - cpu0[role]) / max(count, 1) * 1e6, 1) for role in cpu0}
    return {"events": count, "seconds": round(last - first, 3), "events_per_s": round(count / max(last - first, 1e-9)),
            "cpu_us_per_event": per_event, "core_per_process_events_per_s": round(1e6 / max(per_event.values()))}  # fmt: skip


def _latency(client: Client, n: int, gap_s: float) -> dict[str, Any]:
    handle = client.submit("bench-events", {"mode": "drip", "n": n, "gap_s": gap_s})
    delays = [(time.time() - e["sent"]) * 1000 for e in handle.events() if e["event"] == "text_delta"]
    delays.sort()
    return {"events": len(delays), "p50_ms": round(statistics.median(delays), 2),
            "p95_ms": round(delays[int(len(delays) * 0.95) - 1], 2), "max_ms": round(delays[-1], 2)}  # fmt: skip


def run(
    quick: bool = False, flood_events: int = 100_000, drip_events: int = 300, gap_s: float = 0.01
) -> dict[str, Any]:
    """Start a controller and a worker, measure, and stop both whatever happens."""
    if quick:
        flood_events, drip_events = 20_000, 100
    tmp = Path(tempfile.mkdtemp(prefix="turnout-bench-events-"))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNOUT_")}
    env.update(TURNOUT_HOME=str(tmp / "home"), TURNOUT_URL=url, PYTHONUNBUFFERED="1")
    (tmp / "program.py").write_text(PROGRAM)
    presets = {"models": {"bench-events": {"inference": {"command": [sys.executable, str(tmp / "program.py")],
                                                         "mode": "session", "timeout_s": 300}}}}  # fmt: skip
    (tmp / "presets.yaml").write_text(json.dumps(presets))
    cli = [sys.executable, "-m", "turnout.cli"]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(_start([*cli, "controller", "--db", f"sqlite:///{tmp / 'turnout.db'}", "--port", str(port),
                             "--home", str(tmp / "home")], env, tmp / "controller.log"))  # fmt: skip
        _wait(lambda: httpx.get(f"{url}/healthz", timeout=1).status_code == 200, "the controller")
        env["TURNOUT_TOKEN"] = (tmp / "home" / "admin.token").read_text().strip()
        procs.append(_start([*cli, "worker", "--presets", str(tmp / "presets.yaml"), "--gpus", "none", "--name", "bench"],
                            env, tmp / "worker.log"))  # fmt: skip
        with Client(url, env["TURNOUT_TOKEN"]) as client:
            _wait(lambda: any(c["name"] == "bench-events" for c in client.capabilities()), "the worker")
            pids = {"controller": procs[0].pid, "worker": procs[1].pid}
            _throughput(client, 1000, pids)  # warm: the session process starts, SQLite pages in
            throughput = _throughput(client, flood_events, pids)
            latency = _latency(client, drip_events, gap_s)
        return {
            "benchmark": "events",
            "host": {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 1)},
            "throughput": {
                **throughput,
                "aim": AIM_EVENTS_PER_S,
                "met": throughput["events_per_s"] >= AIM_EVENTS_PER_S,
            },
            "latency": {
                **latency,
                "gap_s": gap_s,
                "aim_p50_ms": AIM_P50_MS,
                "met": latency["p50_ms"] < AIM_P50_MS,
            },
        }
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def summary(result: dict[str, Any]) -> str:
    t, lat = result["throughput"], result["latency"]
    return (f"  {t['events_per_s']:,} events/s (aim {t['aim']:,}; {t['core_per_process_events_per_s']:,}/s with a core "
            f"per process; CPU us/event {t['cpu_us_per_event']})\n"
            f"  latency p50 {lat['p50_ms']} ms, p95 {lat['p95_ms']} ms (aim p50 < {lat['aim_p50_ms']} ms); "
            f"host load {result['host']['load_avg_1m']} on {result['host']['cpus']} CPUs")  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
