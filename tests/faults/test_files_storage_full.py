"""A file storage that fills up mid-upload: 503 `storage_unavailable`, nothing half-kept, and room for the
next file once there is room. The storage is a small tmpfs mounted for the test (skipped, with the reason,
where this host does not permit `mount`)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Cluster, Processes

MiB = 1024 * 1024


@pytest.fixture
def cluster_on_small_storage(tmp_path: Path) -> Iterator[tuple[Cluster, Path]]:
    storage = tmp_path / "storage"
    storage.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs", str(storage)],
                                 capture_output=True, text=True)  # fmt: skip
        problem = (
            (mounted.stderr.strip() or f"mount exited {mounted.returncode}") if mounted.returncode else ""
        )
    except FileNotFoundError:
        problem = "no mount command"
    if problem:
        pytest.skip(f"cannot mount a tmpfs for the file storage here: {problem}")
    procs = Processes()
    try:
        cluster = Cluster(
            tmp_path, procs, f"sqlite:///{tmp_path / 'turnout.db'}", extra_args=["--storage", str(storage)]
        )
        cluster.start_controller()
        yield cluster, storage
    finally:
        procs.stop_all()
        if subprocess.run(["umount", str(storage)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(storage)], capture_output=True)


def test_an_upload_that_fills_the_storage_is_503_and_leaves_nothing_behind(
    cluster_on_small_storage: tuple[Cluster, Path],
) -> None:
    cluster, storage = cluster_on_small_storage
    headers = {"Authorization": f"Bearer {cluster.token}", "Content-Type": "application/octet-stream"}
    # When a file larger than the storage's room is uploaded
    resp = httpx.post(f"{cluster.url}/v1/files", content=os.urandom(24 * MiB), headers=headers, timeout=60)
    # Then it is refused as unavailable (retry later), with no driver text, and nothing of it is kept
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["type"] == "storage_unavailable" and int(resp.headers["Retry-After"]) >= 1
    assert list((storage / "tmp").iterdir()) == [] and list((storage / "objects").iterdir()) == []
    # and a file that fits goes in at once
    small = httpx.post(f"{cluster.url}/v1/files", content=b"fits", headers=headers, timeout=60)
    assert small.status_code == 201, small.text
    assert (storage / "objects" / small.json()["id"]).read_bytes() == b"fits"
