"""Pipeline runs as a hostile tenant and on a bad day: a real controller and worker on loopback, SQLite."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Cluster, Processes
from turnout import Context, WorkerApplication

APP = "tests.integration.test_pipelines_hostile:app"
CONFIG = """
pipelines:
  grow3:
    stages:
      - {capability: grow, gpu: never}
      - {capability: grow, gpu: never}
      - {capability: grow, gpu: never}
"""

app = WorkerApplication("pipeline-hostile")


@app.capability("grow", cpu=0.1)
def grow(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    """Adds `grow_bytes` of text under a key of its own stage: each stage's input is larger than the last's."""
    stage = sum(1 for k in data if k.startswith("blob_"))
    return {f"blob_{stage}": "x" * int(data.get("grow_bytes", 0))}


@pytest.fixture
def hostile(tmp_path: Path, processes: Processes) -> Cluster:
    """A controller whose task inputs may hold 64 KiB, and a CPU worker serving the app above."""
    cfg = tmp_path / "turnout.yaml"
    cfg.write_text(CONFIG)
    c = Cluster(tmp_path, processes, f"sqlite:///{tmp_path / 'turnout.db'}",
                extra_args=["--config", str(cfg), "--request-limit", "max_input_bytes=64Ki"])  # fmt: skip
    c.start_controller()
    c.start_worker(APP, name="cpu")
    return c


def wait_run(c: Cluster, run_id: str, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        run = c.api("GET", f"/v1/pipeline-runs/{run_id}", params={"wait": 5}).json()
        if run["state"] != "running" or time.monotonic() > deadline:
            return run


def test_a_stage_whose_input_outgrows_max_input_bytes_fails_the_run_naming_the_stage_and_the_limit(
    hostile: Cluster,
) -> None:
    # Given stages that each add 40 KB to what the next one gets: stage 2's input would be 80 KB, over 64 KiB
    resp = hostile.api("POST", "/v1/pipelines/grow3/runs", json={"input": {"grow_bytes": 40_000}})
    assert resp.status_code == 201, resp.text
    # When the run goes on
    run = wait_run(hostile, resp.json()["id"])
    # Then it fails naming the stage and the limit, as a client's task input that large is refused, and that
    # stage never runs (not queued, nor kept after the worker chained it)
    assert run["state"] == "failed", run["state"]
    assert run["error"]["type"] == "payload_too_large" and run["error"]["stage"] == 2, run["error"]
    assert "stage 2 (grow)" in run["error"]["message"] and "max_input_bytes" in run["error"]["message"]
    assert [s["state"] for s in run["stages"]] == ["succeeded", "succeeded", "pending"]
    tasks = hostile.api("GET", "/v1/tasks", params={"capability": "grow", "limit": 100}).json()["tasks"]
    assert len(tasks) == 2 and all(t["state"] == "succeeded" for t in tasks)
