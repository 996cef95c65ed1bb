"""File transfer over loopback: Turnout's own client (the SDK, which the CLI and workers share) against curl,
on the same file, to and from the same controller.

A controller on a fresh SQLite file in a temporary directory; a file of random bytes (200 MiB; 50 MiB with
--quick). Each direction is timed five times per client, the two clients one after the other and which goes
first alternating, the disk synced before each (so one step's writeback never lands in the next), best taken (the least disturbed by the rest of the machine): upload (`POST /v1/files`, raw bytes; curl `-T FILE -X POST`) and download (`GET
/v1/files/{id}` to a file; curl `-o FILE`). Both sides write to and read from the same disk, so the figures
include its speed; the ratio turnout/curl is what the SDK costs over a plain HTTP client.

Aim: Turnout at least half of curl's MiB/s in each direction.

    python -m bench --only files [--quick]
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Processes, TurnoutCluster
from turnout.client import Client

NAME = "files"
MiB = 1024 * 1024
RUNS = 5


def _random_file(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "wb") as fh:
        for _ in range(size // MiB):
            chunk = os.urandom(MiB)
            digest.update(chunk)
            fh.write(chunk)
    return digest.hexdigest()


def _best_mib_s(size: int, timings: list[float]) -> float:
    return round(size / MiB / min(timings), 1)


def _curl(*args: str) -> None:
    subprocess.run(["curl", "-sS", "--fail", "-H", "Expect:", *args], check=True, stdout=subprocess.DEVNULL,
                   timeout=600)  # fmt: skip


def run(quick: bool = False) -> dict[str, Any]:
    size = (50 if quick else 200) * MiB
    if shutil.which("curl") is None:
        return {"skipped": "curl is not installed"}
    procs = Processes()
    tmp = Path(tempfile.mkdtemp(prefix="turnout-bench-files-"))
    try:
        cluster = TurnoutCluster(tmp, procs)
        cluster.start_controller()
        src = tmp / "src.bin"
        sha = _random_file(src, size)
        auth = f"Authorization: Bearer {cluster.token}"
        times: dict[str, list[float]] = {
            k: [] for k in ("turnout_up", "curl_up", "turnout_down", "curl_down")
        }
        with Client(cluster.url, cluster.token) as client:
            file_id = client.upload(src)["id"]
            down = tmp / "down.bin"

            def turnout_up(i: int) -> None:
                assert client.upload(src)["sha256"] == sha

            def curl_up(i: int) -> None:
                _curl("-H", auth, "-H", "Content-Type: application/octet-stream", "-T", str(src), "-X", "POST",
                      f"{cluster.url}/v1/files?name=curl{i}")  # fmt: skip

            def turnout_down(i: int) -> None:
                assert client.download(file_id, down)["sha256"] == sha

            def curl_down(i: int) -> None:
                _curl("-H", auth, "-o", str(down), f"{cluster.url}/v1/files/{file_id}")

            for i in range(RUNS):
                # each pair side by side, who goes first alternating: a burst of load elsewhere on the
                # machine falls on either side alike
                pairs = ((turnout_up, curl_up), (turnout_down, curl_down))
                for pair in pairs:
                    for step in pair if i % 2 == 0 else reversed(pair):
                        os.sync()  # the step before's dirty pages reach the disk first, not during this one
                        t0 = time.perf_counter()
                        step(i)
                        times[step.__name__].append(time.perf_counter() - t0)
                        down.unlink(missing_ok=True)
        mib_s = {k: _best_mib_s(size, v) for k, v in times.items()}
        ratios = {"upload": round(mib_s["turnout_up"] / mib_s["curl_up"], 2),
                  "download": round(mib_s["turnout_down"] / mib_s["curl_down"], 2)}  # fmt: skip
        medians = {k: round(size / MiB / statistics.median(v), 1) for k, v in times.items()}
        return {"size_mib": size // MiB, "runs": RUNS, "mib_per_s": mib_s, "ratio_turnout_over_curl": ratios,
                "median_mib_per_s": medians,
                "aim_at_least_half": {k: v >= 0.5 for k, v in ratios.items()},
                "timings_s": {k: [round(t, 3) for t in v] for k, v in times.items()}}  # fmt: skip
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


def summary(result: dict[str, Any]) -> str:
    if "skipped" in result:
        return f"  skipped: {result['skipped']}"
    m, r = result["mib_per_s"], result["ratio_turnout_over_curl"]
    return (f"  {result['size_mib']} MiB over loopback, best of {result['runs']}:\n"
            f"  upload   turnout {m['turnout_up']:>7.1f} MiB/s   curl {m['curl_up']:>7.1f} MiB/s   ({r['upload']}x)\n"
            f"  download turnout {m['turnout_down']:>7.1f} MiB/s   curl {m['curl_down']:>7.1f} MiB/s   ({r['download']}x)\n"
            f"  aim >= 0.5x: {result['aim_at_least_half']}")  # fmt: skip
