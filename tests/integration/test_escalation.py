"""Escalation to cloud endpoints, against stand-in RunPod and plain HTTP servers on loopback."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Cluster, Processes, http_stand_in
from tests.integration.test_pipelines import until

APP = "tests.apps.pipeline_app:app"


@dataclass
class StandIn:
    """A RunPod-like queue endpoint (`/rp/...`) and a plain HTTP one (`/plain`). A job's input says how it behaves:
    `{"mode": "ok"}` completes on its second status poll, `"hang"` stays IN_PROGRESS, `"fail"` FAILED; the first
    `busy` calls to /run answer 429."""

    calls: list[str] = field(default_factory=list)
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    busy: int = 0
    auth: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def handle(
        self, method: str, path: str, body: Any, headers: Any
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        with self.lock:
            self.calls.append(f"{method} {path}")
            self.auth.append(headers.get("Authorization", ""))
            if path == "/plain":
                return 200, {"echo": body["input"], "where": "plain"}, {}
            if path == "/rp/run":
                if self.busy > 0:
                    self.busy -= 1
                    return 429, {"error": "too many requests"}, {"Retry-After": "1"}
                job = f"job-{len(self.jobs) + 1}"
                self.jobs[job] = {"input": body["input"], "polls": 0, "status": "IN_QUEUE"}
                return 200, {"id": job, "status": "IN_QUEUE"}, {}
            if path.startswith("/rp/status/"):
                job = self.jobs[path.rsplit("/", 1)[1]]
                job["polls"] += 1
                mode = job["input"].get("mode")
                if job["status"] == "CANCELLED":
                    return 200, {"id": path, "status": "CANCELLED"}, {}
                if mode == "ok" and job["polls"] >= 2:
                    return 200, {"status": "COMPLETED", "output": {"cloud": True, "text": job["input"].get("text")},
                                 "executionTime": 1500}, {}  # fmt: skip
                if mode == "fail":
                    return 200, {"status": "FAILED", "error": "model crashed"}, {}
                job["status"] = "IN_PROGRESS"
                return 200, {"status": "IN_PROGRESS"}, {}
            if path.startswith("/rp/cancel/"):
                self.jobs[path.rsplit("/", 1)[1]]["status"] = "CANCELLED"
                return 200, {"status": "CANCELLED"}, {}
            return 404, {"error": "no such route"}, {}


@pytest.fixture
def stand_in() -> Iterator[tuple[StandIn, str]]:
    state = StandIn()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            code, payload, extra = state.handle(method, self.path, body, self.headers)
            data = json.dumps(payload).encode()
            self.send_response(code)
            for k, v in {
                "Content-Type": "application/json",
                "Content-Length": str(len(data)),
                **extra,
            }.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._answer("GET")

        def do_POST(self) -> None:
            self._answer("POST")

        def log_message(self, *args: object) -> None:
            pass

    with http_stand_in(Handler) as url:
        yield state, url


def escalating(tmp_path: Path, processes: Processes, url: str, *, endpoints: bool = True) -> Cluster:
    cfg = tmp_path / "turnout.yaml"
    eps = (f"  endpoints:\n"
           f"    - {{capability: count, kind: runpod, url: '{url}/rp', api_key_env: STANDIN_KEY, price_per_s: 0.002,"
           f" name: pod, poll_s: 0.1, timeout_s: 3}}\n"
           f"    - {{capability: split, kind: http, url: '{url}/plain', price_per_s: 0.001, name: plain, poll_s: 0.1}}\n")  # fmt: skip
    cfg.write_text(
        "prices: {cpu: 0.0002, gpu: 0.0015}\n" + (f"escalation:\n  after_s: 1\n{eps}" if endpoints else "")
    )
    c = Cluster(
        tmp_path, processes, f"sqlite:///{tmp_path / 'turnout.db'}", extra_args=["--config", str(cfg)]
    )
    return c


@pytest.fixture
def cloud(tmp_path: Path, processes: Processes, stand_in: tuple[StandIn, str],
          monkeypatch: pytest.MonkeyPatch) -> tuple[Cluster, StandIn]:  # fmt: skip
    monkeypatch.setenv("STANDIN_KEY", "sekret")
    c = escalating(tmp_path, processes, stand_in[1])
    c.start_controller()
    return c, stand_in[0]


def test_a_task_with_no_local_capacity_runs_on_the_runpod_endpoint_and_pays_its_price(
    cloud: tuple[Cluster, StandIn],
) -> None:
    c, pod = cloud
    task = c.submit("count", {"mode": "ok", "text": "hi"}, gpu="prefer", placement_timeout_s=30)
    done = c.result(task["id"], wait=30)
    assert done["state"] == "succeeded", done
    assert done["output"] == {"cloud": True, "text": "hi"}
    assert done["device"] == "cloud:pod"
    assert "no local capacity" in done["routing"]["reason"]
    assert done["run_s"] == pytest.approx(1.5) and done["cost_usd"] == pytest.approx(1.5 * 0.002)
    assert "Bearer sekret" in pod.auth
    assert [x for x in pod.calls if x.startswith("POST")] == ["POST /rp/run"]


def test_the_plain_http_kind_answers_the_output_in_one_call(cloud: tuple[Cluster, StandIn]) -> None:
    c, pod = cloud
    assert pod.calls == []
    done = c.result(c.submit("split", {"text": "a b"}, gpu="require", placement_timeout_s=30)["id"], wait=30)
    assert done["state"] == "succeeded" and done["output"]["where"] == "plain"
    assert pod.calls == ["POST /plain"]
    assert done["device"] == "cloud:plain"


def test_a_429_from_the_endpoint_backs_off_and_then_runs(cloud: tuple[Cluster, StandIn]) -> None:
    c, pod = cloud
    pod.busy = 2
    done = c.result(c.submit("count", {"mode": "ok"}, gpu="prefer", placement_timeout_s=30)["id"], wait=40)
    assert done["state"] == "succeeded", done
    assert pod.calls.count("POST /rp/run") == 3  # twice refused with 429, then accepted


def test_a_job_past_the_endpoint_timeout_is_cancelled_and_its_task_fails_timeout(
    cloud: tuple[Cluster, StandIn],
) -> None:
    c, pod = cloud
    done = c.result(c.submit("count", {"mode": "hang"}, gpu="prefer", placement_timeout_s=30)["id"], wait=30)
    assert done["state"] == "failed" and done["error"]["type"] == "timeout"
    assert "POST /rp/cancel/job-1" in pod.calls


def test_a_failed_job_fails_its_task_with_the_endpoint_error(cloud: tuple[Cluster, StandIn]) -> None:
    c, pod = cloud
    done = c.result(c.submit("count", {"mode": "fail"}, gpu="prefer", placement_timeout_s=30)["id"], wait=30)
    assert done["state"] == "failed" and done["error"]["type"] == "cloud_failed"
    assert "model crashed" in done["error"]["message"]
    assert "POST /rp/run" in pod.calls


def test_cancelling_a_task_mid_run_cancels_its_job_on_the_endpoint(cloud: tuple[Cluster, StandIn]) -> None:
    c, pod = cloud
    task = c.submit("count", {"mode": "hang"}, gpu="prefer", placement_timeout_s=30)
    until(lambda: c.api("GET", f"/v1/tasks/{task['id']}").json()["state"] == "running", what="the job sent")
    assert c.api("POST", f"/v1/tasks/{task['id']}/cancel").json()["state"] == "cancelled"
    until(lambda: "POST /rp/cancel/job-1" in pod.calls, what="the job cancelled on the endpoint")


def test_a_task_whose_gpu_value_forbids_a_gpu_is_never_escalated(cloud: tuple[Cluster, StandIn]) -> None:
    c, pod = cloud
    cpu_only = c.submit("count", {"mode": "ok"}, gpu="never", placement_timeout_s=30)
    escalated = c.result(
        c.submit("count", {"mode": "ok"}, gpu="require", placement_timeout_s=30)["id"], wait=30
    )
    assert escalated["state"] == "succeeded"  # the escalator ran past after_s for both
    assert c.api("GET", f"/v1/tasks/{cpu_only['id']}").json()["state"] == "queued"
    assert pod.calls.count("POST /rp/run") == 1


def test_without_escalation_a_task_waits_for_local_capacity_and_runs_there(
    tmp_path: Path, processes: Processes, stand_in: tuple[StandIn, str]
) -> None:
    c = escalating(tmp_path, processes, stand_in[1], endpoints=False)
    c.start_controller()
    task = c.submit("count", {"words": ["a"], "mode": "ok"}, gpu="prefer", placement_timeout_s=30)
    c.start_worker(APP, name="local")
    done = c.result(task["id"], wait=30)
    assert done["state"] == "succeeded" and done["device"] == "cpu"
    assert stand_in[0].calls == []
