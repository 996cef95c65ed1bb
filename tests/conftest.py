"""Fixtures that start the real thing: a controller and workers as subprocesses on loopback.

Every process a test starts is registered with `Processes`, which kills its whole process group at
teardown, also when the test fails. pytest-timeout bounds every test, so nothing hangs CI.
"""

from __future__ import annotations

import contextlib
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

# Processes: every process a test starts, stopped with its group at teardown
from bench.common import Processes, free_port, start_serving

REPO = Path(__file__).resolve().parents[1]
SHARED = (REPO / ".." / "shared").resolve()


@dataclass
class Cluster:
    """A controller on a real SQLite file (or PostgreSQL), and a way to add workers to it."""

    tmp: Path
    procs: Processes
    db: str
    port: int = field(default_factory=free_port)
    token: str = ""
    controller: subprocess.Popen[bytes] | None = None
    heartbeat_s: float = (
        1.0  # fast enough to see a lost worker quickly, slow enough not to miss one under load
    )
    extra_args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TURNOUT_")}
        env.update(TURNOUT_HOME=str(self.tmp / "home"), TURNOUT_URL=self.url, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)]))  # this checkout's code  # fmt: skip
        if self.token:
            env["TURNOUT_TOKEN"] = self.token
        return env

    def controller_argv(self, port: int) -> list[str]:
        return [sys.executable, "-m", "turnout.cli", "controller", "--db", self.db, "--port", str(port),
                "--home", str(self.tmp / "home"), "--heartbeat-s", str(self.heartbeat_s), *self.extra_args]  # fmt: skip

    def healthz_at(self) -> tuple[str, ssl.SSLContext | bool]:
        """The scheme and host the controller's healthz is asked at, and what verifies its certificate."""
        return "http://127.0.0.1", True

    def start_controller(self) -> None:
        """Start the controller and wait until it serves; a first start moves to a fresh port if another
        process took the one picked (a restart keeps its port, which its workers know)."""

        def start(port: int) -> subprocess.Popen[bytes]:
            self.port = port  # before the environment is made: TURNOUT_URL names it
            return self.procs.start(self.controller_argv(port), self.env, self.tmp / "controller.log")

        base, verify = self.healthz_at()
        self.controller, self.port = start_serving(start, self.port, self.tmp / "controller.log",
                                                   may_move=self.controller is None, base=base, verify=verify)  # fmt: skip
        self.token = (self.tmp / "home" / "admin.token").read_text().strip()

    def kill_controller(self) -> None:
        assert self.controller is not None
        os.killpg(self.controller.pid, signal.SIGKILL)
        self.controller.wait(timeout=10)

    def start_worker(self, *apps: str, gpus: str = "none", name: str = "w", extra: list[str] | None = None,
                     wait: bool = True, heartbeat_s: float | None = None) -> subprocess.Popen[bytes]:  # fmt: skip
        beat = heartbeat_s or self.heartbeat_s
        argv = [sys.executable, "-m", "turnout.cli", "worker", *apps, "--controller", self.url, "--gpus", gpus,
                "--name", name, "--heartbeat-s", str(beat), *(extra or [])]  # fmt: skip
        proc = self.procs.start(argv, self.env, self.tmp / f"worker-{name}.log")
        if wait:
            self.wait_for_worker(name)
        return proc

    def wait_for_worker(self, name: str, timeout_s: float = 30) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for w in self.api("GET", "/v1/workers").json()["workers"]:
                if w["name"] == name and w["state"] == "healthy":
                    return w
            time.sleep(0.05)
        logs = (
            (self.tmp / f"worker-{name}.log").read_text()
            if (self.tmp / f"worker-{name}.log").exists()
            else ""
        )
        raise RuntimeError(f"worker {name} did not register: {logs[-3000:]}")

    def api(
        self, method: str, path: str, *, headers: dict[str, str] | None = None, **kwargs: object
    ) -> httpx.Response:
        """A call with the admin token; `headers` adds to it (a worker stand-in's `X-Worker-Secret`)."""
        headers = {"Authorization": f"Bearer {self.token}", **(headers or {})}
        return httpx.request(method, f"{self.url}{path}", headers=headers, timeout=60, **kwargs)  # type: ignore[arg-type]

    def submit(self, capability: str, input: object = None, **options: object) -> dict:
        resp = self.api("POST", "/v1/tasks", json={"capability": capability, "input": input, **options})
        assert resp.status_code == 201, resp.text
        return resp.json()

    def result(self, task_id: str, wait: float = 30) -> dict:
        deadline = time.monotonic() + wait
        while True:
            task = self.api("GET", f"/v1/tasks/{task_id}/result", params={"wait": min(10, wait)}).json()
            if task["state"] in ("succeeded", "failed", "cancelled") or time.monotonic() > deadline:
                return task

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "turnout.cli", *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)  # fmt: skip


def sample(metrics: str, series: str) -> float:
    """The value of one sample (`name{labels}`, as written) in a controller's `/metrics` text; 0 if absent."""
    prefix = f"{series} "
    return sum(float(line.removeprefix(prefix)) for line in metrics.splitlines() if line.startswith(prefix))


def channel_requests(metrics: str, call: str) -> float:
    """How many `call` requests a controller's `/metrics` text says its workers sent over their channels."""
    return sample(metrics, f'turnout_worker_channel_requests_total{{call="{call}"}}')


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database of the test's own (tests/pg.py), dropped after it, also when it fails."""
    from tests.pg import fresh_database

    with fresh_database() as url:
        yield url


@pytest.fixture
def processes() -> Iterator[Processes]:
    procs = Processes()
    try:
        yield procs
    finally:
        procs.stop_all()


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One controller (and the workers a module adds) for a whole module of tests that do not disturb it."""
    procs = Processes()
    tmp = tmp_path_factory.mktemp("cluster")
    try:
        c = Cluster(tmp, procs, f"sqlite:///{tmp / 'turnout.db'}")
        c.start_controller()
        yield c
    finally:
        procs.stop_all()


@pytest.fixture
def cluster(tmp_path: Path, processes: Processes) -> Cluster:
    """A running controller on a fresh SQLite file; add workers with `cluster.start_worker(...)`."""
    c = Cluster(tmp_path, processes, f"sqlite:///{tmp_path / 'turnout.db'}")
    c.start_controller()
    return c


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(FileNotFoundError):
        if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
            return False
    return True


FAULT_REPORT = "fault_report"  # a fault test's user property: its one line for the run's closing summary
FAULT_REPORTS: list[str] = []  # those lines, gathered from the tests' reports (where xdist runs them too)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        FAULT_REPORTS.extend(str(value) for key, value in report.user_properties if key == FAULT_REPORT)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FAULT_REPORTS:
        terminalreporter.section("fault injection: what each fault left behind")
        for line in FAULT_REPORTS:
            terminalreporter.write_line(line)


# Folders whose files start real processes and wait on them (seconds to a minute a file) run before those of
# pure, in-process tests (a few seconds a file): with `--dist loadfile`, files go to the xdist workers in this
# order, so the small files fill in at the end and both workers finish together. Reordered by count of tests
# (xdist's default), a minute-long file of five process tests started last and held the run a minute alone.
SLOW_FIRST = ("faults", "integration", "acceptance", "browser")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        parts = Path(str(item.path)).parts
        return 0 if any(folder in parts for folder in SLOW_FIRST) else 1

    items.sort(key=rank)  # stable: the order within each rank is collection order


@pytest.fixture(scope="module")
def web_page() -> Iterator[str]:
    """A web server that answers every request `200 text/html`, as a mistyped TURNOUT_URL may find."""

    class Page(BaseHTTPRequestHandler):
        def _page(self) -> None:
            body = b"<html><body>hello</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_DELETE = _page

        def log_message(self, *args: object) -> None:
            pass

    with http_stand_in(Page) as url:
        yield url


@contextlib.contextmanager
def http_stand_in(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A threaded HTTP server on a free loopback port answering with `handler`: its URL, for the block; it is
    stopped however the block ends."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
