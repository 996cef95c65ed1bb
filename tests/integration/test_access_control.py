"""`turnout controller --no-auth`, started for real: without tokens the API docs are open.

Every route x role x tenant, and each escalation a hostile tenant might try, runs in-process against the same
app (tests/inprocess/test_access_control.py): access is decided in the routes, so those need no process.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Processes, free_port


@pytest.fixture
def no_auth_controller(tmp_path: Path, processes: Processes) -> Iterator[str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNOUT_")}
    proc = processes.start([sys.executable, "-m", "turnout.cli", "controller", "--no-auth", "--port", str(port),
                            "--home", str(tmp_path / "home"), "--db", f"sqlite:///{tmp_path / 'db.sqlite'}"],
                           env, tmp_path / "controller.log")  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                break
        time.sleep(0.05)
    yield url  # the `processes` fixture stops it, also when the test fails


def test_without_auth_the_docs_are_open(no_auth_controller: str) -> None:
    assert httpx.get(f"{no_auth_controller}/openapi.json", timeout=10).status_code == 200
    assert httpx.get(f"{no_auth_controller}/docs", timeout=10).status_code == 200
