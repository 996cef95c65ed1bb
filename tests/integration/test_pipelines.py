"""Pipeline runs end to end: a real controller with a turnout.yaml, real workers (one with a fake GPU), SQLite."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.conftest import Cluster, Processes, pid_alive
from turnout.client import Client

APP = "tests.apps.pipeline_app:app"
CONFIG = """
prices:
  cpu: 0.0002
  gpu: 0.0015
  gpu:A100: 0.003
pipelines:
  words:
    stages:
      - {capability: split, gpu: never, timeout_s: 30}
      - {capability: count, gpu: prefer, timeout_s: 30}
      - {capability: report, gpu: never, timeout_s: 30}
  tallied:
    stages:
      - {capability: split, gpu: never}
      - {capability: tally, gpu: never}
      - {capability: report, gpu: never}
  broken:
    stages:
      - {capability: split, gpu: never}
      - {capability: explode, gpu: never, retries: 0}
      - {capability: report, gpu: never}
  slow:
    stages:
      - {capability: split, gpu: never}
      - {capability: nap, gpu: never, timeout_s: 1, retries: 0}
  napping:
    stages:
      - {capability: nap, gpu: never, timeout_s: 120}
      - {capability: split, gpu: never}
  split_then_nap:
    stages:
      - {capability: split, gpu: never}
      - {capability: nap, gpu: never, timeout_s: 120}
"""


def until(check: Callable[[], object], timeout_s: float = 30, what: str = "condition") -> object:
    """Poll `check` until it answers something truthy, with a deadline (no sleep-then-assert)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def configured(tmp_path: Path, processes: Processes) -> Cluster:
    """A controller started with the pipelines above, and a CPU worker serving the pipeline app."""
    cfg = tmp_path / "turnout.yaml"
    cfg.write_text(CONFIG)
    c = Cluster(
        tmp_path, processes, f"sqlite:///{tmp_path / 'turnout.db'}", extra_args=["--config", str(cfg)]
    )
    c.start_controller()
    c.start_worker(APP, name="cpu")
    return c


def start_run(c: Cluster, name: str, data: dict, **extra: object) -> dict:
    resp = c.api("POST", f"/v1/pipelines/{name}/runs", json={"input": data, **extra})
    assert resp.status_code == 201, resp.text
    return resp.json()


def wait_run(c: Cluster, run_id: str, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        run = c.api("GET", f"/v1/pipeline-runs/{run_id}", params={"wait": 5}).json()
        if run["state"] != "running" or time.monotonic() > deadline:
            return run


def stage_running(c: Cluster, run_id: str, index: int) -> dict:
    def check() -> dict | None:
        run = c.api("GET", f"/v1/pipeline-runs/{run_id}").json()
        return run if run["stages"][index]["state"] == "running" else None

    return until(check, what=f"stage {index} running")  # type: ignore[return-value]


def test_each_stage_gets_the_run_input_updated_with_the_outputs_before_it(configured: Cluster) -> None:
    configured.start_worker(APP, gpus="fake:1xA100-40Gi", name="gpu")
    run = wait_run(configured, start_run(configured, "words", {"text": "a b c", "lang": "en"})["id"])
    assert run["state"] == "succeeded", run
    split, count, report = (s for s in run["stages"])
    assert [s["state"] for s in run["stages"]] == ["succeeded"] * 3
    assert run["output"]["summary"] == "3 words"
    # each stage saw the run input plus every earlier output, and nothing of later stages
    assert run["output"]["report_saw"] == sorted(
        ["text", "lang", "words", "split_saw", "n", "count_on", "count_saw"]
    )
    task = configured.api("GET", f"/v1/tasks/{count['task_id']}").json()
    assert sorted(task["input"]) == sorted(["text", "lang", "words", "split_saw"])
    assert task["pipeline_run_id"] == run["id"]
    # routed per stage: never -> cpu, prefer -> the fake A100
    assert (split["device"], count["device"], report["device"]) == ("cpu", "gpu", "cpu")
    assert count["gpu_model"] and "A100" in count["gpu_model"]
    # cost per stage at its device's price (and GPU model's), cold start included
    for st, price in ((split, 0.0002), (count, 0.003), (report, 0.0002)):
        assert st["cost_usd"] == pytest.approx((st["run_s"] + (st["cold_start_s"] or 0)) * price, abs=2e-8)
    gpu_only = sum((s["run_s"] + (s["cold_start_s"] or 0)) * 0.003 for s in run["stages"])
    assert run["cost_usd"] == pytest.approx(sum(s["cost_usd"] for s in run["stages"]), rel=1e-6)
    assert run["gpu_only_cost_usd"] == pytest.approx(gpu_only, abs=1e-7)
    assert run["gpu_only_cost_usd"] > run["cost_usd"]  # the CPU stages cost less than on the GPU
    listed = configured.api("GET", "/v1/pipeline-runs").json()["pipeline_runs"]
    assert [r["id"] for r in listed] == [run["id"]]
    metrics = configured.api("GET", "/metrics").text
    line = next(
        x for x in metrics.splitlines() if x.startswith('turnout_tenant_cost_usd_total{capability="count"')
    )
    assert 'tenant="default"' in line and float(line.split()[-1]) == pytest.approx(
        count["cost_usd"], abs=1e-9
    )
    assert 'turnout_pipeline_runs{pipeline="words",state="succeeded"} 1.0' in metrics


def test_a_failing_stage_fails_the_run_naming_the_stage_and_no_later_stage_starts(
    configured: Cluster,
) -> None:
    run = wait_run(configured, start_run(configured, "broken", {"text": "x y"})["id"])
    assert run["state"] == "failed"
    assert run["error"]["stage"] == 1 and run["error"]["capability"] == "explode"
    assert (
        "stage 1 (explode) failed" in run["error"]["message"]
        and "cannot handle 2 words" in run["error"]["message"]
    )
    assert [s["state"] for s in run["stages"]] == ["succeeded", "failed", "pending"]
    assert run["stages"][2]["task_id"] is None


def test_a_stage_over_its_timeout_fails_the_run_with_timeout(configured: Cluster) -> None:
    run = wait_run(configured, start_run(configured, "slow", {"text": "x", "nap_s": 60})["id"])
    assert run["state"] == "failed"
    assert run["error"]["cause"] == "timeout" and run["error"]["capability"] == "nap"
    assert run["stages"][1]["error"]["type"] == "timeout"


def test_a_run_survives_a_controller_restart_mid_stage(configured: Cluster) -> None:
    run = start_run(configured, "napping", {"text": "p q r", "nap_s": 2})
    stage_running(configured, run["id"], 0)
    configured.kill_controller()
    configured.start_controller()  # same database and port; the worker reports to the new one
    done = wait_run(configured, run["id"])
    assert done["state"] == "succeeded", done
    assert done["output"]["words"] == ["p", "q", "r"]


def test_a_run_survives_losing_its_worker_mid_stage(configured: Cluster, tmp_path: Path) -> None:
    pidfile = tmp_path / "nap.pid"
    run = start_run(configured, "napping", {"text": "k", "nap_s": 2, "pidfile": str(pidfile)})
    stage_running(configured, run["id"], 0)
    worker = configured.procs.procs[-1]
    os.killpg(worker.pid, signal.SIGKILL)
    configured.start_worker(APP, name="cpu2")
    done = wait_run(configured, run["id"])
    assert done["state"] == "succeeded", done
    assert done["stages"][0]["attempts"] == 2  # the lost attempt, then the one that finished


def test_cancelling_a_run_kills_the_stage_in_flight_and_starts_no_more(
    configured: Cluster, tmp_path: Path
) -> None:
    pidfile = tmp_path / "nap.pid"
    run = start_run(configured, "napping", {"text": "k", "nap_s": 120, "pidfile": str(pidfile)})
    stage_running(configured, run["id"], 0)
    pid = int(until(lambda: pidfile.exists() and pidfile.read_text(), what="the stage's pid"))  # type: ignore[arg-type]
    cancelled = configured.cli("cancel", run["id"])  # `turnout cancel` takes a run's id as a task's
    assert (cancelled.returncode, cancelled.stdout.strip()) == (0, f"{run['id']}: cancelled"), (
        cancelled.stderr
    )
    until(lambda: not pid_alive(pid), what="the stage's process to die")
    after = configured.api("GET", f"/v1/pipeline-runs/{run['id']}").json()
    assert [s["state"] for s in after["stages"]] == ["cancelled", "pending"]
    again = configured.api("POST", f"/v1/pipeline-runs/{run['id']}/cancel")
    assert again.status_code == 409


def test_stages_after_the_first_run_chained_on_its_worker_and_a_cancel_stops_the_one_in_flight(
    configured: Cluster, tmp_path: Path
) -> None:
    """Only a CPU worker: `count` (prefer) would fall back to the CPU anyway, so every stage after the first
    starts on that worker as soon as the one before it succeeds, with no queue and no lease between them."""
    run = wait_run(configured, start_run(configured, "words", {"text": "a b c"})["id"])
    assert run["state"] == "succeeded" and run["output"]["summary"] == "3 words", run
    assert [s["reason"].split(" on ")[0] for s in run["stages"][1:]] == [
        "chained after stage 0",
        "chained after stage 1",
    ]
    assert len({s["worker"] for s in run["stages"]}) == 1

    pidfile = tmp_path / "nap.pid"
    run = start_run(configured, "split_then_nap", {"text": "k", "nap_s": 120, "pidfile": str(pidfile)})
    pid = int(until(lambda: pidfile.exists() and pidfile.read_text(), what="the chained stage's pid"))  # type: ignore[arg-type]
    napping = configured.api("GET", f"/v1/pipeline-runs/{run['id']}").json()["stages"][1]
    assert napping["state"] in ("leased", "running") and napping["reason"].startswith("chained after stage 0")
    assert configured.api("POST", f"/v1/pipeline-runs/{run['id']}/cancel").json()["state"] == "cancelled"
    until(lambda: not pid_alive(pid), what="the chained stage's process to die")
    after = configured.api("GET", f"/v1/pipeline-runs/{run['id']}").json()
    assert [s["state"] for s in after["stages"]] == ["succeeded", "cancelled"]


def test_a_batched_stage_chained_on_its_worker_gets_its_own_output_not_a_list(configured: Cluster) -> None:
    """A chained stage is handed to the worker alone, outside any lease batch; a batched variant's handler
    still takes a list and returns one, and the stage's output is that list's one item (the demo's
    classify_text, chained after preprocess_text on a CPU worker, once lost its sentiment this way)."""
    run = wait_run(configured, start_run(configured, "tallied", {"text": "a b c d"})["id"])
    assert run["state"] == "succeeded", run
    tally, report = run["stages"][1:]
    assert tally["reason"].startswith("chained after stage 0"), tally
    assert report["reason"].startswith("chained after stage 1"), report  # a batch of one chains the next
    task = configured.api("GET", f"/v1/tasks/{tally['task_id']}").json()
    assert task["output"] == {"n": 4, "tally_batch": 1}
    assert run["output"]["summary"] == "4 words"


def test_unknown_pipeline_and_bad_run_input_are_refused_naming_the_field(configured: Cluster) -> None:
    resp = configured.api("POST", "/v1/pipelines/nope/runs", json={"input": {}})
    assert resp.status_code == 404 and "words" in resp.json()["error"]["message"]
    resp = configured.api("POST", "/v1/pipelines/words/runs", json={"input": [1, 2]})
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "input"
    resp = configured.api("POST", "/v1/pipelines/words/runs", json={"input": {}, "gpu": "sometimes"})
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "gpu"
    resp = configured.api("POST", "/v1/pipelines/words/runs", json={"input": {}, "colour": 1})
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "colour"
    assert configured.api("GET", "/v1/pipeline-runs/r_missing").status_code == 404


def test_sdk_and_cli_run_a_pipeline_through_the_real_route(configured: Cluster) -> None:
    with Client(configured.url, configured.token) as client:
        sent: list[str] = []

        async def hook(request: httpx.Request) -> None:
            sent.append(f"{request.method} {request.url.path}?{request.url.query.decode()}")

        client._async.http.event_hooks["request"].append(hook)
        run = client.run_pipeline("words", {"text": "one two"}, wait=60)
        assert run["state"] == "succeeded" and run["output"]["summary"] == "2 words"
        assert sent == ["POST /v1/pipelines/words/runs?wait=30.0"]  # the start's answer is the ended run
        assert client.pipeline_runs()["pipeline_runs"][0]["id"] == run["id"]
    done = configured.cli("run", "words", "--input", '{"text": "x y z"}')
    assert done.returncode == 0, done.stderr
    assert "total" in done.stdout and "3 words" in done.stdout
    assert "saved" in done.stdout  # the saving against every stage on the GPU
    failed = configured.cli("run", "broken", "--input", '{"text": "x"}')
    assert failed.returncode == 1 and "stage 1 (explode) failed" in failed.stderr


def test_a_config_with_a_bad_key_stops_the_controller_naming_the_key_and_file(
    tmp_path: Path, processes: Processes
) -> None:
    cfg = tmp_path / "turnout.yaml"
    cfg.write_text("pipelines:\n  p:\n    stages:\n      - {capability: split, gpu: sometimes}\n")
    c = Cluster(tmp_path, processes, f"sqlite:///{tmp_path / 'turnout.db'}")
    done = c.cli("controller", "--db", c.db, "--port", str(c.port), "--home", str(tmp_path / "home"),
                 "--config", str(cfg))  # fmt: skip
    assert done.returncode == 2
    assert f"{cfg}: pipelines.p.stages.0.gpu" in done.stderr and "Traceback" not in done.stderr
    cfg.write_text("prices: {cpu: 0.1}\npipelins: {}\n")
    done = c.cli("controller", "--db", c.db, "--port", str(c.port), "--home", str(tmp_path / "home"),
                 "--config", str(cfg))  # fmt: skip
    assert done.returncode == 2 and f"{cfg}: pipelins: unknown key" in done.stderr
