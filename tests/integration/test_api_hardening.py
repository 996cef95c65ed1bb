"""What the API refuses, and how: values JSON cannot carry (422 naming the field), oversized requests (413
naming the limit, decided before the body is read whole), reused idempotency keys (409), and capabilities no
worker ever registered (422 with close matches). Nothing refused leaves a trace that breaks later reads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.conftest import Cluster, Processes

APP = "tests.apps.testapp:app"
MiB = 1024**2


@pytest.fixture(scope="module")
def api(shared_cluster: Cluster) -> Cluster:
    shared_cluster.start_worker(APP, name="hardening-worker")
    return shared_cluster


def post_raw(api: Cluster, path: str, body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    """POST bytes as written: the JSON libraries refuse to write what these tests send."""
    headers = {"Authorization": f"Bearer {api.token}", "Content-Type": "application/json", **(headers or {})}
    return httpx.post(f"{api.url}{path}", content=body, headers=headers, timeout=60)


def fake_worker(api: Cluster, capability: str) -> tuple[str, dict[str, str]]:
    """A worker registered over HTTP only (no process), enough to post events and results as one: its id, and
    the header that proves it is that worker."""
    body = {"name": f"fake-{capability}", "host": "nowhere", "cpu": 1, "memory": 2**30,
            "variants": [{"capability": capability, "device": "cpu", "resources": {"cpu": 1}}]}  # fmt: skip
    resp = api.api("POST", "/v1/workers/register", json=body)
    assert resp.status_code == 201, resp.text
    return str(resp.json()["id"]), {"X-Worker-Secret": resp.json()["secret"]}


def task_count(api: Cluster) -> int:
    resp = api.api("GET", "/v1/tasks", params={"limit": 1000})
    assert resp.status_code == 200, resp.text  # listing works: nothing unservable was stored
    return len(resp.json()["tasks"])


# ---- values JSON cannot carry ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/tasks", rb'{"capability": "count", "timeout_s": Infinity}', "timeout_s"),
        ("/v1/tasks", rb'{"capability": "count", "gpu_wait_s": NaN}', "gpu_wait_s"),
        ("/v1/tasks", rb'{"capability": "count", "input": {"x": NaN}}', "input.x"),
        ("/v1/tasks", rb'{"capability": "count", "input": [1, {"y": -Infinity}]}', "input.1.y"),
        ("/v1/tasks", rb'{"capability": "count", "input": {"big": 1e400}}', "input.big"),
        ("/v1/tasks", rb'{"capability": "count", "input": {"s": "\ud800"}}', "input.s"),
        ("/v1/tasks", rb'{"capability": "count", "labels": {"team": "\udfff"}}', "labels.team"),
        ("/v1/tasks", rb'{"capability": "count", "idempotency_key": "k\ud800"}', "idempotency_key"),
        ("/v1/tasks/batch", rb'{"tasks": [{"capability": "count"}, {"capability": "count", "input": {"x": NaN}}]}',
         "tasks.1.input.x"),
    ],
)  # fmt: skip
def test_values_json_cannot_carry_are_422_naming_the_field_and_nothing_is_stored(
    api: Cluster, path: str, body: bytes, field: str
) -> None:
    before = task_count(api)
    resp = post_raw(api, path, body)
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"] == {
        "type": "invalid_input",
        "field": field,
        "message": resp.json()["error"]["message"],
    }
    assert resp.json()["error"]["message"].startswith(f"{field}: ")
    assert task_count(api) == before


def test_a_lone_surrogate_in_a_label_key_is_named_in_a_response_that_can_be_read(api: Cluster) -> None:
    resp = post_raw(api, "/v1/tasks", rb'{"capability": "count", "labels": {"\udfff": "x"}}')
    assert resp.status_code == 422
    assert resp.json()["error"]["field"] == "labels.\\udfff"


def test_bodies_that_are_not_utf8_json_are_422s(api: Cluster) -> None:
    for body in (
        b"\xff\xfe{}",
        b"[" * 100_000 + b"]" * 100_000,
        b'{"capability": "count", "input": ' + b"7" * 5000 + b"}",
    ):
        resp = post_raw(api, "/v1/tasks", body)
        assert resp.status_code == 422, resp.text[:200]
        assert resp.json()["error"]["field"] == "body"


def test_worker_events_and_results_holding_nan_are_422_naming_the_field(api: Cluster) -> None:
    worker_id, me = fake_worker(api, "nan-reports")
    events = rb'{"events": [{"task_id": "t_x", "attempt": 1, "event": {"event": "progress", "done": NaN}}]}'
    resp = post_raw(api, f"/v1/workers/{worker_id}/events", events, me)
    assert (resp.status_code, resp.json()["error"]["field"]) == (422, "events.0.event.done")
    results = rb'{"results": [{"task_id": "t_x", "attempt": 1, "status": "succeeded", "output": {"score": Infinity}}]}'
    resp = post_raw(api, f"/v1/workers/{worker_id}/complete", results, me)
    assert (resp.status_code, resp.json()["error"]["field"]) == (422, "results.0.output.score")


def test_the_sdk_names_the_field_of_a_nan_before_sending(api: Cluster) -> None:
    from turnout import Client
    from turnout.errors import InvalidInput

    with Client(api.url, api.token) as client, pytest.raises(InvalidInput) as caught:
        client.submit("count", {"x": float("nan")})
    assert caught.value.field == "input.x"


# ---- size limits -----------------------------------------------------------------------------------


def test_an_input_over_max_input_bytes_is_413_naming_the_limit(api: Cluster) -> None:
    resp = api.api("POST", "/v1/tasks", json={"capability": "count", "input": {"blob": "x" * (MiB + 1)}})
    assert resp.status_code == 413
    err = resp.json()["error"]
    assert (err["type"], err["field"]) == ("payload_too_large", "input")
    assert "limit 1 MiB (max_input_bytes)" in err["message"]


def test_too_many_labels_or_a_long_label_is_413_naming_the_limit(api: Cluster) -> None:
    many = api.api(
        "POST", "/v1/tasks", json={"capability": "count", "labels": {f"k{i}": "v" for i in range(33)}}
    )
    assert (many.status_code, many.json()["error"]["field"]) == (413, "labels")
    assert "(max_labels)" in many.json()["error"]["message"]
    batch = {"tasks": [{"capability": "count"}, {"capability": "count", "labels": {"team": "x" * 257}}]}
    long = api.api("POST", "/v1/tasks/batch", json=batch)
    assert (long.status_code, long.json()["error"]["field"]) == (413, "tasks.1.labels.team")
    assert "(max_label_bytes)" in long.json()["error"]["message"]


def test_an_event_batch_over_max_events_per_request_is_413(api: Cluster) -> None:
    worker_id, me = fake_worker(api, "chatty")
    items = [{"task_id": "t_x", "attempt": 1, "event": {"event": "log"}}] * 10_001
    resp = api.api("POST", f"/v1/workers/{worker_id}/events", json={"events": items}, headers=me)
    assert (resp.status_code, resp.json()["error"]["field"]) == (413, "events")
    assert "limit 10000 (max_events_per_request)" in resp.json()["error"]["message"]


def test_a_declared_content_length_over_the_limit_is_refused_before_the_body_is_read(api: Cluster) -> None:
    body = b'{"capability": "count", "input": "' + b"x" * (9 * MiB) + b'"}'
    resp = post_raw(api, "/v1/tasks", body)
    assert resp.status_code == 413
    err = resp.json()["error"]
    assert err["type"] == "payload_too_large"
    assert "limit 8 MiB (max_body_bytes)" in err["message"]
    assert resp.headers["content-type"] == "application/json"


def _endless_json(total: int, chunk: int = MiB) -> Iterator[bytes]:
    """A body with no Content-Length: the controller can only count it as it streams."""
    yield b'{"capability": "count", "input": "'
    for _ in range(total // chunk):
        yield b"x" * chunk
    yield b'"}'


def test_200_mb_bodies_streamed_at_once_are_413_while_rss_stays_small_and_a_worker_stays_healthy(
    api: Cluster,
) -> None:
    # Given a healthy worker running a task, and the controller's memory now
    controller = psutil.Process(api.controller.pid if api.controller else 0)
    baseline = controller.memory_info().rss
    worker = api.wait_for_worker("hardening-worker")
    running = api.submit("count", {"sleep": 6})
    peak = baseline
    done = threading.Event()

    def watch_rss() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, controller.memory_info().rss)
            done.wait(0.02)

    answers: list[Any] = []

    def upload() -> None:
        headers = {"Authorization": f"Bearer {api.token}", "Content-Type": "application/json"}
        try:
            resp = httpx.post(
                f"{api.url}/v1/tasks", content=_endless_json(200 * MiB), headers=headers, timeout=120
            )
            answers.append((resp.status_code, resp.json()["error"]))
        except httpx.HTTPError as exc:
            answers.append(exc)

    # When three 200 MB bodies stream in at once
    watcher = threading.Thread(target=watch_rss, daemon=True)
    uploads = [threading.Thread(target=upload, daemon=True) for _ in range(3)]
    watcher.start()
    for t in uploads:
        t.start()
    for t in uploads:
        t.join(timeout=120)
    done.set()
    watcher.join(timeout=5)

    # Then each is refused with a 413 naming the limit, and memory grew by far less than one body
    assert len(answers) == 3 and all(isinstance(a, tuple) for a in answers), answers
    for status, error in answers:
        assert status == 413
        assert error["type"] == "payload_too_large" and "limit 8 MiB (max_body_bytes)" in error["message"]
    assert peak - baseline < 64 * MiB, f"controller RSS grew {(peak - baseline) / MiB:.0f} MiB"
    # ... and the worker never missed its heartbeats: still healthy, its task never lost and re-queued
    after = next(w for w in api.api("GET", "/v1/workers").json()["workers"] if w["id"] == worker["id"])
    assert after["state"] == "healthy"
    task = api.api("GET", f"/v1/tasks/{running['id']}").json()
    assert task["attempts"] <= 1 and task["state"] in ("queued", "leased", "running", "succeeded"), task


# ---- idempotency -----------------------------------------------------------------------------------


def test_a_reused_idempotency_key_returns_the_first_task_for_the_same_body_and_409_for_another(
    api: Cluster,
) -> None:
    body = {"capability": "count", "input": {"n": 1}, "idempotency_key": "order-7", "labels": {"a": "b"}}
    first = api.api("POST", "/v1/tasks", json=body)
    again = api.api("POST", "/v1/tasks", json=body)
    assert first.status_code == again.status_code == 201
    assert again.json()["id"] == first.json()["id"]
    other = api.api("POST", "/v1/tasks", json={**body, "input": {"n": 2}})
    assert other.status_code == 409
    err = other.json()["error"]
    assert (err["type"], err["field"]) == ("conflict", "idempotency_key")
    assert first.json()["id"] in err["message"]


def test_a_batch_reusing_a_key_for_another_body_is_409_naming_the_task_and_stores_nothing(
    api: Cluster,
) -> None:
    before = task_count(api)
    batch = {"tasks": [{"capability": "count", "input": {"n": 1}},
                       {"capability": "count", "input": {"n": 2}, "idempotency_key": "dup"},
                       {"capability": "count", "input": {"n": 3}, "idempotency_key": "dup"}]}  # fmt: skip
    resp = api.api("POST", "/v1/tasks/batch", json=batch)
    assert (resp.status_code, resp.json()["error"]["field"]) == (409, "tasks.2.idempotency_key")
    assert task_count(api) == before


def test_the_sdk_raises_conflict_and_payload_too_large_as_their_classes(api: Cluster) -> None:
    from turnout import Client
    from turnout.errors import Conflict, PayloadTooLarge

    with Client(api.url, api.token) as client:
        client.submit("count", {"n": 1}, idempotency_key="sdk-key")
        with pytest.raises(Conflict) as conflict:
            client.submit("count", {"n": 2}, idempotency_key="sdk-key")
        assert conflict.value.field == "idempotency_key"
        with pytest.raises(PayloadTooLarge) as too_large:
            client.submit("count", {"blob": "x" * (2 * MiB)})
        assert "max_input_bytes" in too_large.value.message


# ---- capabilities no worker ever registered --------------------------------------------------------


def test_a_capability_no_worker_ever_registered_is_422_at_once_naming_close_matches(api: Cluster) -> None:
    resp = api.api("POST", "/v1/tasks", json={"capability": "cuont", "input": {}})
    assert resp.status_code == 422
    err = resp.json()["error"]
    assert err["field"] == "capability"
    assert "did you mean 'count'" in err["message"] and "placement_timeout_s" in err["message"]
    batch = api.api(
        "POST", "/v1/tasks/batch", json={"tasks": [{"capability": "count"}, {"capability": "nope"}]}
    )
    assert (batch.status_code, batch.json()["error"]["field"]) == (422, "tasks.1.capability")


def test_setting_placement_timeout_s_queues_a_capability_for_workers_yet_to_come(api: Cluster) -> None:
    resp = api.api("POST", "/v1/tasks", json={"capability": "future-model", "placement_timeout_s": 600})
    assert resp.status_code == 201
    assert resp.json()["state"] == "queued"


def test_a_capability_stays_known_after_its_last_worker_left(api: Cluster) -> None:
    worker_id, me = fake_worker(api, "scaled-to-zero")
    assert api.api("POST", f"/v1/workers/{worker_id}/leave", headers=me).status_code == 200
    resp = api.api("POST", "/v1/tasks", json={"capability": "scaled-to-zero", "input": {}})
    assert resp.status_code == 201
    assert resp.json()["state"] == "queued"


def test_turnout_submit_of_an_unknown_capability_fails_at_once_with_the_suggestion(api: Cluster) -> None:
    out = api.cli("submit", "cout", "--input", "{}", "--wait", timeout=30)
    assert out.returncode != 0
    assert "did you mean 'count'" in out.stderr  # refused by the API, not failed no_capacity a minute later


# ---- what once answered 500 (found by reading and by Schemathesis) ---------------------------------


@pytest.fixture(scope="module")
def ids(api: Cluster) -> dict[str, str]:
    """A worker registered over HTTP and a finished task, to aim requests past a 404."""
    task = api.submit("count", {"n": 1}, placement_timeout_s=600)
    api.api("POST", f"/v1/tasks/{task['id']}/cancel")
    worker_id, me = fake_worker(api, "aim")
    return {"worker": worker_id, "task": task["id"], "secret": me["X-Worker-Secret"]}


GPU = {"index": 0, "uuid": "GPU-1", "name": "X", "memory_total_bytes": 2**30}
REGISTER = {"name": "g", "host": "h", "cpu": 1, "memory": 2**30,
            "variants": [{"capability": "aim", "device": "gpu", "resources": {"gpu": 1}}]}  # fmt: skip


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "field"),
    [
        ("POST", "/v1/tasks", {"json": {"capability": "count", "resources": {"memory": "9" * 400 + "Gi"}}},
         "resources.memory"),
        ("GET", "/v1/tasks/{task}/events", {"headers": {"Last-Event-ID": b"\xb2"}}, "Last-Event-ID"),
        ("GET", "/v1/tasks/{task}/events", {"headers": {"Last-Event-ID": "9" * 5000}}, "Last-Event-ID"),
        ("GET", "/v1/tasks/{task}/events", {"params": {"after": 2**31}}, "after"),
        ("GET", "/v1/tasks/t_%00x", {}, "task_id"),
        ("GET", "/v1/tasks", {"params": {"cursor": "a\x00b"}}, "cursor"),
        ("POST", "/v1/workers/register", {"json": {**REGISTER, "gpus": [{}]}}, "gpus.0.index"),
        ("POST", "/v1/workers/register", {"json": {**REGISTER, "gpus": [{**GPU, "colour": "red"}]}}, "gpus.0"),
        ("POST", "/v1/workers/register", {"json": {**REGISTER, "name": "a\x00b"}}, "name"),
        ("POST", "/v1/workers/{worker}/heartbeat", {"json": {"metrics": {"gpus": [1]}}}, "metrics.gpus.0"),
        ("POST", "/v1/workers/{worker}/heartbeat", {"json": {"metrics": {"gpus": [{"uuid": "G", "temperature_c": "hot"}]}}},
         "metrics.gpus.0.temperature_c"),
        ("POST", "/v1/workers/{worker}/lease", {"json": {"wait_s": 0, "running": ["t\x00"]}}, "running.0"),
        ("POST", "/v1/workers/{worker}/complete",
         {"json": {"results": [{"task_id": "t_x", "attempt": 1, "status": "succeeded", "started_at": 1e20}]}},
         "results.0.started_at"),
        ("POST", "/v1/workers/{worker}/complete",
         {"json": {"results": [{"task_id": "t_x", "attempt": 1, "status": "succeeded", "run_s": 1e300}]}},
         "results.0.run_s"),
        ("POST", "/v1/workers/{worker}/complete",
         {"json": {"results": [{"task_id": "t_x", "attempt": 2**31, "status": "failed"}]}}, "results.0.attempt"),
        ("POST", "/v1/workers/{worker}/complete",
         {"json": {"results": [{"task_id": "t\x00", "attempt": 1, "status": "failed"}]}}, "results.0.task_id"),
        ("POST", "/v1/workers/{worker}/events",
         {"json": {"events": [{"task_id": "t\x00", "attempt": 1, "event": {}}]}}, "events.0"),
        ("POST", "/v1/tokens", {"json": {"role": "read", "tenant": "t" * 65}}, "tenant"),
    ],
)  # fmt: skip
def test_requests_that_once_answered_500_are_422_naming_the_field(
    api: Cluster, ids: dict[str, str], method: str, path: str, kwargs: dict[str, Any], field: str
) -> None:
    headers = {"Authorization": f"Bearer {api.token}", **kwargs.pop("headers", {})}
    if "{worker}" in path:  # the worker itself: its token and its secret
        headers["X-Worker-Secret"] = ids["secret"]
    resp = httpx.request(method, f"{api.url}{path.format(**ids)}", headers=headers, timeout=60, **kwargs)
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"]["field"] == field
    assert api.api("GET", "/v1/workers").status_code == 200  # nothing stored that breaks a listing


# ---- limits are settable ---------------------------------------------------------------------------


def test_limits_are_set_from_the_config_file_and_flags(tmp_path: Path, processes: Processes) -> None:
    config = tmp_path / "turnout.yaml"
    config.write_text("request_limits:\n  max_input_bytes: 2Ki\n  max_body_bytes: 1Mi\n")
    limited = Cluster(tmp_path, processes, f"sqlite:///{tmp_path / 'turnout.db'}",
                      extra_args=["--config", str(config), "--request-limit", "max_body_bytes=64Ki"])  # fmt: skip
    limited.start_controller()
    small = limited.api(
        "POST", "/v1/tasks", json={"capability": "x", "input": "y" * 3000, "placement_timeout_s": 9}
    )
    assert small.status_code == 413 and "limit 2 KiB (max_input_bytes)" in small.json()["error"]["message"]
    large = post_raw(limited, "/v1/tasks", b'{"capability": "x", "input": "' + b"y" * 70_000 + b'"}')
    assert large.status_code == 413 and "limit 64 KiB (max_body_bytes)" in large.json()["error"]["message"]


def test_a_bad_limit_flag_stops_the_controller_with_a_message_not_a_traceback(cluster: Cluster) -> None:
    out = cluster.cli("controller", "--port", "1", "--request-limit", "max_bodee_bytes=1Mi", timeout=30)
    assert out.returncode == 2
    assert "max_bodee_bytes: unknown limit" in out.stderr and "Traceback" not in out.stderr
