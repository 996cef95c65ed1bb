"""Tokens over time, as an attacker or a bad day would try them: a token revoked while a request it opened is
still held (a result wait, a submit-and-wait, an event stream, a worker's lease poll or lifeline), a
revocation racing a request that looks the token up, and a token revoked twice.

The README's promise: a revoked token stops the very next request. A request held open for up to an hour
(`?wait=`), or for as long as a task runs (an event stream), must stop too, or a revoked credential keeps
hearing its tenant's results, and a revoked worker keeps taking its tenant's tasks.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.inprocess.conftest import Api, serve_api
from turnout.config import ControllerSettings
from turnout.pipelines import parse_pipelines
from turnout.store import open_store

pytestmark = pytest.mark.anyio

# no worker takes it: it stays queued
QUEUED = {"capability": "shout", "input": {"text": "hi"}, "placement_timeout_s": 600}
LONG_WAIT_S = 120  # far longer than the test may take: an answer before it is the revocation's doing
DEADLINE_S = 30.0  # how long the revocation may take to stop a held request (detected within a few seconds)


async def _granted(api: Api, role: str, tenant: str = "acme") -> tuple[str, str]:
    """(id, token) of a fresh token, made by the operator."""
    resp = await api.client.post("/v1/tokens", json={"role": role, "tenant": tenant})
    assert resp.status_code == 201, resp.text
    return resp.json()["id"], resp.json()["token"]


async def _revoke(api: Api, token_id: str) -> None:
    resp = await api.client.delete(f"/v1/tokens/{token_id}")
    assert resp.status_code == 200, resp.text


async def _held(api: Api, request: Any) -> asyncio.Future[httpx.Response]:
    """Start `request` (a coroutine) and give it time to reach its wait, as a client's held request would."""
    held = asyncio.ensure_future(request)
    await asyncio.sleep(0.3)
    assert not held.done(), held.result().text
    return held


async def _answered(held: asyncio.Future[httpx.Response]) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    resp = await asyncio.wait_for(held, DEADLINE_S)
    return resp, time.monotonic() - started


async def test_a_result_wait_stops_with_401_once_its_token_is_revoked(api: Api) -> None:
    token_id, token = await _granted(api, "submit")
    task = (await api.as_(token, "POST", "/v1/tasks", json=QUEUED)).json()
    # Given a client of acme waiting for its task's result
    held = await _held(
        api, api.as_(token, "GET", f"/v1/tasks/{task['id']}/result", params={"wait": LONG_WAIT_S})
    )
    # When its token is revoked
    await _revoke(api, token_id)
    # Then the wait ends as the next request would: 401, not the task once it ends (within the hour)
    resp, took = await _answered(held)
    assert resp.status_code == 401, resp.text
    assert resp.json()["error"]["type"] == "unauthorized" and took < DEADLINE_S


async def test_a_submit_and_wait_stops_waiting_once_its_token_is_revoked(api: Api) -> None:
    token_id, token = await _granted(api, "submit")
    held = await _held(api, api.as_(token, "POST", "/v1/tasks", params={"wait": LONG_WAIT_S}, json=QUEUED))
    await _revoke(api, token_id)
    # the submission stands (201, as it was made), but the revoked token hears nothing newer
    resp, _ = await _answered(held)
    assert resp.status_code == 201, resp.text
    assert resp.json()["state"] == "queued"
    assert (await api.task(resp.json()["id"]))["state"] == "queued"


async def test_an_event_stream_ends_once_its_token_is_revoked(api: Api) -> None:
    token_id, token = await _granted(api, "read")
    submitter = (await _granted(api, "submit"))[1]
    task = (await api.as_(submitter, "POST", "/v1/tasks", json=QUEUED)).json()
    # Given a stream of a queued task's events (it would last as long as the task)
    held = await _held(api, api.as_(token, "GET", f"/v1/tasks/{task['id']}/events"))
    await _revoke(api, token_id)
    # Then the stream ends, without a `finish`, and the client's reconnect hears 401
    resp, _ = await _answered(held)
    assert resp.status_code == 200 and "event: finish" not in resp.text
    again = await api.as_(token, "GET", f"/v1/tasks/{task['id']}/events")
    assert again.status_code == 401, again.text


async def test_a_token_revoked_twice_is_audited_once(api: Api) -> None:
    token_id, _ = await _granted(api, "submit")
    await _revoke(api, token_id)
    listed = (await api.client.get("/v1/tokens", params={"tenant": "acme"})).json()["tokens"]
    first = next(t for t in listed if t["id"] == token_id)["revoked_at"]
    # the second revocation answers as the first (it is revoked), but writes no record claiming it revoked it
    resp = await api.client.delete(f"/v1/tokens/{token_id}")
    assert resp.status_code == 200 and resp.json()["revoked"] is True
    records = (await api.client.get("/v1/audit", params={"kind": "token_revoked"})).json()["audit"]
    assert [r["token"] for r in records] == [token_id]
    listed = (await api.client.get("/v1/tokens", params={"tenant": "acme"})).json()["tokens"]
    assert next(t for t in listed if t["id"] == token_id)["revoked_at"] == first


@pytest.fixture
async def on_sqlite(tmp_path: Path) -> AsyncIterator[Api]:
    """The API on a SQLite file: a read on another thread sees only committed state, as in production."""
    store = open_store(f"sqlite:///{tmp_path / 'turnout.db'}")
    try:
        async with serve_api(store=store) as api:
            yield api
    finally:
        store.close()


async def test_a_request_verified_while_a_revocation_commits_does_not_keep_the_token_valid(
    on_sqlite: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = on_sqlite
    token_id, token = await _granted(api, "submit")
    header = f"Bearer {token}"
    verified: list[str] = []

    def concurrent_request() -> None:  # another request's token lookup, on a reader thread, as the route's
        verified.append(api.service.tokens.verify(header).token_id)

    audit = api.ctrl.audit

    def audited(kind: str, tenant: str | None, body: dict[str, Any]) -> None:
        audit(kind, tenant, body)
        if kind == "token_revoked":  # the revocation is written, not yet committed: a request comes in now
            reader = threading.Thread(target=concurrent_request)
            reader.start()
            reader.join(10)

    monkeypatch.setattr(api.ctrl, "audit", audited)
    await _revoke(api, token_id)
    assert verified == [token_id]  # it read the token before the revocation committed: still valid then
    # Once the revocation was answered, the very next request is refused (not for the cache's 5 s more)
    resp = await api.as_(token, "GET", "/v1/whoami")
    assert resp.status_code == 401, resp.text
    resp = await api.as_(token, "POST", "/v1/tasks", json=QUEUED)
    assert resp.status_code == 401, resp.text


async def _acme_worker(api: Api) -> tuple[str, dict[str, str], str]:
    """A worker of tenant acme: (its token's id, its headers, its id)."""
    token_id, token = await _granted(api, "worker")
    body = {"name": "w", "host": "h", "variants": [{"capability": "shout", "device": "cpu"}], "cpu": 4,
            "memory": 2**33, "heartbeat_s": 1.0}  # fmt: skip
    resp = await api.as_(token, "POST", "/v1/workers/register", json=body)
    assert resp.status_code == 201, resp.text
    headers = {"Authorization": f"Bearer {token}", "X-Worker-Secret": resp.json()["secret"]}
    return token_id, headers, resp.json()["id"]


async def test_a_revoked_workers_parked_lease_poll_takes_no_task(api: Api) -> None:
    token_id, headers, worker_id = await _acme_worker(api)
    submitter = (await _granted(api, "submit"))[1]
    # Given the worker's lease poll, parked for new tasks
    poll = api.client.post(f"/v1/workers/{worker_id}/lease", headers=headers,
                           json={"max_tasks": 1, "wait_s": 20, "running": []})  # fmt: skip
    held = await _held(api, poll)
    # When its token is revoked (the worker's host was compromised), and then acme submits a task
    await _revoke(api, token_id)
    task = (
        await api.as_(submitter, "POST", "/v1/tasks", json={"capability": "shout", "input": {"secret": 1}})
    ).json()
    # Then the poll hears 401, and the task (its input) never went to the revoked worker
    resp, _ = await _answered(held)
    assert (await api.task(task["id"]))["state"] == "queued"
    assert resp.status_code == 401, resp.text


async def test_a_revoked_workers_lifeline_is_closed(api: Api) -> None:
    token_id, headers, worker_id = await _acme_worker(api)
    held = await _held(api, api.client.get(f"/v1/workers/{worker_id}/lifeline", headers=headers))
    await _revoke(api, token_id)
    await _answered(held)  # the stream ends (a reopen then hears 401); a TimeoutError while it does not


async def test_a_pipeline_run_wait_stops_with_401_once_its_token_is_revoked() -> None:
    pipelines = parse_pipelines({"two": {"stages": [{"capability": "shout", "gpu": "never"}] * 2}})
    settings = ControllerSettings(heartbeat_s=1.0, pipelines=pipelines)
    async with serve_api(settings) as api:
        await api.worker()  # registers `shout`; it never leases here, so the run stays queued
        token_id, token = await _granted(api, "submit")
        run = (await api.as_(token, "POST", "/v1/pipelines/two/runs", json={"input": {"text": "hi"}})).json()
        held = await _held(
            api, api.as_(token, "GET", f"/v1/pipeline-runs/{run['id']}", params={"wait": LONG_WAIT_S})
        )
        await _revoke(api, token_id)
        resp, _ = await _answered(held)
        assert resp.status_code == 401, resp.text
