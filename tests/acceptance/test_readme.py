"""The README's tour runs as written: its ```sh blocks, in order, in one bash, against a real `turnout up`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.conftest import REPO, Processes, free_port


def sh_blocks(readme: str) -> list[str]:
    return re.findall(r"^```sh\n(.*?)^```", readme, flags=re.S | re.M)


def test_readme_opens_with_the_two_commands() -> None:
    head = "\n".join((REPO / "README.md").read_text().splitlines()[:10])
    assert "make run" in head and "make test" in head


def test_readme_tour_runs(tmp_path: Path, processes: Processes) -> None:
    blocks = sh_blocks((REPO / "README.md").read_text())
    assert len(blocks) >= 3
    port = free_port()
    home = tmp_path / "home"
    bindir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNOUT_")}
    env.update(TURNOUT_HOME=str(home), TURNOUT_URL=f"http://127.0.0.1:{port}", PATH=f"{bindir}:{env.get('PATH', '')}",
               PYTHONUNBUFFERED="1")  # fmt: skip
    # `make run` in terminal 1, on a free port and a fresh home
    processes.start([sys.executable, "-m", "turnout.cli", "up", "--gpus", "none", "--port", str(port), "--home", str(home)],
                    env, tmp_path / "up.log")  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            token = (home / "admin.token").read_text().strip()
            workers = httpx.get(
                f"http://127.0.0.1:{port}/v1/workers", headers={"Authorization": f"Bearer {token}"}
            ).json()
            if any(w["state"] == "healthy" for w in workers["workers"]):
                break
        except (OSError, httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.2)
    script = "set -euo pipefail\n" + "\n".join(blocks)
    proc = processes.start(["bash", "-c", script], env, tmp_path / "tour.log")
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        code = None
    log = (tmp_path / "tour.log").read_text()
    assert code == 0, (
        f"README tour failed (exit {code}):\n{log[-4000:]}\n--- up.log:\n{(tmp_path / 'up.log').read_text()[-2000:]}"
    )
    assert '"reason": "no healthy gpu worker"' in log
