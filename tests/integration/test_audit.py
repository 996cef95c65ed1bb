"""The audit log after a workload with kills, cancels and timeouts: every GPU allocation has exactly one
release, and who used which GPU, when and for how long is all there."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from typing import Any

from tests.conftest import Cluster

APP = "tests.apps.testapp:app"


def until(what: str, check: Callable[[], Any], timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def at(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def gpu_task(c: Cluster, **input: Any) -> str:
    return str(c.submit("work", input, gpu="require", max_retries=2)["id"])


def test_every_gpu_allocation_has_exactly_one_release_after_kills_cancels_and_timeouts(
    cluster: Cluster,
) -> None:
    a = cluster.start_worker(APP, gpus="fake:2x24Gi", name="a")
    shorts = [gpu_task(cluster, sleep=0.2) for _ in range(4)]
    timed_out = cluster.submit("work", {"sleep": 30}, gpu="require", timeout_s=1, max_retries=0)["id"]
    long1, long2 = gpu_task(cluster, sleep=30), gpu_task(cluster, sleep=30)
    never = cluster.submit("work", {}, gpu="require", resources={"gpu_model": "H100"})[
        "id"
    ]  # no such GPU here

    state = lambda tid: cluster.api("GET", f"/v1/tasks/{tid}").json()  # noqa: E731
    assert [cluster.result(t)["state"] for t in shorts] == ["succeeded"] * 4
    assert cluster.result(timed_out)["error"]["type"] == "timeout"
    until(
        "both long tasks to hold a GPU on a",
        lambda: all(state(t)["state"] in ("leased", "running") for t in (long1, long2)),
    )
    assert cluster.api("POST", f"/v1/tasks/{long1}/cancel").json()["state"] == "cancelled"

    os.killpg(a.pid, signal.SIGKILL)  # worker a dies holding long2's GPU
    a.wait(timeout=10)
    until(
        "long2 to be re-queued", lambda: state(long2)["state"] == "queued" and state(long2)["attempts"] == 1
    )
    cluster.start_worker(APP, gpus="fake:1x24Gi", name="b")
    until(
        "long2 to run again on b",
        lambda: state(long2)["state"] in ("leased", "running") and state(long2)["attempts"] == 2,
    )
    assert cluster.api("POST", f"/v1/tasks/{long2}/cancel").json()["state"] == "cancelled"
    last = gpu_task(cluster, sleep=0.1)
    assert cluster.result(last)["state"] == "succeeded"
    assert cluster.api("POST", f"/v1/tasks/{never}/cancel").json()["state"] == "cancelled"

    out = cluster.cli("audit", "--jsonl")
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines()]
    allocated = {(r["task"], r["attempt"]): r for r in records if r["kind"] == "gpu_allocated"}
    released = Counter((r["task"], r["attempt"]) for r in records if r["kind"] == "gpu_released")
    assert len(allocated) == sum(1 for r in records if r["kind"] == "gpu_allocated")  # one per attempt
    assert dict(released) == dict.fromkeys(allocated, 1)  # exactly one release per allocation, none extra
    assert {task for task, _ in allocated} == {*shorts, timed_out, long1, long2, last}
    assert {attempt for task, attempt in allocated if task == long2} == {1, 2}
    workers = {w["name"]: w["id"] for w in cluster.api("GET", "/v1/workers").json()["workers"]}
    for r in records:
        if r["kind"] == "gpu_released":
            grant = allocated[(r["task"], r["attempt"])]
            assert r["gpus"] == grant["gpus"] and r["gpus"][0].startswith("GPU-")
            assert r["worker"] == grant["worker"] and r["tenant"] == "default"
            assert r["start"] == grant["start"] <= r["end"]  # ISO 8601 UTC: ordered as text
            assert abs(r["seconds"] - (at(r["end"]) - at(r["start"]))) < 1e-3
            assert r["memory_bytes"] == 24 * 2**30
    assert allocated[(long2, 2)]["worker"] == workers["b"] != allocated[(long2, 1)]["worker"]
    cancelled = {r["task"] for r in records if r["kind"] == "task_cancelled"}
    assert cancelled == {long1, long2, never}
    assert [r["kind"] for r in records if r.get("worker") == allocated[(long2, 1)]["worker"]
            and r["kind"].startswith("worker_")] == ["worker_registered", "worker_lost"]  # fmt: skip
    assert any(r["kind"] == "worker_registered" and r["worker"] == workers["b"] for r in records)
    assert any(r["kind"] == "token_created" and r["tenant"] is None and r["by"] == "turnout" for r in records)
    assert cluster.api("DELETE", "/v1/audit").status_code == 405  # append-only: nothing edits or deletes it


def test_audit_filters_by_kind_and_time_and_exports_jsonl(cluster: Cluster) -> None:
    made = cluster.api("POST", "/v1/tokens", json={"role": "read", "tenant": "acme"}).json()
    cluster.api("DELETE", f"/v1/tokens/{made['id']}")
    mid = cluster.api("GET", "/v1/audit").json()["audit"][-1]["ts"]
    cluster.api("POST", "/v1/tokens", json={"role": "read", "tenant": "globex"})
    kinds = cluster.api("GET", "/v1/audit", params={"kind": "token_revoked"}).json()["audit"]
    assert len(kinds) == 1 and kinds[0]["tenant"] == "acme" and kinds[0]["by"].startswith("k_")
    later = cluster.api("GET", "/v1/audit", params={"since": mid}).json()["audit"]
    assert [r["kind"] for r in later] == ["token_revoked", "token_created"]
    assert cluster.api("GET", "/v1/audit", params={"kind": "tokens"}).json()["error"]["field"] == "kind"
    assert cluster.api("GET", "/v1/audit", params={"since": "yesterday"}).json()["error"]["field"] == "since"
    out = cluster.cli("audit", "--jsonl", "--tenant", "globex")
    assert [json.loads(line)["tenant"] for line in out.stdout.splitlines()] == ["globex"]
    page = cluster.api("GET", "/v1/audit", params={"limit": 2}).json()
    rest = cluster.api("GET", "/v1/audit", params={"cursor": page["next_cursor"]}).json()
    everything = cluster.api("GET", "/v1/audit").json()["audit"]
    assert [r["id"] for r in page["audit"] + rest["audit"]] == [r["id"] for r in everything]
