"""What every bench that starts real processes needs: process groups that always die, a Turnout cluster on
loopback, percentiles.

The cluster mirrors `tests/conftest.py` (a controller and `turnout worker` subprocesses on a fresh SQLite
file, or on a database URL, the admin token read from `$TURNOUT_HOME/admin.token`), but benches cannot
import from `tests/`. Controller replicas on one PostgreSQL database are clusters that share `db` and
`home` (so they share one admin token), each with its own port.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"


def exit_on_sigterm() -> None:
    """A bench stopped by SIGTERM (`timeout`, a CI runner) unwinds like one stopped by Ctrl-C: its `finally`
    blocks stop the controllers and workers it started, instead of leaving them polling after it."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_run(path: str, what: str, task_id: str) -> None:
    """Append `what task_id pid epoch_s` to a run log (O_APPEND: one short line is written atomically)."""
    with open(path, "a") as fh:
        fh.write(f"{what} {task_id} {os.getpid()} {time.time():.6f}\n")


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sample."""
    ordered = sorted(samples)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


SECOND_SIGNAL_AFTER_S = 1.0  # a process still up this long after the first SIGTERM gets a second


@dataclass
class Processes:
    """Subprocesses started in their own sessions; `stop_all` kills each whole process group."""

    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("ab") as fh:
            proc = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, cwd=str(REPO))  # fmt: skip
        self.procs.append(proc)
        return proc

    def stop_all(self, grace_s: float = 5.0) -> None:
        """SIGTERM each; a second SIGTERM to those still up a moment later (a draining worker stops its tasks
        at the second); SIGKILL to each whole group once `grace_s` is out."""
        deadline = time.monotonic() + grace_s
        self._terminate()
        self._wait_until(min(deadline, time.monotonic() + SECOND_SIGNAL_AFTER_S))
        self._terminate()
        self._wait_until(deadline)
        for proc in self.procs:  # the group may outlive its leader (handler processes), so always SIGKILL it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self.procs.clear()

    def _terminate(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGTERM)

    def _wait_until(self, deadline: float) -> None:
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.01, deadline - time.monotonic()))


def log_tail(path: Path, chars: int = 3000) -> str:
    """The end of a process's log file ("" if it never wrote one)."""
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def start_serving(
    start: Callable[[int], subprocess.Popen[bytes]],
    port: int,
    log: Path,
    *,
    may_move: bool,
    timeout_s: float = 30,
    base: str = "http://127.0.0.1",
    verify: ssl.SSLContext | bool = True,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start a controller with `start(port)` and wait until it serves there; returns it and its port.

    A port picked by `free_port` may be taken by another process before the controller binds it. Where the
    controller may move (`may_move`: a first start, before any worker knows its address) it starts again on a
    fresh port; and a healthz answered by whatever holds the port is never taken for this controller's.
    `base` is the scheme and host healthz is asked at (`https://10.0.0.1` for one serving TLS in a namespace),
    `verify` what httpx checks its certificate with."""
    taken = port
    for _ in range(3 if may_move else 1):
        # the log is appended to across restarts: this start's lines are those after `written`
        written = log.stat().st_size if log.exists() else 0
        proc = start(port)
        if _serving(proc, f"{base}:{port}", port, log, timeout_s, written, verify):
            return proc, port
        taken, port = port, free_port()
    raise RuntimeError(f"port {taken} is taken: {log_tail(log)}")


def _serving(
    proc: subprocess.Popen[bytes],
    url: str,
    port: int,
    log: Path,
    timeout_s: float,
    written: int,
    verify: ssl.SSLContext | bool,
) -> bool:
    """True once `proc` listens on `port` and answers healthz at `url`; False if it exited because the port was taken
    (as its own lines in `log`, from offset `written`, say); raises if it exited for any other reason or never
    came up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with log.open("rb") as fh:
                fh.seek(written)
                if b"address already in use" in fh.read().lower():
                    return False
            raise RuntimeError(f"controller exited: {log_tail(log)}")
        with contextlib.suppress(httpx.HTTPError, psutil.Error):
            if httpx.get(f"{url}/healthz", timeout=1, verify=verify).status_code == 200 and any(
                c.status == psutil.CONN_LISTEN and c.laddr.port == port
                for c in psutil.Process(proc.pid).net_connections("tcp")
            ):
                return True
        time.sleep(0.05)
    raise RuntimeError(f"controller did not come up: {log_tail(log)}")


@dataclass
class TurnoutCluster:
    """A controller on a fresh SQLite file in `tmp` (or on `db`), and `turnout worker` processes added to it."""

    tmp: Path
    procs: Processes
    port: int = field(default_factory=free_port)
    heartbeat_s: float = 5.0
    token: str = ""
    controller: subprocess.Popen[bytes] | None = None
    workers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    controller_args: list[str] = field(default_factory=list)  # e.g. ["--config", "turnout.yaml"]
    db: str = ""  # a database URL; "" is a fresh SQLite file in `tmp`
    home: Path | None = None  # $TURNOUT_HOME; None is `tmp/home`

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def home_dir(self) -> Path:
        return self.home or self.tmp / "home"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TURNOUT_")}
        env.update(TURNOUT_HOME=str(self.home_dir), TURNOUT_URL=self.url, PYTHONUNBUFFERED="1")
        if self.token:
            env["TURNOUT_TOKEN"] = self.token
        return env

    def start_controller(self, timeout_s: float = 30) -> None:
        db = self.db or f"sqlite:///{self.tmp / 'turnout.db'}"

        def start(port: int) -> subprocess.Popen[bytes]:
            self.port = port
            argv = [sys.executable, "-m", "turnout.cli", "controller", "--db", db, "--port", str(port),
                    "--home", str(self.home_dir), "--heartbeat-s", str(self.heartbeat_s), *self.controller_args]  # fmt: skip
            return self.procs.start(argv, self.env, self.tmp / "controller.log")

        first_start = self.controller is None
        self.controller, self.port = start_serving(start, self.port, self.tmp / "controller.log",
                                                   may_move=first_start, timeout_s=timeout_s)  # fmt: skip
        self.token = (self.home_dir / "admin.token").read_text().strip()

    def start_worker(
        self, app: str, name: str, timeout_s: float = 30, extra: list[str] | None = None
    ) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "turnout.cli", "worker", app, "--controller", self.url, "--gpus", "none",
                "--name", name, "--heartbeat-s", str(self.heartbeat_s), *(extra or [])]  # fmt: skip
        proc = self.procs.start(argv, self.env, self.tmp / f"worker-{name}.log")
        self.workers[name] = proc
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"worker {name} exited: {self.log_tail(f'worker-{name}')}")
            body = httpx.get(f"{self.url}/v1/workers", headers=self.headers, timeout=5).json()
            if any(w["name"] == name and w["state"] == "healthy" for w in body["workers"]):
                return proc
            time.sleep(0.05)
        raise RuntimeError(f"worker {name} did not register: {self.log_tail(f'worker-{name}')}")

    def log_tail(self, name: str, chars: int = 3000) -> str:
        return log_tail(self.tmp / f"{name}.log", chars)

    def pids(self) -> dict[str, int]:
        """The controller's and workers' pids, by role (`controller`, `worker-NAME`)."""
        out = {f"worker-{n}": p.pid for n, p in self.workers.items()}
        if self.controller is not None:
            out["controller"] = self.controller.pid
        return out
