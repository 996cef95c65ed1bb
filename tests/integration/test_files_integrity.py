"""A download keeps a file only when every byte that arrived hashes to the sha256 recorded at upload.

Bytes changed on the controller's disk (same size, same mtime: what bit rot looks like) are refused by the
SDK on both of its paths, by the CLI and by a worker fetching a task's input; a transfer cut short or
cancelled leaves nothing behind, not even its `.part` file."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Cluster, free_port
from turnout.client import AsyncClient
from turnout.errors import Unavailable
from turnout.files import FileCorrupt, download

APP = "tests.apps.files_app:app"


def _rot_one_byte(path: Path) -> None:
    """Flip one byte in the middle of `path`, keeping its size and its mtime."""
    stat = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(stat.st_size // 2)
        byte = fh.read(1)
        fh.seek(stat.st_size // 2)
        fh.write(bytes([byte[0] ^ 0x01]))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_bytes_changed_on_the_controllers_disk_are_never_taken_as_the_file(
    cluster: Cluster, tmp_path: Path
) -> None:
    # Given a file uploaded, whose stored bytes then change on the controller's disk (size and mtime kept)
    data = os.urandom(3 * 1024 * 1024 + 11)
    resp = cluster.api(
        "POST", "/v1/files", content=data, headers={"Content-Type": "application/octet-stream"}
    )
    file_id = resp.json()["id"]
    _rot_one_byte(cluster.tmp / "home" / "files" / "objects" / file_id)

    async def both_paths() -> list[BaseException | None]:
        errors: list[BaseException | None] = []
        async with AsyncClient(cluster.url, cluster.token) as sdk:  # the direct connection
            try:
                await sdk.download(file_id, tmp_path / "direct.bin")
                errors.append(None)
            except FileCorrupt as exc:
                errors.append(exc)
        headers = {"Authorization": f"Bearer {cluster.token}"}
        async with httpx.AsyncClient(base_url=cluster.url, headers=headers) as plain:  # httpx's stream
            try:
                await download(plain, file_id, tmp_path / "httpx.bin")
                errors.append(None)
            except FileCorrupt as exc:
                errors.append(exc)
        return errors

    # When the SDK downloads it, on its direct path and through httpx
    errors = asyncio.run(both_paths())

    # Then both refuse it naming the sha256, and keep nothing, not even a part file
    assert all(isinstance(e, FileCorrupt) and e.field == "sha256" for e in errors), errors
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".bin", ".part")) == []

    # And the CLI refuses it with a message, not a traceback, and leaves no file
    got = cluster.cli("file", "get", file_id, "-o", str(tmp_path / "cli.bin"))
    assert got.returncode != 0 and "sha256" in got.stderr and "Traceback" not in got.stderr, got.stderr
    assert not (tmp_path / "cli.bin").exists() and not (tmp_path / "cli.bin.part").exists()

    # And a task that names it fails before its handler runs, naming the field
    cluster.start_worker(APP, name="reader")
    task = cluster.result(cluster.submit("digest", {"file": {"$file": file_id}})["id"], wait=60)
    assert task["state"] == "failed", task
    assert task["error"]["type"] == "input_file_unavailable" and task["error"]["field"] == "input.file"
    assert "sha256" in task["error"]["message"]


class _HalfServer:
    """An HTTP server on loopback that answers every GET with a 200 for `length` bytes, sends `sent` of them,
    then either closes the connection or holds it open without sending more (`hold`)."""

    def __init__(self, length: int, sent: int, *, hold: bool) -> None:
        self.length, self.sent, self.hold = length, sent, hold
        self.port = free_port()
        self.listener = socket.create_server(("127.0.0.1", self.port))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            conn, _ = self.listener.accept()
            with conn:
                while b"\r\n\r\n" not in conn.recv(65536):
                    pass
                sha = hashlib.sha256(b"\0" * self.length).hexdigest()
                conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {self.length}\r\n"
                             f"x-turnout-sha256: {sha}\r\n\r\n".encode() + b"\0" * self.sent)  # fmt: skip
                if self.hold:
                    self.stop.wait(30)

    def __enter__(self) -> _HalfServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.listener.close()
        self.thread.join(timeout=10)


@pytest.fixture
def dest(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "got.bin"


def test_a_download_cut_short_raises_and_leaves_no_part_file(dest: Path) -> None:
    # Given a server that promises 8 MiB and closes after 3 MiB
    with _HalfServer(8 * 1024 * 1024, 3 * 1024 * 1024, hold=False) as server:

        async def fetch() -> None:
            async with AsyncClient(f"http://127.0.0.1:{server.port}", "t") as sdk:
                await sdk.download("f_0", dest)

        # When the SDK downloads from it, Then it raises, keeping neither the file nor its part
        with pytest.raises(httpx.RemoteProtocolError, match="still to come"):
            asyncio.run(fetch())
    assert not dest.exists() and not dest.with_name(dest.name + ".part").exists()


def test_a_cancelled_download_stops_at_once_and_leaves_no_part_file(dest: Path) -> None:
    # Given a server that sends 1 MiB of a promised 8 MiB and then holds the connection open
    with _HalfServer(8 * 1024 * 1024, 1024 * 1024, hold=True) as server:

        async def fetch_then_cancel() -> None:
            async with AsyncClient(f"http://127.0.0.1:{server.port}", "t") as sdk:
                task = asyncio.ensure_future(sdk.download("f_0", dest))
                part = dest.with_name(dest.name + ".part")
                for _ in range(500):  # until the answer's body is arriving
                    if part.exists():
                        break
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.2)
                # When the caller cancels it mid-transfer
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.wait_for(task, 10)  # long before the 60 s read timeout

        asyncio.run(fetch_then_cancel())
    # Then nothing of it is left
    assert not dest.exists() and not dest.with_name(dest.name + ".part").exists()


def test_a_download_from_a_controller_that_is_not_there_is_unavailable(dest: Path) -> None:
    async def fetch() -> None:
        async with AsyncClient(f"http://127.0.0.1:{free_port()}", "t") as sdk:
            await sdk.download("f_0", dest)

    with pytest.raises(Unavailable, match="cannot reach"):
        asyncio.run(fetch())
    assert not dest.exists()
