"""Files against a hostile or unlucky client, over real HTTP: request bodies the parser refuses, records
raced for, ids with a newline, expired files, and the storage sweep beside a long task's output directory."""

from __future__ import annotations

import concurrent.futures
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Cluster, Processes
from tests.inprocess.conftest import serve_api
from turnout.blobs import new_file_id
from turnout.config import ControllerSettings

TWO_DAYS_S = 2 * 86_400.0


def _headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _until(check: Any, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        time.sleep(0.05)
    return value


def test_a_multipart_boundary_over_the_parsers_limit_is_a_422_naming_content_type(cluster: Cluster) -> None:
    boundary = "b" * 300  # python-multipart takes 256 at most
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\"\r\n\r\nhello\r\n"
            f"--{boundary}--\r\n").encode()  # fmt: skip
    resp = httpx.post(f"{cluster.url}/v1/files", content=body, timeout=60,
                      headers={**_headers(cluster.token), "Content-Type": f"multipart/form-data; boundary={boundary}"})  # fmt: skip
    assert (resp.status_code, resp.json()["error"]["field"]) == (422, "Content-Type"), resp.text
    assert "256" in resp.json()["error"]["message"]
    assert list((cluster.tmp / "home" / "files" / "tmp").iterdir()) == []  # nothing of it kept


def test_one_shared_file_recorded_by_many_at_once_is_recorded_once_and_the_rest_are_told_why(
    cluster: Cluster,
) -> None:
    # Given bytes written into the storage's objects/ directly, as a worker on a shared mount writes them
    file_id = new_file_id()
    (cluster.tmp / "home" / "files" / "objects" / file_id).write_bytes(os.urandom(32 * 1024 * 1024))
    other = cluster.api("POST", "/v1/tokens", json={"role": "submit", "tenant": "acme"}).json()["token"]

    # When eight requests record it at once, half of them another tenant's
    def record(i: int) -> httpx.Response:
        token = cluster.token if i % 2 else other
        return httpx.post(f"{cluster.url}/v1/files/shared", json={"id": file_id}, headers=_headers(token),
                          timeout=60)  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(record, range(8)))
    # Then one is recorded, and every other request is a clear 409 (that tenant's) or 422 (not there for
    # another tenant), never a 500
    codes = sorted(r.status_code for r in answers)
    assert codes.count(201) == 1 and set(codes) <= {201, 409, 422}, [r.text for r in answers]
    owner = next(r for r in answers if r.status_code == 201)
    for r in answers:
        if r.status_code != 201:
            assert r.json()["error"]["field"] == "id", r.text
    assert cluster.api("GET", f"/v1/files/{file_id}").status_code in (200, 404)  # the owner's, whichever won
    assert owner.json()["size"] == 32 * 1024 * 1024


def test_a_file_id_with_a_trailing_newline_is_not_a_file_id(cluster: Cluster) -> None:
    resp = cluster.api("POST", "/v1/files/shared", json={"id": new_file_id() + "\n"})
    assert (resp.status_code, resp.json()["error"]["field"]) == (422, "id")
    assert "is not a file id" in resp.json()["error"]["message"]


@pytest.mark.anyio
async def test_an_expired_file_is_gone_before_the_sweep_deletes_it(tmp_path: Path) -> None:
    # Given a file kept 1000 s, on a controller whose clock the test moves (its sweep waits a minute)
    settings = ControllerSettings(heartbeat_s=1.0, storage_dir=tmp_path / "files", file_retention_s=1000)
    async with serve_api(settings) as api:
        made = await api.client.post("/v1/files", content=b"brief",
                                     headers={"Content-Type": "application/octet-stream"})  # fmt: skip
        assert made.status_code == 201, made.text
        file_id = made.json()["id"]
        assert (await api.client.get(f"/v1/files/{file_id}")).content == b"brief"
        # When its time is up, before any sweep round
        api.clock.advance(1001)
        # Then it answers as no file at all, and no task may name it
        gone = await api.client.get(f"/v1/files/{file_id}")
        assert (gone.status_code, gone.json()["error"]["field"]) == (404, "id")
        await api.worker()
        named = await api.client.post("/v1/tasks", json={"capability": "shout", "input": {"doc": {"$file": file_id}}})  # fmt: skip
        assert (named.status_code, named.json()["error"]["field"]) == (422, "input.doc"), named.text


def test_the_storage_sweep_keeps_an_old_output_directory_whose_task_still_writes_in_it(
    tmp_path: Path, processes: Processes
) -> None:
    # Given a controller sweeping its storage's tmp/ every half second
    config = tmp_path / "turnout.yaml"
    config.write_text("file_retention_s: 2\n")
    cluster = Cluster(tmp_path, processes, f"sqlite:///{tmp_path / 'turnout.db'}",
                      extra_args=["--config", str(config)])  # fmt: skip
    cluster.start_controller()
    tmp = tmp_path / "home" / "files" / "tmp"
    # and a long task's output directory there, made two days ago, whose checkpoint written now sits in a
    # subdirectory (neither directory's own mtime moves when a file in ckpt/ is written)
    live = tmp / "out-live"
    (live / "ckpt").mkdir(parents=True)
    (live / "ckpt" / "model.bin").write_bytes(b"epoch 900")
    old = time.time() - TWO_DAYS_S
    for d in (live / "ckpt", live):
        os.utime(d, (old, old))
    # When the sweep has run over it: two rounds, each seen removing an upload left two days ago
    for name in ("up-stale-1", "up-stale-2"):
        stale = tmp / name
        stale.write_bytes(b"cut off")
        os.utime(stale, (old, old))
        _until(lambda stale=stale: not stale.exists())
    # Then the running task's directory and its checkpoint are still there
    assert (live / "ckpt" / "model.bin").read_bytes() == b"epoch 900"
    # while one whose every entry is two days old goes
    os.utime(live / "ckpt" / "model.bin", (old, old))
    for d in (live / "ckpt", live):
        os.utime(d, (old, old))
    _until(lambda: not live.exists())


def test_a_link_or_fifo_put_in_the_storage_is_never_served_nor_recorded(cluster: Cluster) -> None:
    # Given a tenant that can write into the storage (its worker on the shared mount, or that worker's handler)
    objects = cluster.tmp / "home" / "files" / "objects"
    secret = cluster.tmp / "home" / "admin.token"
    acme = _headers(
        cluster.api("POST", "/v1/tokens", json={"role": "submit", "tenant": "acme"}).json()["token"]
    )
    link, fifo = new_file_id(), new_file_id()
    (objects / link).symlink_to(secret)
    os.mkfifo(objects / fifo)
    # When it records them as its files
    for file_id in (link, fifo):
        resp = httpx.post(f"{cluster.url}/v1/files/shared", json={"id": file_id}, headers=acme, timeout=30)
        # Then neither is a file: no record, no read of what the link names, no read that never ends
        assert (resp.status_code, resp.json()["error"]["field"]) == (422, "id"), resp.text
        assert httpx.get(f"{cluster.url}/v1/files/{file_id}", headers=acme, timeout=30).status_code == 404
    # and a file it recorded whose bytes it then swaps for a link answers 404, not the linked file
    mine = httpx.post(f"{cluster.url}/v1/files", content=b"mine", timeout=30,
                      headers={**acme, "Content-Type": "application/octet-stream"}).json()["id"]  # fmt: skip
    (objects / mine).unlink()
    (objects / mine).symlink_to(secret)
    swapped = httpx.get(f"{cluster.url}/v1/files/{mine}", headers=acme, timeout=30)
    assert swapped.status_code == 404 and cluster.token not in swapped.text
