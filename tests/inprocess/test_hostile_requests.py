"""Requests a hostile or broken client sends, found by attacking a live controller: each is refused with a 4xx
naming what is wrong, nothing of it kept, and it tells a tenant nothing about another tenant's objects.

In-process (`api/app.py` over the memory store, through `httpx.ASGITransport`): what is decided here is decided
by the routes and the door in front of them, not by the socket."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.inprocess.conftest import Api, Served
from turnout.api.audit import parse_since
from turnout.errors import InvalidInput

pytestmark = pytest.mark.anyio


async def _tasks(api: Api) -> list[dict[str, Any]]:
    resp = await api.client.get("/v1/tasks")
    assert resp.status_code == 200, resp.text
    return list(resp.json()["tasks"])


# ---- one caller, one credential -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/tasks", {"capability": "shout"}),  # the fast path
        ("POST", "/v1/tasks?wait=1", {"capability": "shout"}),
        ("POST", "/v1/tasks/batch", {"tasks": [{"capability": "shout"}]}),  # a route
        ("GET", "/v1/tasks", None),
        ("GET", "/v1/tasks/t_0123456789abcdef01234567/result", None),
    ],
)
async def test_a_request_with_two_authorization_headers_is_refused_whichever_layer_would_read_it(
    api: Api, method: str, path: str, body: dict[str, Any] | None
) -> None:
    await api.worker()
    other = await api.token("submit", "acme")
    mine = api.client.headers["authorization"]
    for pair in ([mine, f"Bearer {other}"], [f"Bearer {other}", mine], ["Bearer bogus", mine]):
        resp = await api.client.request(method, path, json=body, headers=[("Authorization", v) for v in pair])
        assert resp.status_code == 401, resp.text
        error = resp.json()["error"]
        assert error["field"] == "authorization" and "more than once" in error["message"]
        assert other not in resp.text
    assert await _tasks(api) == []  # nothing was submitted, as either caller


async def test_a_worker_call_with_two_secrets_is_refused(api: Api) -> None:
    worker = await api.worker()
    headers = [("Authorization", f"Bearer {worker.token}"), ("X-Worker-Secret", worker.secret),
               ("X-Worker-Secret", "wrong")]  # fmt: skip
    for action, body in (("lease", {"max_tasks": 1, "wait_s": 0}), ("heartbeat", {})):
        resp = await api.client.post(f"/v1/workers/{worker.id}/{action}", json=body, headers=headers)
        assert resp.status_code == 401, resp.text
        assert resp.json()["error"]["field"] == "x-worker-secret"


async def test_a_channel_opened_with_two_authorization_headers_is_closed_before_it_opens(api: Api) -> None:
    assert api.app is not None
    worker = await api.worker()
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "websocket", "asgi": {"version": "3.0"}, "scheme": "ws", "http_version": "1.1",
             "path": f"/v1/workers/{worker.id}/channel", "raw_path": b"", "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 1), "server": ("turnout", 80), "subprotocols": [],
             "headers": [(b"authorization", f"Bearer {worker.token}".encode()),
                         (b"authorization", b"Bearer bogus"), (b"x-worker-secret", worker.secret.encode())]}  # fmt: skip
    await api.app(scope, receive, send)
    assert [m["type"] for m in sent] == ["websocket.close"] and sent[0]["code"] == 1008


# ---- the audit log's query --------------------------------------------------------------------------


@pytest.mark.parametrize("cursor", [str(2**63), "99999999999999999999999"])
async def test_an_audit_cursor_past_any_record_id_is_a_422_naming_it(api: Api, cursor: str) -> None:
    resp = await api.client.get("/v1/audit", params={"cursor": cursor})
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"]["field"] == "cursor"
    ok = await api.client.get("/v1/audit", params={"cursor": str(2**63 - 1)})
    assert ok.status_code == 200 and ok.json()["audit"] == []


@pytest.mark.parametrize("since", ["NaN", "nan", "inf", "-inf", "1e400", "0001-01-01"])
async def test_an_audit_since_that_is_no_time_is_a_422_naming_it(api: Api, since: str) -> None:
    resp = await api.client.get("/v1/audit", params={"since": since})
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"]["field"] == "since"
    with pytest.raises(InvalidInput):
        parse_since(since)


def test_audit_since_takes_epoch_seconds_and_iso_times() -> None:
    assert parse_since("1700000000.5") == 1700000000.5
    assert parse_since("2026-01-01T00:00:00Z") == pytest.approx(1767225600.0 - 1e-6)


async def test_httpx_sends_both_copies_of_a_repeated_header() -> None:
    """The tests above rely on it: a list of pairs goes out as it is, not folded into one header."""
    seen: list[list[bytes]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append([v for k, v in request.headers.raw if k.lower() == b"authorization"])
        return httpx.Response(204)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler), headers={"Authorization": "x"}) as c:
        await c.get("http://t/", headers=[("Authorization", "a"), ("Authorization", "b")])
    assert seen == [[b"a", b"b"]]


# ---- what a handler sends back ------------------------------------------------------------------


async def test_an_event_name_with_line_breaks_cannot_forge_frames_in_the_event_stream(api: Api) -> None:
    worker = await api.worker()
    task = await api.submit()
    (leased,) = (await worker.lease())["tasks"]
    forged = 'text\nid: 999\ndata: {"event": "finish", "status": "completed", "output": "INJECTED"}\n\nevent: finish'
    events = [{"task_id": task["id"], "attempt": leased["attempt"], "event": {"event": forged, "content": "x"}},
              {"task_id": task["id"], "attempt": leased["attempt"], "event": {"event": "progress", "done": 1}}]  # fmt: skip
    resp = await worker.post("events", {"events": events})
    assert resp.status_code == 200, resp.text
    await worker.complete(leased, output={"ok": 1})
    stream = await api.client.get(f"/v1/tasks/{task['id']}/events")
    frames = [f for f in stream.text.split("\n\n") if f.strip()]
    parsed = [dict(line.split(": ", 1) for line in f.split("\n")) for f in frames]
    # one frame per event, in order, each with the fields a frame has and no others
    assert [set(p) for p in parsed] == [{"id", "event", "data"}] * 3
    assert [p["event"] for p in parsed] == ["message", "progress", "finish"]
    assert [json.loads(p["data"])["event"] for p in parsed] == [forged, "progress", "finish"]
    assert json.loads(parsed[-1]["data"])["output"] == {"ok": 1}


# ---- uploads ----------------------------------------------------------------------------------------

PART = b'--XX\r\nContent-Disposition: form-data; name="file"; filename="t.bin"\r\nContent-Type: application/octet-stream\r\n\r\n'


@pytest.mark.parametrize(
    "body",
    [PART + b"HELLO-PARTIAL-DATA", PART + b"HELLO\r\n--XX", PART + b"HELLO\r\n--XX-", PART],
    ids=["mid-data", "no-final-dashes", "one-dash", "headers-only"],
)
def test_a_multipart_upload_cut_short_is_refused_and_nothing_kept(
    served: Served, tmp_path: Path, body: bytes
) -> None:
    resp = served.call("POST", "/v1/files", content=body,
                       headers={"Content-Type": "multipart/form-data; boundary=XX"})  # fmt: skip
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"]["field"] == "body" and "closing boundary" in resp.json()["error"]["message"]
    objects = tmp_path / "home" / "files" / "objects"
    assert not objects.exists() or list(objects.iterdir()) == []
    whole = served.call("POST", "/v1/files", content=PART + b"HELLO\r\n--XX--\r\n",
                        headers={"Content-Type": "multipart/form-data; boundary=XX"})  # fmt: skip
    assert whole.status_code == 201, whole.text
    assert whole.json()["size"] == 5 and whole.json()["name"] == "t.bin"


def test_a_multipart_filename_with_a_nul_is_refused_as_a_name_with_one_is(served: Served) -> None:
    body = PART.replace(b"t.bin", b"a\x00b.bin") + b"HELLO\r\n--XX--\r\n"
    resp = served.call("POST", "/v1/files", content=body,
                       headers={"Content-Type": "multipart/form-data; boundary=XX"})  # fmt: skip
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"]["field"] == "file"


async def test_a_batch_reusing_a_key_with_another_body_names_the_item_not_a_task_never_made(api: Api) -> None:
    await api.worker()
    tasks = [
        {"capability": "shout", "idempotency_key": "dd"},
        {"capability": "shout", "input": 2, "idempotency_key": "dd"},
    ]
    resp = await api.client.post("/v1/tasks/batch", json={"tasks": tasks})
    assert resp.status_code == 409, resp.text
    error = resp.json()["error"]
    assert error["field"] == "tasks.1.idempotency_key"
    assert (
        "is also tasks.0.idempotency_key in this batch" in error["message"] and "t_" not in error["message"]
    )
    assert await _tasks(api) == []


# ---- what a failure tells ---------------------------------------------------------------------------


def test_an_unexpected_failure_answers_a_reference_to_the_log_and_never_the_exceptions_text(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An IntegrityError's text holds the SQL and its parameters: another tenant's id, the schema's names."""
    from sqlalchemy.exc import IntegrityError

    from turnout.api.errors import unexpected_response

    exc = IntegrityError("INSERT INTO files (id, tenant) VALUES (?, ?)", ("f_1", "beta"), Exception("UNIQUE"))
    with caplog.at_level("ERROR", logger="turnout.api"):
        resp = unexpected_response(exc)

    body = json.loads(bytes(resp.body))
    assert resp.status_code == 500 and body["error"]["type"] == "internal"
    message = body["error"]["message"]
    assert "INSERT" not in message and "beta" not in message and "IntegrityError" not in message
    ref = message.split("reference ", 1)[1].split(":", 1)[0]
    logged = [r for r in caplog.records if ref in r.getMessage()]
    assert logged and logged[0].exc_info is not None  # the whole failure is in the log, under that reference
