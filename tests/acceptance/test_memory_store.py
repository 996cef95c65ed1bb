"""`turnout up --db memory://`: the whole system on the in-memory store, for tests and demos.

It serves tasks as on SQLite, writes no database file, and keeps nothing across a restart (the README says so).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.conftest import Processes, free_port


def _up(processes: Processes, home: Path, port: int, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`turnout up --db memory://` with no GPU; returns it and its admin token once its worker is healthy."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNOUT_")}
    env.update(TURNOUT_HOME=str(home), PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "turnout.cli", "up", "--db", "memory://", "--gpus", "none", "--port", str(port),
            "--home", str(home)]  # fmt: skip
    proc = processes.start(argv, env, log)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            token = (home / "admin.token").read_text().strip()
            resp = httpx.get(
                f"http://127.0.0.1:{port}/v1/workers", headers={"Authorization": f"Bearer {token}"}
            )
            if any(w["state"] == "healthy" for w in resp.json()["workers"]):
                return proc, token
        except (OSError, httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"turnout up --db memory:// did not serve: {log.read_text()[-3000:]}")


def test_up_on_the_memory_store_serves_tasks_and_keeps_nothing_across_a_restart(
    tmp_path: Path, processes: Processes
) -> None:
    home, port = tmp_path / "home", free_port()
    url = f"http://127.0.0.1:{port}"
    # Given `turnout up --db memory://`
    proc, token = _up(processes, home, port, tmp_path / "up.log")
    auth = {"Authorization": f"Bearer {token}"}
    said = " ".join((tmp_path / "up.log").read_text().split())  # the console wraps long lines
    assert "state in memory: nothing survives a restart" in said
    # When a task is submitted: it runs on the local worker as it would on SQLite
    task = httpx.post(
        f"{url}/v1/tasks", headers=auth, json={"capability": "shout", "input": {"text": "hi"}}
    ).json()
    done = httpx.get(
        f"{url}/v1/tasks/{task['id']}/result", params={"wait": 30}, headers=auth, timeout=60
    ).json()
    assert (done["state"], done["output"]) == ("succeeded", {"text": "HI", "device": "cpu"})
    assert not (home / "turnout.db").exists()
    # When it restarts: the task is gone, and a fresh admin token replaces the old one
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)
    _, fresh = _up(processes, home, port, tmp_path / "up-again.log")
    again = httpx.get(f"{url}/v1/tasks/{task['id']}", headers={"Authorization": f"Bearer {fresh}"})
    assert again.status_code == 404
    assert httpx.get(f"{url}/v1/tasks", headers=auth).status_code == 401
