"""A change committed on one replica wakes the waiters parked on another at once (LISTEN/NOTIFY).

Two controllers' APIs run in one event loop on one PostgreSQL database, each with its own store, bus and
signals, exactly as `turnout controller` wires them (`runtime.build_controller`). Replica B re-checks its
parked waiters only every 60 s, and every wait below is bounded at 30 s: a waiter that returns did so
because replica A's change woke it, never because its re-check came round.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from turnout.api.app import create_app
from turnout.api.service import Service
from turnout.auth import TokenBook
from turnout.config import ControllerSettings
from turnout.controller import Controller
from turnout.store import open_store
from turnout.store.notify import ReplicaBus

pytestmark = pytest.mark.postgres
SLOW_RECHECK_S = 60.0
BOUND_S = 30.0


@asynccontextmanager
async def replica(url: str, recheck_s: float) -> AsyncIterator[tuple[Service, httpx.AsyncClient]]:
    """One controller replica: its own store, controller, bus and API, stopped however the test ends."""
    store = open_store(url)
    service = Service(Controller(store, ControllerSettings()), TokenBook(store), auth=False,
                      bus=ReplicaBus(store.url), recheck_s=recheck_s)  # fmt: skip
    await service.start()
    try:
        assert service.bus is not None
        assert await asyncio.get_running_loop().run_in_executor(None, service.bus.wait_listening, 10.0)
        transport = httpx.ASGITransport(app=create_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
            yield service, client
    finally:
        await service.stop()


def run(
    url: str, body: Callable[[Service, httpx.AsyncClient, Service, httpx.AsyncClient], Awaitable[None]]
) -> None:
    async def main() -> None:
        async with replica(url, recheck_s=1.0) as (a, api_a), replica(url, SLOW_RECHECK_S) as (b, api_b):
            await body(a, api_a, b, api_b)

    asyncio.run(main())


async def register(api: httpx.AsyncClient, *others: httpx.AsyncClient) -> str:
    """Register a worker through `api`; it and `others` then carry its secret, as its agent's client would."""
    body = {"name": "w", "host": "h", "variants": [{"capability": "noop", "device": "cpu", "resources": {"cpu": 0.1}}],
            "cpu": 2, "memory": 2**30, "gpus": [], "strategy": "pack", "heartbeat_s": 30}  # fmt: skip
    resp = await api.post("/v1/workers/register", json=body)
    assert resp.status_code == 201, resp.text
    for client in (api, *others):
        client.headers["X-Worker-Secret"] = resp.json()["secret"]
    return str(resp.json()["id"])


class Calls:
    """Counts the calls of `service.controller.<method>` that have returned: once a waiter's call returned
    empty-handed it has parked (its signal was taken before it looked), so a change after that point
    reaches it only by a wake-up."""

    def __init__(self, service: Service, method: str) -> None:
        ctrl: Any = service.controller
        real = getattr(ctrl, method)
        self.count = 0
        self._changed = asyncio.Event()
        loop = asyncio.get_running_loop()

        def counted(*args: Any, **kwargs: Any) -> Any:
            try:
                return real(*args, **kwargs)
            finally:
                loop.call_soon_threadsafe(self._returned)

        setattr(ctrl, method, counted)

    def _returned(self) -> None:
        self.count += 1
        self._changed.set()

    async def reach(self, n: int) -> None:
        while self.count < n:
            self._changed.clear()
            await asyncio.wait_for(self._changed.wait(), BOUND_S)


def test_a_task_submitted_on_one_replica_wakes_a_lease_poll_parked_on_another(pg_url: str) -> None:
    async def body(a: Service, api_a: httpx.AsyncClient, b: Service, api_b: httpx.AsyncClient) -> None:
        # Given a worker whose lease poll (wait 60 s) is parked on replica B, with nothing queued
        worker_id = await register(api_a, api_b)
        leases = Calls(b, "lease")
        ask = {"max_tasks": 1, "wait_s": 60, "running": []}
        poll = asyncio.ensure_future(api_b.post(f"/v1/workers/{worker_id}/lease", json=ask, timeout=90))
        await leases.reach(1)
        # When a task is submitted on replica A
        task = (await api_a.post("/v1/tasks", json={"capability": "noop", "input": {}})).json()
        # Then B's poll answers with it, well before its wait or its re-check would end
        answer = await asyncio.wait_for(poll, BOUND_S)
        assert [t["id"] for t in answer.json()["tasks"]] == [task["id"]]

    run(pg_url, body)


def test_a_result_completed_on_one_replica_wakes_a_result_wait_on_another(pg_url: str) -> None:
    async def body(a: Service, api_a: httpx.AsyncClient, b: Service, api_b: httpx.AsyncClient) -> None:
        # Given a leased task whose result a client awaits on replica B
        worker_id = await register(api_a, api_b)
        task = (await api_a.post("/v1/tasks", json={"capability": "noop", "input": {}})).json()
        lease = (
            await api_a.post(f"/v1/workers/{worker_id}/lease", json={"max_tasks": 1, "wait_s": 0})
        ).json()
        assert lease["tasks"][0]["id"] == task["id"]
        reads = Calls(b, "get_task")
        wait = asyncio.ensure_future(
            api_b.get(f"/v1/tasks/{task['id']}/result", params={"wait": 60}, timeout=90)
        )
        await reads.reach(1)
        # When its worker reports the result to replica A
        result = {"task_id": task["id"], "attempt": 1, "status": "succeeded", "output": {"ok": True}}
        done = (await api_a.post(f"/v1/workers/{worker_id}/complete", json={"results": [result]})).json()
        assert done["accepted"] == [task["id"]]
        # Then the wait on B answers with the result at once
        answer = (await asyncio.wait_for(wait, BOUND_S)).json()
        assert (answer["state"], answer["output"]) == ("succeeded", {"ok": True})

    run(pg_url, body)


def test_a_submission_waiting_on_one_replica_is_answered_by_its_result_on_another(pg_url: str) -> None:
    async def body(a: Service, api_a: httpx.AsyncClient, b: Service, api_b: httpx.AsyncClient) -> None:
        # Given a client submitting with a wait on replica B (which does not read the task it just made)
        worker_id = await register(api_a, api_b)
        waiting = asyncio.ensure_future(
            api_b.post("/v1/tasks", params={"wait": 60}, json={"capability": "noop", "input": {}}, timeout=90)
        )
        tasks: list[dict[str, Any]] = []
        while not tasks:  # its worker leases it through replica A
            ask = {"max_tasks": 1, "wait_s": 0}
            tasks = (await api_a.post(f"/v1/workers/{worker_id}/lease", json=ask)).json()["tasks"]
            await asyncio.sleep(0.01)
        # When the worker reports the result to replica A
        result = {"task_id": tasks[0]["id"], "attempt": 1, "status": "succeeded", "output": {"ok": 2}}
        done = (await api_a.post(f"/v1/workers/{worker_id}/complete", json={"results": [result]})).json()
        assert done["accepted"] == [tasks[0]["id"]]
        # Then the submission on B answers with the result at once, not at its 60 s re-check
        answer = await asyncio.wait_for(waiting, BOUND_S)
        assert answer.status_code == 201, answer.text
        assert (answer.json()["id"], answer.json()["state"], answer.json()["output"]) == (
            tasks[0]["id"],
            "succeeded",
            {"ok": 2},
        )

    run(pg_url, body)


def test_events_stored_through_one_replica_reach_a_stream_held_by_another(pg_url: str) -> None:
    async def body(a: Service, api_a: httpx.AsyncClient, b: Service, api_b: httpx.AsyncClient) -> None:
        # Given a running task whose event stream a client follows on replica B
        worker_id = await register(api_a, api_b)
        task = (await api_a.post("/v1/tasks", json={"capability": "noop", "input": {}})).json()
        await api_a.post(f"/v1/workers/{worker_id}/lease", json={"max_tasks": 1, "wait_s": 0})
        reads = Calls(b, "get_task")
        stream = asyncio.ensure_future(api_b.get(f"/v1/tasks/{task['id']}/events", timeout=90))
        await reads.reach(2)  # the stream's 404 check, then its first look: nothing yet, parked
        # When its worker sends a progress event and then its finish through replica A, each once B's stream
        # has parked again
        for n, event in enumerate(
            ({"event": "progress", "done": 1, "total": 2}, {"event": "finish", "status": "completed"})
        ):
            await reads.reach(2 + n)
            sent = await api_a.post(f"/v1/workers/{worker_id}/events",
                                    json={"events": [{"task_id": task["id"], "attempt": 1, "event": event}]})  # fmt: skip
            assert sent.status_code == 200, sent.text
        # Then B's stream carries both, in order, and ends
        text = (await asyncio.wait_for(stream, BOUND_S)).text
        events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
        assert [(e["event"], e["seq"]) for e in events] == [("progress", 1), ("finish", 2)]

    run(pg_url, body)
