"""`turnout controller --no-auth`, started for real: without tokens the API docs are open.

Every route x role x tenant, and each escalation a hostile tenant might try, runs in-process against the same
app (tests/inprocess/test_access_control.py): access is decided in the routes, so those need no process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.common import Processes, free_port, start_serving


@pytest.fixture
def no_auth_controller(tmp_path: Path, processes: Processes) -> Iterator[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNOUT_")}

    def start(port: int) -> subprocess.Popen[bytes]:
        return processes.start([sys.executable, "-m", "turnout.cli", "controller", "--no-auth", "--port", str(port),
                                "--home", str(tmp_path / "home"), "--db", f"sqlite:///{tmp_path / 'db.sqlite'}"],
                               env, tmp_path / "controller.log")  # fmt: skip

    _, port = start_serving(start, free_port(), tmp_path / "controller.log", may_move=True)
    url = f"http://127.0.0.1:{port}"
    yield url  # the `processes` fixture stops it, also when the test fails


def test_without_auth_the_docs_are_open(no_auth_controller: str) -> None:
    assert httpx.get(f"{no_auth_controller}/openapi.json", timeout=10).status_code == 200
    assert httpx.get(f"{no_auth_controller}/docs", timeout=10).status_code == 200
