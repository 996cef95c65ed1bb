"""Per-tenant rate limits, GPU quotas and reserved shares from turnout.yaml, on a real controller and worker.

Tenants here: `flood` and `sdk` get the default (5 submissions a second), `calm` and `burst` a high rate, `quota` at
most one GPU at a time, `gpurate` two GPU allocations a minute, `slow`, `piped` and `door` one submission
in 5 s. A second cluster keeps a quarter of its shared worker for each tenant with work. Tests only check
correctness; how well the calm tenant's latency holds up under a flood is measured in bench/bench_tenants.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
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
  door:    {submit_per_s: 0.2}
  burst:   {submit_per_s: 1000}
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
        for tenant in ("flood", "sdk", "calm", "quota", "gpurate", "slow", "piped", "door", "burst"):
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


def test_a_tenants_backlog_of_accepted_submissions_does_not_hold_back_another_tenants_tasks(
    limited: tuple[Cluster, dict[str, str]],
) -> None:
    """Given a tenant within its (high) rate submitting from many connections at once, so its submissions pile
    up on the controller's database thread, when a calm tenant submits meanwhile, then the calm tenant's tasks
    all complete while the burst goes on, and every submission the burst tenant was told was accepted is stored
    (each tenant's submissions wait in a lane of their own, lanes.Lanes)."""
    c, tokens = limited
    accepted: list[str] = []
    answers: list[int] = []
    stop = threading.Event()

    def burst() -> None:
        with httpx.Client(headers={"Authorization": f"Bearer {tokens['burst']}"}, timeout=60) as http:
            while not stop.is_set():
                resp = http.post(f"{c.url}/v1/tasks", json={"capability": "count", "input": {}})
                answers.append(resp.status_code)
                if resp.status_code == 201:
                    accepted.append(resp.json()["id"])

    bursts = [threading.Thread(target=burst) for _ in range(6)]
    for thread in bursts:
        thread.start()
    try:
        deadline = time.monotonic() + 60
        while len(accepted) < 20 and time.monotonic() < deadline:  # the burst is under way
            time.sleep(0.05)
        assert len(accepted) >= 20, f"the burst got {len(accepted)} submissions in: {sorted(set(answers))}"
        calm = [post(c, tokens["calm"], {"capability": "count", "input": {"n": i}}) for i in range(5)]
        assert [r.status_code for r in calm] == [201] * 5
        done = [wait_done(c, tokens["calm"], r.json()["id"]) for r in calm]
        assert [t["state"] for t in done] == ["succeeded"] * 5
        assert not stop.is_set() and all(thread.is_alive() for thread in bursts)  # it went on throughout
    finally:
        stop.set()
        for thread in bursts:
            thread.join(timeout=60)
    assert set(answers) <= {201, 429}
    with httpx.Client(headers={"Authorization": f"Bearer {tokens['burst']}"}, timeout=30) as http:
        stored: set[str] = set()
        for state in ("queued", "leased", "running", "succeeded"):
            cursor = None
            while True:
                page = http.get(f"{c.url}/v1/tasks", params={"state": state, "limit": 1000,
                                                             **({"cursor": cursor} if cursor else {})}).json()  # fmt: skip
                stored |= {t["id"] for t in page["tasks"]}
                if state == "queued":  # the shared pool serves the next tests: the burst's backlog goes
                    for t in page["tasks"]:
                        http.post(f"{c.url}/v1/tasks/{t['id']}/cancel")
                cursor = page["next_cursor"]
                if cursor is None:
                    break
    assert set(accepted) <= stored


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


def raw_http(port: int, request: bytes, body: bytes = b"") -> tuple[socket.socket, bytes]:
    """Send a request's head (and what there is of its body) on a fresh connection; the whole answer."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn.sendall(request + body)
    return conn, read_answer(conn)


def read_answer(conn: socket.socket) -> bytes:
    """One HTTP answer, head and `Content-Length` body, however many segments it arrives in."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_a_submission_over_the_rate_is_refused_before_its_body_is_read(
    limited: tuple[Cluster, dict[str, str]],
) -> None:
    """Given a tenant over submit_per_s, when it sends a submission's head promising a body it never
    sends, then the 429 comes at once (the route would wait for the body), as the route would answer it,
    and the connection carries the next request once the promised bytes have come."""
    c, tokens = limited
    assert post(c, tokens["door"], {"capability": "count"}).status_code == 201  # the one token of 5 s
    head = (f"POST /v1/tasks HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {tokens['door']}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n").encode()  # fmt: skip
    conn, answer = raw_http(c.port, head)
    try:
        status, _, rest = answer.partition(b"\r\n")
        assert status.startswith(b"HTTP/1.1 429"), answer[:300]
        headers, _, body = rest.partition(b"\r\n\r\n")
        assert b"retry-after: 5" in headers.lower() or b"retry-after: 4" in headers.lower()
        error = json.loads(body)["error"]
        assert error["type"] == "rate_limited" and "'door' is over its submit_per_s" in error["message"]
        assert 0 < error["retry_after_s"] <= 5
        conn.sendall(b"x" * 100000 + b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_answer(conn).startswith(b"HTTP/1.1 200")  # the unread body was discarded, not parsed
    finally:
        conn.close()
    # the door decides nothing it is unsure of: a role that may not submit is still told so (403)
    reader = c.api("POST", "/v1/tokens", json={"role": "read", "tenant": "door"}).json()["token"]
    auth = {"Authorization": f"Bearer {reader}"}
    assert httpx.get(f"{c.url}/v1/tasks", headers=auth, timeout=30).status_code == 200  # its token is known
    refused = httpx.post(f"{c.url}/v1/tasks", headers=auth, json={"capability": "count"}, timeout=30)
    assert refused.status_code == 403
    assert post(c, "tk_not-a-token", {"capability": "count"}).status_code == 401


RESERVING = """
limits:
  "*": {submit_per_s: 1000, reserved_share: 0.25}
"""


@pytest.fixture(scope="module")
def reserving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, dict[str, str]]]:
    """A controller keeping a quarter of each shared worker for a tenant with work, and one shared worker of
    four `count` slots (0.4 CPU, 0.1 each)."""
    tmp = tmp_path_factory.mktemp("reserving")
    (tmp / "turnout.yaml").write_text(RESERVING)
    procs = Processes()
    try:
        c = Cluster(
            tmp, procs, f"sqlite:///{tmp / 'turnout.db'}", extra_args=["--config", str(tmp / "turnout.yaml")]
        )
        c.start_controller()
        c.start_worker(APP, name="pool", extra=["--cpus", "0.4"])
        tokens = {t: c.api("POST", "/v1/tokens", json={"role": "submit", "tenant": t}).json()["token"]
                  for t in ("calm", "hog")}  # fmt: skip
        yield c, tokens
    finally:
        procs.stop_all()


def test_a_tenant_with_work_keeps_a_slot_of_a_shared_worker_that_another_tenants_backlog_may_not_take(
    reserving: tuple[Cluster, dict[str, str]],
) -> None:
    """Given a calm tenant that has just submitted and a hog whose queue is deeper than the worker, when the
    calm tenant submits its next task, then it runs at once on the slot kept for it, long before any of the
    hog's tasks ends to free one; and the hog, alone with work again, uses every slot."""
    c, tokens = reserving
    first = post(c, tokens["calm"], {"capability": "count", "input": {"n": 1}}).json()["id"]
    hog = httpx.post(f"{c.url}/v1/tasks/batch", headers={"Authorization": f"Bearer {tokens['hog']}"}, timeout=30,
                     json={"tasks": [{"capability": "count", "input": {"sleep": 3}}] * 8}).json()["tasks"]  # fmt: skip
    assert wait_done(c, tokens["calm"], first)["state"] == "succeeded"
    second = post(c, tokens["calm"], {"capability": "count", "input": {"n": 2}}).json()["id"]
    calm = wait_done(c, tokens["calm"], second)
    hogs = [wait_done(c, tokens["hog"], t["id"]) for t in hog]
    assert calm["state"] == "succeeded" and [t["state"] for t in hogs] == ["succeeded"] * 8
    assert _ts(calm["finished_at"]) < min(_ts(t["finished_at"]) for t in hogs)
    # at most three of the hog's ran together while calm had work; once calm's was over, all four. Each run as
    # the worker timed it: `finished_at` is when its result reached the controller, by which time the worker
    # may have started a task it held waiting (`--prefetch auto`) in its slot
    assert _peak([(_ts(t["started_at"]), _ts(t["started_at"]) + t["run_s"]) for t in hogs]) == 4


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _peak(spans: list[tuple[float, float]]) -> int:
    moves = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    level = top = 0
    for _, step in moves:
        level += step
        top = max(top, level)
    return top
