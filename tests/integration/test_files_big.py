"""A 200 MiB file through a task and back: uploaded, fetched by the worker, copied by the handler, uploaded
as its output, downloaded again; its sha256 checked at the end, and the controller's and the worker's
memory sampled all the while (RSS growth under 50 MiB: the bytes stream, they are never held)."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import psutil
import pytest

from tests.conftest import Cluster
from turnout.client import Client

MiB = 1024 * 1024
SIZE = 200 * MiB
RSS_GROWTH_LIMIT = 50 * MiB


class PeakRss:
    """The highest RSS each process reached while sampled (every 20 ms on a thread), above its baseline."""

    def __init__(self, procs: dict[str, psutil.Process]) -> None:
        self.procs = procs
        self.baseline = {name: p.memory_info().rss for name, p in procs.items()}
        self.peak = dict(self.baseline)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            for name, p in self.procs.items():
                self.peak[name] = max(self.peak[name], p.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def growth(self) -> dict[str, int]:
        return {name: self.peak[name] - self.baseline[name] for name in self.procs}


@pytest.mark.slow
def test_a_200_mib_file_round_trips_through_a_task_with_its_sha256_and_flat_memory(
    cluster: Cluster, tmp_path: Path
) -> None:
    # Given a worker serving the copy handler, and a 200 MiB file of random bytes
    worker = cluster.start_worker("tests.apps.files_app:app", name="big")
    src = tmp_path / "big.bin"
    digest = hashlib.sha256()
    with open(src, "wb") as fh:
        for _ in range(SIZE // MiB):
            chunk = os.urandom(MiB)
            digest.update(chunk)
            fh.write(chunk)
    assert cluster.controller is not None
    procs = {"controller": psutil.Process(cluster.controller.pid), "worker": psutil.Process(worker.pid)}
    with Client(cluster.url, cluster.token) as client:
        # (one small round trip first, so what either process loads once is in its baseline)
        small = tmp_path / "small.bin"
        small.write_bytes(b"warm")
        warm = client.submit("copy", {"file": {"$file": client.upload(small)["id"]}}).result(timeout=60)
        assert warm["state"] == "succeeded", warm["error"]

        # When it is uploaded, copied by a task into its output directory, and the copy downloaded
        with PeakRss(procs) as rss:
            uploaded = client.upload(src)
            task = client.submit("copy", {"file": {"$file": uploaded["id"]}, "as": "copy.bin"}).result(
                timeout=100
            )
            assert task["state"] == "succeeded", task["error"]
            back = client.download(task["output"]["files"]["copy.bin"]["$file"], tmp_path / "back.bin")

    # Then every hop kept the bytes, and neither process grew by more than 50 MiB
    assert uploaded["sha256"] == back["sha256"] == digest.hexdigest()
    assert back["size"] == SIZE
    growth = rss.growth()
    print(f"RSS growth during a 200 MiB round trip: controller {growth['controller'] / MiB:.1f} MiB, "
          f"worker {growth['worker'] / MiB:.1f} MiB")  # fmt: skip
    assert all(g < RSS_GROWTH_LIMIT for g in growth.values()), growth
