"""Escalation against hostile or broken endpoints on loopback: garbage answers, huge and endless bodies, absurd
Retry-After values, flapping statuses, bad job ids, redirects. Whatever an endpoint does, its task ends (in
time, with an error naming what went wrong), the controller keeps serving, and the endpoint's key stays secret.

A job's behaviour is its input's `mode`; one controller serves a whole test, its tasks escalating together.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Cluster, Processes, http_stand_in
from tests.integration.test_pipelines import until
from turnout.config import ControllerSettings
from turnout.controller import Controller
from turnout.errors import StorageUnavailable
from turnout.escalation import Endpoint, EscalationSettings, Escalator
from turnout.models import GpuMode, Task, TaskSpec, TaskState
from turnout.store import MemoryStore

KEY = "sekret-key-0123456789"
HUGE = 300 * 1024 * 1024  # declared bytes of a huge answer: far over what a result may carry
ENDS = ("succeeded", "failed", "cancelled")


@dataclass
class Reply:
    code: int = 200
    body: Any = None  # JSON-encoded unless bytes
    headers: dict[str, str] = field(default_factory=dict)
    drip_s: float | None = None  # slow loris: one byte of a long body every drip_s, never done
    huge: bool = False  # a body of HUGE bytes, streamed


@dataclass
class Hostile:
    """Records every call (method, path, Authorization) and answers as `answer` says."""

    answer: Callable[[str, str, Any], Reply] = lambda m, p, b: Reply(404, {"error": "no route"})
    calls: list[tuple[str, str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    closing: threading.Event = field(default_factory=threading.Event)

    def paths(self, method: str = "") -> list[str]:
        with self.lock:
            return [p for m, p, _ in self.calls if not method or m == method]


@contextlib.contextmanager
def hostile_endpoint(state: Hostile) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            with state.lock:
                state.calls.append((method, self.path, self.headers.get("Authorization", "")))
            reply = state.answer(method, self.path, body)
            data = reply.body if isinstance(reply.body, bytes) else json.dumps(reply.body).encode()
            self.send_response(reply.code)
            self.send_header("Content-Type", "application/json")
            size = HUGE if (reply.huge or reply.drip_s) else len(data)
            self.send_header("Content-Length", str(size))
            for k, v in reply.headers.items():
                self.send_header(k, v)
            self.end_headers()
            with contextlib.suppress(OSError):
                if reply.huge:
                    chunk = b"[" + b"1," * (1 << 19)
                    for _ in range(HUGE // len(chunk)):
                        if state.closing.is_set():
                            return
                        self.wfile.write(chunk)
                elif reply.drip_s:
                    self.wfile.write(b'{"status": "')
                    while not state.closing.wait(reply.drip_s):  # until the client hangs up, or the test ends
                        self.wfile.write(b"x")
                        self.wfile.flush()
                else:
                    self.wfile.write(data)

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def log_message(self, *args: object) -> None:
            pass

    try:
        with http_stand_in(Handler) as url:
            yield url
    finally:
        state.closing.set()


@dataclass
class Setup:
    cluster: Cluster
    pod: Hostile
    url: str

    def submit(self, capability: str, mode: str, **options: Any) -> str:
        return self.cluster.submit(
            capability, {"mode": mode}, gpu="require", placement_timeout_s=120, **options
        )["id"]

    def ended(self, task_id: str, within_s: float = 45) -> dict[str, Any]:
        """The task once it ended; fails if it did not end in time (a hang)."""
        c = self.cluster
        done = until(lambda: _ended(c.api("GET", f"/v1/tasks/{task_id}")), timeout_s=within_s,
                     what=f"task {task_id} to end")  # fmt: skip
        assert isinstance(done, dict)
        return done


def _ended(resp: Any) -> dict[str, Any] | None:
    assert resp.status_code == 200, resp.text  # the task can always be read back
    task = resp.json()
    return task if task["state"] in ENDS else None


def start(tmp_path: Path, processes: Processes, monkeypatch: pytest.MonkeyPatch, url: str,
          pod_timeout_s: float = 4, plain_timeout_s: float = 4) -> Cluster:  # fmt: skip
    monkeypatch.setenv("HOSTILE_KEY", KEY)
    cfg = tmp_path / "turnout.yaml"
    cfg.write_text(
        "prices: {cpu: 0.0002, gpu: 0.0015}\n"
        "escalation:\n  after_s: 0\n  endpoints:\n"
        f"    - {{capability: count, kind: runpod, url: '{url}/rp', api_key_env: HOSTILE_KEY, price_per_s: 0.002,"
        f" name: pod, poll_s: 0.1, timeout_s: {pod_timeout_s}}}\n"
        f"    - {{capability: split, kind: http, url: '{url}/plain', api_key_env: HOSTILE_KEY, price_per_s: 0.001,"
        f" name: plain, poll_s: 0.1, timeout_s: {plain_timeout_s}}}\n"
    )
    c = Cluster(
        tmp_path, processes, f"sqlite:///{tmp_path / 'turnout.db'}", extra_args=["--config", str(cfg)]
    )
    c.start_controller()
    return c


@pytest.fixture
def hostile(tmp_path: Path, processes: Processes, monkeypatch: pytest.MonkeyPatch) -> Iterator[Setup]:
    state = Hostile()
    with hostile_endpoint(state) as url:
        yield Setup(start(tmp_path, processes, monkeypatch, url), state, url)


def runpod(jobs: dict[str, str], run: Callable[[str], Reply | None], status: Callable[[str, int], Reply]
           ) -> Callable[[str, str, Any], Reply]:  # fmt: skip
    """A RunPod-like answer: `run(mode)` answers POST /rp/run (None: a new job `job-N`), `status(mode, poll)` its
    polls; cancels are answered 200. `jobs` maps job ids to modes."""
    polls: dict[str, int] = {}

    def answer(method: str, path: str, body: Any) -> Reply:
        if path == "/rp/run":
            mode = body["input"]["mode"]
            reply = run(mode)
            if reply is None:
                job = f"job-{len(jobs) + 1}"
                jobs[job] = mode
                reply = Reply(200, {"id": job, "status": "IN_QUEUE"})
            return reply
        if path.startswith("/rp/status/"):
            job = path.rsplit("/", 1)[1]
            polls[job] = polls.get(job, 0) + 1
            return status(jobs.get(job, "?"), polls[job])
        if path.startswith("/rp/cancel/"):
            return Reply(200, {"status": "CANCELLED"})
        return Reply(404, {"error": f"no route {path}"})

    return answer


# ---- hangs: every task ends by its endpoint's timeout_s, whatever the endpoint does -------------------------


def test_absurd_retry_after_and_endless_429s_end_in_a_timeout_not_a_hang(hostile: Setup) -> None:
    def run(mode: str) -> Reply | None:
        return Reply(429, {"error": "slow down"}, {"Retry-After": mode}) if mode != "ok" else None

    hostile.pod.answer = runpod({}, run, lambda mode, n: Reply(200, {"status": "IN_PROGRESS"}))
    modes = ["1e9", "inf", "-5", "nan", "Wed, 21 Oct 2099 07:28:00 GMT", "0"]
    tasks = {mode: hostile.submit("count", mode) for mode in modes}
    started = time.monotonic()
    for mode, task_id in tasks.items():
        done = hostile.ended(task_id)
        assert done["state"] == "failed" and done["error"]["type"] == "timeout", (mode, done)
    assert time.monotonic() - started < 30  # timeout_s 4, and the waits it asked for cut to what was left


def test_an_http_endpoint_answering_429_forever_times_out(hostile: Setup) -> None:
    hostile.pod.answer = lambda m, p, b: Reply(429, {"error": "slow down"}, {"Retry-After": "100000"})
    done = hostile.ended(hostile.submit("split", "busy"))
    assert done["state"] == "failed" and done["error"]["type"] == "timeout", done


def test_a_slow_loris_endpoint_times_out_at_every_step(hostile: Setup) -> None:
    jobs: dict[str, str] = {}

    def run(mode: str) -> Reply | None:
        return Reply(drip_s=0.5) if mode == "drip_run" else None

    def status(mode: str, n: int) -> Reply:
        return Reply(drip_s=0.5) if mode == "drip_status" else Reply(200, {"status": "IN_PROGRESS"})

    answer = runpod(jobs, run, status)
    hostile.pod.answer = lambda m, p, b: Reply(drip_s=0.5) if p == "/plain" else answer(m, p, b)
    tasks = [hostile.submit("count", "drip_run"), hostile.submit("count", "drip_status"),
             hostile.submit("split", "drip")]  # fmt: skip
    for task_id in tasks:
        done = hostile.ended(task_id)
        assert done["state"] == "failed" and done["error"]["type"] == "timeout", done
    assert any(p.startswith("/rp/cancel/") for p in hostile.pod.paths("POST"))  # the dripping job, stopped


def test_a_task_cancelled_while_its_endpoint_hangs_is_let_go_and_its_job_cancelled(
    tmp_path: Path, processes: Processes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long Retry-After, or a status poll that never answers, does not keep the job from being cancelled."""
    state = Hostile()
    with hostile_endpoint(state) as url:
        c = start(tmp_path, processes, monkeypatch, url, pod_timeout_s=600)
        setup = Setup(c, state, url)
        state.answer = runpod({}, lambda mode: None,
                              lambda mode, n: Reply(429, {}, {"Retry-After": "3600"}))  # fmt: skip
        task = setup.submit("count", "ok")
        until(lambda: "/rp/status/job-1" in state.paths("GET"), what="the job polled")
        assert c.api("POST", f"/v1/tasks/{task}/cancel").json()["state"] == "cancelled"
        until(lambda: "/rp/cancel/job-1" in state.paths("POST"), timeout_s=30, what="the job cancelled there")


# ---- garbage answers fail the task naming what was wrong; the task can always be read back ------------------


def test_garbage_status_answers_fail_the_task_clearly_and_cancel_the_job(hostile: Setup) -> None:
    jobs: dict[str, str] = {}
    bodies: dict[str, Reply] = {
        "html": Reply(200, b"<html>gateway</html>"),
        "list": Reply(200, [1, 2, 3]),
        "nan": Reply(200, b'{"status": "COMPLETED", "output": {"score": NaN}}'),
        "inf": Reply(200, b'{"status": "COMPLETED", "output": {"score": 1e400}}'),
        "huge": Reply(200, huge=True),
        "expired": Reply(404, {"error": "request does not exist"}),
    }
    hostile.pod.answer = runpod(jobs, lambda mode: None, lambda mode, n: bodies[mode])
    tasks = {mode: hostile.submit("count", mode) for mode in bodies}
    for mode, task_id in tasks.items():
        done = hostile.ended(task_id)
        assert done["state"] == "failed", (mode, done)
        assert done["error"]["type"] in ("cloud_error", "invalid_output"), (mode, done)
        assert "pod" in done["error"]["message"], (mode, done)
    by_mode = {mode: job for job, mode in jobs.items()}
    for mode in ("html", "list", "nan", "inf", "huge", "expired"):
        assert f"/rp/cancel/{by_mode[mode]}" in hostile.pod.paths("POST"), mode  # it runs (and bills) no more
    huge = hostile.ended(tasks["huge"])
    assert "too large" in huge["error"]["message"], huge
    nan = hostile.ended(tasks["nan"])
    assert nan["error"]["type"] == "invalid_output" and "output.score" in nan["error"]["message"], nan
    assert hostile.cluster.api("GET", "/v1/tasks").status_code == 200  # the listing still answers


def test_garbage_http_answers_fail_the_task_clearly(hostile: Setup) -> None:
    bodies: dict[str, Reply] = {
        "nan": Reply(200, b'{"score": NaN}'),
        "html": Reply(200, b"<html>"),
        "huge": Reply(200, huge=True),
        "moved": Reply(301, {"looks": "like an output"}, {"Location": "http://127.0.0.1:9/x"}),
    }
    hostile.pod.answer = lambda m, p, b: bodies[b["input"]["mode"]]
    for mode in bodies:
        done = hostile.ended(hostile.submit("split", mode))
        assert done["state"] == "failed", (mode, done)
        assert done["error"]["type"] in ("cloud_error", "invalid_output"), (mode, done)
        assert "plain" in done["error"]["message"], (mode, done)
    assert hostile.cluster.api("GET", "/v1/tasks").status_code == 200


def test_a_job_id_that_is_not_a_plain_token_is_refused_and_never_put_in_a_url(hostile: Setup) -> None:
    ids: dict[str, Any] = {"dots": "../../steal", "object": {"a": 1}, "long": "j" * 100_000, "empty": ""}
    hostile.pod.answer = runpod({}, lambda mode: Reply(200, {"id": ids[mode], "status": "IN_QUEUE"}),
                                lambda mode, n: Reply(200, {"status": "IN_PROGRESS"}))  # fmt: skip
    for mode in ids:
        done = hostile.ended(hostile.submit("count", mode))
        assert done["state"] == "failed" and done["error"]["type"] == "cloud_error", (mode, done)
        assert "job id" in done["error"]["message"], (mode, done)
        assert len(json.dumps(done)) < 20_000, mode  # the task does not carry a 100 kB id around
    assert all(
        p == "/rp/run" for p in hostile.pod.paths()
    )  # nothing polled or cancelled outside the endpoint


# ---- transient trouble while a job runs does not lose its result ----------------------------------------------


def test_status_polls_answered_5xx_for_a_while_still_take_the_result(hostile: Setup) -> None:
    def status(mode: str, n: int) -> Reply:
        if n <= 3:
            return Reply(503, {"error": "upstream"})
        return Reply(200, {"status": "COMPLETED", "output": {"ok": True}, "executionTime": 500})

    hostile.pod.answer = runpod({}, lambda mode: None, status)
    done = hostile.ended(hostile.submit("count", "flaky"))
    assert done["state"] == "succeeded" and done["output"] == {"ok": True}, done


def test_an_absurd_execution_time_is_not_billed(hostile: Setup) -> None:
    times: dict[str, Any] = {"negative": -5000, "bool": True, "galactic": 1e15}
    hostile.pod.answer = runpod({}, lambda mode: None, lambda mode, n: Reply(
        200, {"status": "COMPLETED", "output": {"ok": True}, "executionTime": times[mode]}))  # fmt: skip
    for mode in times:
        done = hostile.ended(hostile.submit("count", mode))
        assert done["state"] == "succeeded", (mode, done)
        assert 0 <= done["run_s"] < 60 and 0 <= done["cost_usd"] < 60 * 0.002, (mode, done)


# ---- the key ----------------------------------------------------------------------------------------------


def test_the_key_never_reaches_a_task_even_where_the_endpoint_echoes_it(hostile: Setup) -> None:
    """An endpoint (or a proxy before it) that echoes the request's headers in an error page does not put the
    operator's key in a tenant's task error; a redirect to another host is not followed with the key."""
    other = Hostile(lambda m, p, b: Reply(200, {"stolen": True}))
    with hostile_endpoint(other) as elsewhere:

        def answer(method: str, path: str, body: Any) -> Reply:
            mode = body["input"]["mode"] if body else ""
            if mode == "redirect":
                return Reply(307, {"moved": True}, {"Location": f"{elsewhere}/steal"})
            if mode == "straddle":  # the key across the place an error's excerpt is cut
                return Reply(500, b"x" * 280 + KEY.encode())
            return Reply(500, f"debug: Authorization: Bearer {KEY}".encode())

        hostile.pod.answer = answer
        for capability in ("count", "split"):
            for mode in ("echo", "straddle", "redirect"):
                done = hostile.ended(hostile.submit(capability, mode))
                assert done["state"] == "failed", done
                assert KEY[:12] not in json.dumps(done), done
        assert other.calls == []
    log = (hostile.cluster.tmp / "controller.log").read_text()
    assert KEY not in log


# ---- time limits and restarts -----------------------------------------------------------------------------


@pytest.fixture
def patient(tmp_path: Path, processes: Processes, monkeypatch: pytest.MonkeyPatch) -> Iterator[Setup]:
    """An endpoint whose jobs stay IN_PROGRESS, behind a controller giving them 600 s."""
    state = Hostile()
    state.answer = runpod({}, lambda mode: None, lambda mode, n: Reply(200, {"status": "IN_PROGRESS"}))
    with hostile_endpoint(state) as url:
        c = start(tmp_path, processes, monkeypatch, url, pod_timeout_s=600, plain_timeout_s=600)
        yield Setup(c, state, url)


def test_a_task_s_own_timeout_s_holds_on_an_endpoint_too(patient: Setup) -> None:
    """The reaper leaves tasks an endpoint holds to the escalator: it must apply the task's `timeout_s`."""
    done = patient.ended(patient.submit("count", "hang", timeout_s=2))
    assert done["state"] == "failed" and done["error"]["type"] == "timeout", done
    assert "timeout_s=2" in done["error"]["message"], done
    until(lambda: "/rp/cancel/job-1" in patient.pod.paths("POST"), what="the job cancelled there")


def test_a_restarted_controller_polls_the_job_it_sent_and_never_sends_it_again(patient: Setup) -> None:
    c, pod = patient.cluster, patient.pod
    task = patient.submit("count", "hang")
    until(lambda: pod.paths("GET").count("/rp/status/job-1") >= 2, what="the job polled")
    c.kill_controller()
    polled = len(pod.paths("GET"))
    c.start_controller()
    until(lambda: len(pod.paths("GET")) > polled + 2, what="the job polled again after the restart")
    assert pod.paths("POST") == ["/rp/run"]
    assert c.api("POST", f"/v1/tasks/{task}/cancel").json()["state"] == "cancelled"
    until(lambda: "/rp/cancel/job-1" in pod.paths("POST"), what="the job cancelled there")
    assert pod.paths("POST").count("/rp/run") == 1


# ---- the controller's own bad moment ----------------------------------------------------------------------


class FlakyService:
    """What the escalator needs of `Service`, running each call at once on a controller over a MemoryStore;
    while `down` is above 0, each write fails as a lost database's does (and counts it down)."""

    def __init__(self, ctrl: Controller) -> None:
        self.controller = ctrl
        self.down = 0
        self.replica_id = "local"

    async def read(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.down > 0:
            self.down -= 1
            raise StorageUnavailable("the database is unavailable; retry")
        return fn(*args, **kwargs)

    def changed(self) -> None:
        pass


async def followed(
    service: FlakyService, task_id: str, until: Callable[[], bool] = lambda: False, within_s: float = 30
) -> Task | None:
    """Run an escalator on `service` until the task ends (or `until()` holds, or `within_s` pass), then stop it
    (as a controller that stops); the task as it stands then."""
    escalator = Escalator(service, tick_s=0.05)  # type: ignore[arg-type]
    await escalator.start()
    try:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            task = service.controller.store.get_task(task_id)
            if until() or (task is not None and task.state in (TaskState.SUCCEEDED, TaskState.FAILED)):
                return task
            await asyncio.sleep(0.05)
        return service.controller.store.get_task(task_id)
    finally:
        await escalator.stop()


def test_a_result_that_arrives_while_the_database_is_down_is_committed_once_it_is_back() -> None:
    """The reaper leaves tasks an endpoint holds to the escalator: a storage failure while committing a job's
    result must not leave its task `running` for good, nor cancel the job that succeeded."""
    state = Hostile()
    with hostile_endpoint(state) as url:
        endpoint = Endpoint("count", "runpod", f"{url}/rp", "pod", None, None, poll_s=0.05, timeout_s=60)
        settings = ControllerSettings(escalation=EscalationSettings(after_s=0, endpoints=(endpoint,)))
        ctrl = Controller(MemoryStore(), settings)
        service = FlakyService(ctrl)

        def status(mode: str, n: int) -> Reply:
            if n == 2:
                service.down = 3  # the result's commit fails (and the next tries with it)
            return Reply(
                200, {"status": "COMPLETED", "output": {"ok": n}} if n >= 2 else {"status": "IN_QUEUE"}
            )

        state.answer = runpod({}, lambda mode: None, status)
        spec = TaskSpec("count", {"mode": "x"}, gpu=GpuMode.REQUIRE, placement_timeout_s=120)
        task_id = ctrl.submit("default", [spec], waits_for_capacity=[True])[0].id

        task = asyncio.run(followed(service, task_id))
    assert task is not None and task.state is TaskState.SUCCEEDED, task
    assert task.output and task.output["ok"] >= 2
    assert state.paths("POST") == ["/rp/run"]  # sent once, and never cancelled


def test_a_job_that_ended_while_its_controller_was_down_past_its_deadline_keeps_its_result() -> None:
    """A restarted controller finds the job's time up: it polls once more before it gives the job up, and a job
    that completed meanwhile (the endpoint holds its result 30 minutes) succeeds instead of being cancelled."""
    state = Hostile()
    now = [1_000_000.0]
    with hostile_endpoint(state) as url:
        endpoint = Endpoint("count", "runpod", f"{url}/rp", "pod", None, None, poll_s=0.05, timeout_s=5)
        settings = ControllerSettings(escalation=EscalationSettings(after_s=0, endpoints=(endpoint,)))
        ctrl = Controller(MemoryStore(), settings, clock=lambda: now[0])
        service = FlakyService(ctrl)
        done = threading.Event()  # set once the controller is "down": the job completes then
        state.answer = runpod({}, lambda mode: None, lambda mode, n: Reply(200, {"status": "COMPLETED",
                              "output": {"polls": n}} if done.is_set() else {"status": "IN_PROGRESS"}))  # fmt: skip
        spec = TaskSpec("count", {"mode": "x"}, gpu=GpuMode.REQUIRE, placement_timeout_s=120)
        task_id = ctrl.submit("default", [spec], waits_for_capacity=[True])[0].id

        # Given a job sent and polled, and then the controller down longer than the job's timeout_s
        asyncio.run(followed(service, task_id, until=lambda: bool(state.paths("GET"))))
        done.set()
        now[0] += 60
        # When a new controller follows it
        task = asyncio.run(followed(service, task_id))
    # Then it took the result, and sent the job only once and never cancelled it
    assert task is not None and task.state is TaskState.SUCCEEDED, task
    assert state.paths("POST") == ["/rp/run"]
