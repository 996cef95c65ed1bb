"""The worker channel (`/v1/workers/{id}/channel`, a WebSocket) against a real controller on loopback.

Each request on it must be answered exactly as the same HTTP request is (the same checks, words and status),
answers may pass each other, only the worker itself may open it, a revoked token stops the next request, and a
closed channel leaves no long poll behind. The worker's end (`worker/channel.py`) must fall back to HTTP when
nothing was sent, and raise what httpx raises when an answer was lost.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed, InvalidStatus

from tests.conftest import Cluster, channel_requests, free_port, sample
from turnout.worker.channel import Channel, ChannelUnavailable
from turnout.worker.client import CHANNEL_MAX_BODY, ControllerClient


@pytest.fixture(scope="module", name="c")
def controller(shared_cluster: Cluster) -> Cluster:
    return shared_cluster


def worker_body(capability: str) -> dict[str, Any]:
    """A registration offering `capability` (one CPU a task) on a stand-in with four."""
    return {"name": f"stand-in-{capability}", "host": "h", "cpu": 4, "memory": 2**30, "heartbeat_s": 60,
            "variants": [{"capability": capability, "device": "cpu", "resources": {"cpu": 1}}]}  # fmt: skip


def register(c: Cluster, capability: str, token: str | None = None) -> tuple[str, dict[str, str]]:
    """A stand-in worker offering `capability`: its id and the headers that prove who it is."""
    auth = {"Authorization": f"Bearer {token or c.token}"}
    resp = httpx.post(f"{c.url}/v1/workers/register", json=worker_body(capability), headers=auth, timeout=30)
    assert resp.status_code == 201, resp.text
    answer = resp.json()
    assert "channel" in answer["features"]
    return answer["id"], {**auth, "X-Worker-Secret": answer["secret"]}


@asynccontextmanager
async def opened(c: Cluster, worker_id: str, headers: dict[str, str]) -> AsyncIterator[ClientConnection]:
    url = f"ws://127.0.0.1:{c.port}/v1/workers/{worker_id}/channel"
    async with connect(url, additional_headers=headers, compression=None, max_size=None) as ws:
        yield ws


async def ask(ws: ClientConnection, seq: int, call: str, body: Any) -> None:
    await ws.send(
        b"%d %s\n%s" % (seq, call.encode(), body if isinstance(body, bytes) else orjson.dumps(body))
    )


async def answer(ws: ClientConnection, timeout_s: float = 30) -> tuple[int, int, Any]:
    """The next answer on the channel: (seq, status, JSON body)."""
    frame = await asyncio.wait_for(ws.recv(), timeout_s)
    assert isinstance(frame, bytes)
    head, _, body = frame.partition(b"\n")
    seq, status = head.split(b" ")
    return int(seq), int(status), orjson.loads(body)


def ok(lease: dict[str, Any]) -> dict[str, Any]:
    return {"task_id": lease["id"], "attempt": lease["attempt"], "status": "succeeded", "output": {"seen": 1}}


def test_a_long_poll_on_the_channel_is_passed_by_a_report_and_answered_when_work_comes(c: Cluster) -> None:
    worker_id, headers = register(c, "ch_noop")
    first = c.submit("ch_noop", {"i": 1})
    closed = channels_open(c)

    async def go() -> None:
        async with opened(c, worker_id, headers) as ws:
            assert await asyncio.to_thread(channels_open, c) == closed + 1
            await ask(ws, 1, "lease", {"max_tasks": 1, "running": [], "wait_s": 0})
            seq, status, leased = await answer(ws)
            assert (seq, status) == (1, 200) and [t["id"] for t in leased["tasks"]] == [first["id"]]
            # a long poll for more, then the first task's result: the result's answer comes first
            await ask(ws, 2, "lease", {"max_tasks": 1, "running": [first["id"]], "wait_s": 20})
            await ask(ws, 3, "complete", {"results": [ok(leased["tasks"][0])]})
            seq, status, verdict = await answer(ws)
            assert (seq, status, verdict["accepted"]) == (3, 200, [first["id"]])
            second = await asyncio.to_thread(c.submit, "ch_noop", {"i": 2})
            seq, status, leased = await answer(ws)
            assert (seq, status) == (2, 200) and [t["id"] for t in leased["tasks"]] == [second["id"]]
            await ask(ws, 4, "complete", {"results": [ok(leased["tasks"][0])]})
            assert (await answer(ws))[:2] == (4, 200)

    asyncio.run(go())
    assert c.result(first["id"])["output"] == {"seen": 1}
    assert c.result(first["id"])["state"] == "succeeded"
    deadline = time.monotonic() + 10
    while channels_open(c) != closed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert channels_open(c) == closed


def channels_open(c: Cluster) -> float:
    return sample(c.api("GET", "/metrics").text, "turnout_worker_channels_open")


def test_a_request_on_the_channel_is_refused_in_the_same_words_as_over_http(c: Cluster) -> None:
    worker_id, headers = register(c, "ch_refused")
    bad_bodies: list[bytes] = [b"{not json", b'{"results": [{"task_id": 1}]}', b'{"max_tasks": NaN}']

    async def go() -> list[tuple[int, Any]]:
        out = []
        async with opened(c, worker_id, headers) as ws:
            for n, body in enumerate(bad_bodies):
                await ask(ws, n, "complete" if n < 2 else "lease", body)
                seq, status, said = await answer(ws)
                assert seq == n
                out.append((status, said))
            await ask(ws, 9, "drain", {})
            seq, status, said = await answer(ws)
            assert (seq, status, said["error"]["field"]) == (9, 404, "call")
        return out

    over_channel = asyncio.run(go())
    for n, body in enumerate(bad_bodies):
        call = "complete" if n < 2 else "lease"
        resp = httpx.post(f"{c.url}/v1/workers/{worker_id}/{call}", content=body, timeout=30,
                          headers={**headers, "Content-Type": "application/json"})  # fmt: skip
        assert resp.status_code in (400, 422)
        assert over_channel[n] == (resp.status_code, resp.json())


def test_only_the_worker_itself_opens_its_channel(c: Cluster) -> None:
    mine, my_headers = register(c, "ch_mine")
    theirs, _ = register(c, "ch_theirs")

    async def refused(worker_id: str, headers: dict[str, str]) -> int:
        with pytest.raises(InvalidStatus) as refusal:
            async with opened(c, worker_id, headers):
                pass
        return refusal.value.response.status_code

    async def go() -> None:
        assert await refused(mine, {}) == 403  # no token
        assert await refused(mine, {"Authorization": my_headers["Authorization"]}) == 403  # no secret
        assert await refused(mine, {**my_headers, "X-Worker-Secret": "guess"}) == 403
        assert await refused(theirs, my_headers) == 403  # another worker's channel, with my proof
        assert await refused("w_nobody", my_headers) == 403
        async with opened(c, mine, my_headers) as ws:  # and the worker itself gets in
            await ask(ws, 1, "lease", {"max_tasks": 1, "running": [], "wait_s": 0})
            assert (await answer(ws))[:2] == (1, 200)

    asyncio.run(go())


def test_a_token_revoked_while_its_channel_is_open_stops_the_next_request(c: Cluster) -> None:
    made = c.api("POST", "/v1/tokens", json={"role": "worker"}).json()
    worker_id, headers = register(c, "ch_revoked", token=made["token"])

    async def go() -> None:
        async with opened(c, worker_id, headers) as ws:
            await ask(ws, 1, "lease", {"max_tasks": 1, "running": [], "wait_s": 0})
            assert (await answer(ws))[:2] == (1, 200)
            revoked = await asyncio.to_thread(c.api, "DELETE", f"/v1/tokens/{made['id']}")
            assert revoked.status_code == 200, revoked.text
            await ask(ws, 2, "lease", {"max_tasks": 1, "running": [], "wait_s": 0})
            seq, status, said = await answer(ws)
            assert (seq, status) == (2, 401), said

    asyncio.run(go())


def test_a_frame_that_is_not_a_request_closes_the_channel(c: Cluster) -> None:
    worker_id, headers = register(c, "ch_garbage")

    async def go() -> None:
        for garbage in (b"no header line", "a text frame\n{}", b"x lease\n{}"):
            async with opened(c, worker_id, headers) as ws:
                await ws.send(garbage)
                with pytest.raises(ConnectionClosed) as closed:
                    await asyncio.wait_for(ws.recv(), 10)
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 1002

    asyncio.run(go())


def test_a_long_poll_ends_with_its_channel_and_takes_no_task_after(c: Cluster) -> None:
    worker_id, headers = register(c, "ch_gone")

    async def go() -> None:
        async with opened(c, worker_id, headers) as ws:
            await ask(ws, 1, "lease", {"max_tasks": 1, "running": [], "wait_s": 20})
            await asyncio.sleep(0.3)  # parked at the controller

    asyncio.run(go())
    task = c.submit("ch_gone")
    time.sleep(1.0)
    assert c.api("GET", f"/v1/tasks/{task['id']}").json()["state"] == "queued"


def test_a_channel_has_at_most_sixteen_requests_under_way_and_reads_on_when_one_is_answered(
    c: Cluster,
) -> None:
    worker_id, headers = register(c, "ch_slots")

    async def go() -> None:
        async with opened(c, worker_id, headers) as ws:
            for seq in range(16):  # sixteen long polls park: the queue is empty
                await ask(ws, seq, "lease", {"max_tasks": 1, "running": [], "wait_s": 20})
            await ask(ws, 99, "complete", {"results": []})
            with pytest.raises(asyncio.TimeoutError):  # not read while every slot is taken
                await answer(ws, timeout_s=1.0)
            await asyncio.to_thread(c.submit, "ch_slots")
            first, second = await answer(ws), await answer(ws)
            assert first[:2] != (99, 200) and len(first[2]["tasks"]) == 1  # a poll took the task...
            assert second[:2] == (99, 200)  # ... which freed the slot the report then took

    asyncio.run(go())


def test_a_worker_process_runs_its_tasks_over_the_channel_unless_told_not_to(c: Cluster) -> None:
    for name, extra in (("ch-proc", []), ("ch-proc-http", ["--no-channel"])):
        before = channel_requests(c.api("GET", "/metrics").text, "complete")
        proc = c.start_worker("tests.apps.testapp:app", name=name, extra=extra)
        try:
            tasks = [c.submit("count", {"n": n}) for n in range(5)]
            assert [c.result(t["id"])["output"]["n"] for t in tasks] == list(range(5))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        sent = channel_requests(c.api("GET", "/metrics").text, "complete") - before
        assert sent >= 1 if not extra else sent == 0, (name, sent)


# ---- the worker's end ----------------------------------------------------------------------------------


@asynccontextmanager
async def registered(c: Cluster, capability: str, channel: bool = True) -> AsyncIterator[ControllerClient]:
    """The worker's own client, registered as a stand-in offering `capability`."""
    client = ControllerClient(c.url, c.token, channel=channel)
    try:
        await client.register(worker_body(capability))
        yield client
    finally:
        await client.aclose()


def test_the_workers_client_sends_leases_and_reports_over_the_channel(c: Cluster) -> None:
    async def go() -> None:
        async with registered(c, "ch_client") as client:
            assert client.channel is not None
            sent: list[str] = []
            call = client.channel.call

            async def counted(what: str, payload: bytes, timeout_s: float) -> tuple[int, bytes]:
                sent.append(what)
                return await call(what, payload, timeout_s)

            client.channel.call = counted  # type: ignore[method-assign]
            task = await asyncio.to_thread(c.submit, "ch_client", {"big": 2**70 + 1})
            leased = await client.lease({"max_tasks": 1, "running": []}, wait_s=5)
            assert leased is not None and [t["id"] for t in leased["tasks"]] == [task["id"]]
            assert leased["tasks"][0]["input"] == {"big": 2**70 + 1}  # past 64 bits: no orjson on the way in
            resp = await client.report("complete", orjson.dumps({"results": [ok(leased["tasks"][0])]}))
            assert resp.status_code == 200 and resp.json()["accepted"] == [task["id"]]
            assert sent == ["lease", "complete"]

    asyncio.run(go())
    assert c.result(c.api("GET", "/v1/tasks?capability=ch_client").json()["tasks"][0]["id"])["state"] == (
        "succeeded"
    )


def test_the_workers_client_uses_http_when_no_channel_opens_and_rests_before_trying_again(c: Cluster) -> None:
    async def go() -> None:
        async with registered(c, "ch_fallback") as client:
            assert client.channel is not None
            client.channel.url = f"ws://127.0.0.1:{free_port()}/nothing-listens-here"
            task = await asyncio.to_thread(c.submit, "ch_fallback")
            leased = await client.lease({"max_tasks": 1, "running": []}, wait_s=5)  # over HTTP
            assert leased is not None and [t["id"] for t in leased["tasks"]] == [task["id"]]
            with pytest.raises(ChannelUnavailable, match="resting"):  # no second try at once
                await client.channel.call("lease", b"{}", 5)
            resp = await client.report("complete", orjson.dumps({"results": [ok(leased["tasks"][0])]}))
            assert resp.json()["accepted"] == [task["id"]]

    asyncio.run(go())


def test_a_worker_told_not_to_and_a_big_report_use_http(c: Cluster) -> None:
    async def go() -> None:
        async with registered(c, "ch_http", channel=False) as told:
            assert "channel" in told.features and told.channel is None
        async with registered(c, "ch_http") as client:
            assert client.channel is not None

            async def refuse(*_: object) -> tuple[int, bytes]:
                raise AssertionError("a body over CHANNEL_MAX_BODY went to the channel")

            client.channel.call = refuse  # type: ignore[method-assign]
            line = {"task_id": "t_" + "0" * 24, "attempt": 1, "event": {"type": "log", "line": "x" * 1000}}
            resp = await client.report(
                "events", orjson.dumps({"events": [line] * (CHANNEL_MAX_BODY // 1000)})
            )
            assert resp.status_code < 500

    asyncio.run(go())


def test_an_answer_lost_on_the_channel_raises_what_httpx_raises() -> None:
    """A server that closes on the first request, and one that never answers: the caller retries either."""

    async def hang_up(ws: ServerConnection) -> None:
        await ws.recv()
        await ws.close()

    async def silent(ws: ServerConnection) -> None:
        async for _ in ws:
            pass

    async def go() -> None:
        for handler, expected, timeout_s in (
            (hang_up, httpx.ReadError, 10.0),
            (silent, httpx.ReadTimeout, 0.3),
        ):
            port = free_port()
            async with serve(handler, "127.0.0.1", port):
                channel = Channel(f"ws://127.0.0.1:{port}/", {}, None)
                try:
                    with pytest.raises(expected):
                        await channel.call("complete", b"{}", timeout_s)
                finally:
                    await channel.close()

    asyncio.run(go())
