"""Per-tenant rate limits and GPU quotas from turnout.yaml, on a real controller and worker.

Tenants here: `flood` and `sdk` get the default (5 submissions a second), `calm` a high rate, `quota` at
most one GPU at a time, `gpurate` two GPU allocations a minute, `slow` and `piped` one submission in 5 s. Tests only check correctness; how well the
calm tenant's latency holds up under a flood is measured in bench/bench_tenants.py.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Cluster, Processes
from turnout.client import Client
from turnout.errors import RateLimited

APP = "tests.apps.testapp:app"
CONFIG = """
limits:
  "*":     {submit_per_s: 5}
  calm:    {submit_per_s: 1000}
  quota:   {submit_per_s: 1000, max_gpus: 1}
  gpurate: {submit_per_s: 1000, gpu_allocations_per_min: 2}
  slow:    {submit_per_s: 0.2}
  piped:   {submit_per_s: 0.2}
pipelines:
  triple:
    stages:
      - {capability: count, gpu: never}
      - {capability: count, gpu: never}
      - {capability: count, gpu: never}
"""


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("limits")
    (tmp / "turnout.yaml").write_text(CONFIG)
    procs = Processes()
    try:
        c = Cluster(
            tmp, procs, f"sqlite:///{tmp / 'turnout.db'}", extra_args=["--config", str(tmp / "turnout.yaml")]
        )
        c.start_controller()
        c.start_worker(APP, gpus="fake:2x24Gi", name="pool")  # the operator's token: a shared pool
        tokens = {}
        for tenant in ("flood", "sdk", "calm", "quota", "gpurate", "slow", "piped"):
            resp = c.api("POST", "/v1/tokens", json={"role": "submit", "tenant": tenant})
            tokens[tenant] = resp.json()["token"]
        yield c, tokens
    finally:
        procs.stop_all()


def post(c: Cluster, token: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{c.url}/v1/tasks", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=30
    )


def wait_done(c: Cluster, token: str, task_id: str, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        task = httpx.get(f"{c.url}/v1/tasks/{task_id}/result", params={"wait": 5},
                         headers={"Authorization": f"Bearer {token}"}, timeout=30).json()  # fmt: skip
        if task["state"] in ("succeeded", "failed", "cancelled") or time.monotonic() > deadline:
            return task


def test_a_flooding_tenant_gets_429s_while_another_tenants_tasks_complete(
    limited: tuple[Cluster, dict[str, str]],
) -> None:
    c, tokens = limited
    answers: list[httpx.Response] = []
    stop = threading.Event()

    def flood() -> None:
        with httpx.Client(headers={"Authorization": f"Bearer {tokens['flood']}"}, timeout=30) as http:
            while not stop.is_set():
                answers.append(http.post(f"{c.url}/v1/tasks", json={"capability": "count", "input": {}}))

    flooder = threading.Thread(target=flood)
    started = time.monotonic()
    flooder.start()
    try:
        calm = [post(c, tokens["calm"], {"capability": "count", "input": {"n": i}}) for i in range(10)]
        assert [r.status_code for r in calm] == [201] * 10
        done = [wait_done(c, tokens["calm"], r.json()["id"]) for r in calm]
        assert [t["state"] for t in done] == ["succeeded"] * 10
    finally:
        stop.set()
        flooder.join(timeout=30)
    elapsed = time.monotonic() - started
    codes = [r.status_code for r in answers]
    assert set(codes) <= {201, 429} and 429 in codes
    # 5 a second with a burst of 5: whatever the flood, no more than that was accepted
    assert codes.count(201) <= 5 + 5 * elapsed + 1
    refused = next(r for r in answers if r.status_code == 429)
    assert int(refused.headers["Retry-After"]) >= 1
    error = refused.json()["error"]
    assert (
        error["type"] == "rate_limited"
        and 0 < error["retry_after_s"] <= 1
        and "submit_per_s" in error["message"]
    )


def test_the_sdk_and_the_cli_wait_out_a_429(limited: tuple[Cluster, dict[str, str]]) -> None:
    c, tokens = limited
    with Client(c.url, tokens["sdk"], rate_limit_wait_s=0) as impatient:
        with pytest.raises(RateLimited) as caught:
            for i in range(20):
                impatient.submit("count", {"n": i})
        assert caught.value.retry_after_s > 0
    with Client(c.url, tokens["sdk"]) as patient:  # the bucket is empty now: these must wait their turn
        ids = [patient.submit("count", {"n": i}).id for i in range(8)]
    assert len(set(ids)) == 8
    # one submission a 5 s: after this one, the CLI's own submission meets a 429 and must wait its turn
    assert post(c, tokens["slow"], {"capability": "count"}).status_code == 201
    cli = subprocess.run([sys.executable, "-m", "turnout.cli", "submit", "count", "--input", "{}"],
                         env={**c.env, "TURNOUT_TOKEN": tokens["slow"]}, capture_output=True, text=True, timeout=60,
                         stdin=subprocess.DEVNULL)  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert "rate limited" in cli.stderr and "Traceback" not in cli.stderr


def test_a_tenant_at_its_gpu_quota_waits_queued_and_all_its_gpu_tasks_succeed(
    limited: tuple[Cluster, dict[str, str]],
) -> None:
    c, tokens = limited
    quota = [post(c, tokens["quota"], {"capability": "work", "gpu": "require", "input": {"sleep": 0.6}}).json()
             for _ in range(3)]  # fmt: skip
    done = [wait_done(c, tokens["quota"], t["id"]) for t in quota]
    assert [t["state"] for t in done] == ["succeeded"] * 3  # held queued, never failed
    assert all(t["attempts"] == 1 and t["device"] == "gpu" for t in done)
    # control: with both GPUs free, a tenant without a quota takes both at once (one batch, one lease)
    calm = httpx.post(f"{c.url}/v1/tasks/batch", headers={"Authorization": f"Bearer {tokens['calm']}"}, timeout=30,
                      json={"tasks": [{"capability": "work", "gpu": "require", "input": {"sleep": 0.6}}] * 2}).json()  # fmt: skip
    calm_done = [wait_done(c, tokens["calm"], t["id"]) for t in calm["tasks"]]
    assert [t["state"] for t in calm_done] == ["succeeded"] * 2

    def peak(tenant: str) -> int:
        records = c.api("GET", "/v1/audit", params={"tenant": tenant, "limit": 10_000}).json()["audit"]
        # ISO 8601 UTC times sort as text; at a tie, a release before an allocation (-1 before 1)
        moves = sorted([(r["start"], 1) for r in records if r["kind"] == "gpu_allocated"]
                       + [(r["end"], -1) for r in records if r["kind"] == "gpu_released"])  # fmt: skip
        level = top = 0
        for _, step in moves:
            level += step
            top = max(top, level)
        return top

    assert peak("quota") == 1  # two GPUs were free, max_gpus 1 held the tenant to one
    assert peak("calm") == 2  # a tenant without a quota had both at once


def test_gpu_allocations_per_min_refuses_gpu_only_work_and_sends_the_rest_to_the_cpu(
    limited: tuple[Cluster, dict[str, str]],
) -> None:
    c, tokens = limited
    first = [post(c, tokens["gpurate"], {"capability": "work", "gpu": "require"}) for _ in range(2)]
    assert [r.status_code for r in first] == [201, 201]
    third = post(c, tokens["gpurate"], {"capability": "work", "gpu": "require"})
    assert third.status_code == 429
    assert (
        third.json()["error"]["field"] == "gpu"
        and "gpu_allocations_per_min" in third.json()["error"]["message"]
    )
    assert 25 <= int(third.headers["Retry-After"]) <= 30  # one allocation every 30 s
    assert [wait_done(c, tokens["gpurate"], r.json()["id"])["device"] for r in first] == ["gpu", "gpu"]
    # the allocator itself holds the tenant too: a task that may fall back goes to the CPU, saying why
    fallback = post(c, tokens["gpurate"], {"capability": "work", "gpu": "prefer", "gpu_wait_s": 0})
    assert fallback.status_code == 201
    task = wait_done(c, tokens["gpurate"], fallback.json()["id"])
    assert task["device"] == "cpu" and "gpu_allocations_per_min" in task["routing"]["reason"]


def test_a_pipeline_run_is_one_submission_and_its_later_stages_are_not_rate_limited(
    limited: tuple[Cluster, dict[str, str]],
) -> None:
    c, tokens = limited
    auth = {"Authorization": f"Bearer {tokens['piped']}"}
    started = httpx.post(
        f"{c.url}/v1/pipelines/triple/runs", json={"input": {"n": 1}}, headers=auth, timeout=30
    )
    assert started.status_code == 201, started.text
    again = httpx.post(f"{c.url}/v1/pipelines/triple/runs", json={"input": {}}, headers=auth, timeout=30)
    assert (
        again.status_code == 429 and "submit_per_s" in again.json()["error"]["message"]
    )  # the run took the token
    run = httpx.get(f"{c.url}/v1/pipeline-runs/{started.json()['id']}", params={"wait": 30}, headers=auth,
                    timeout=60).json()  # fmt: skip
    # its three stages were queued by the controller, not through the door: none met the empty bucket
    assert run["state"] == "succeeded" and [s["state"] for s in run["stages"]] == ["succeeded"] * 3
    assert run["tenant"] == "piped"


def test_limits_are_validated_at_startup_naming_the_file_and_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "turnout.yaml"
    bad.write_text('limits:\n  "*": {submit_per_s: 200}\n  acme: {submit_per_sec: 5}\n')
    out = subprocess.run([sys.executable, "-m", "turnout.cli", "controller", "--config", str(bad), "--home", str(tmp_path),
                          "--db", f"sqlite:///{tmp_path / 'x.db'}"], capture_output=True, text=True, timeout=60,
                         stdin=subprocess.DEVNULL)  # fmt: skip
    assert out.returncode == 2
    assert (
        str(bad) in out.stderr
        and "limits.acme.submit_per_sec" in out.stderr
        and "Traceback" not in out.stderr
    )
