"""`Client.run`: submit one task and get its result in one request (`POST /v1/tasks?wait=`), against a real
controller and worker; requests are counted with httpx's event hooks on the client's own connection."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.conftest import Cluster
from turnout.client import AsyncClient, AsyncTaskHandle, Client
from turnout.errors import InvalidInput

APP = "tests.apps.testapp:app"


@pytest.fixture(scope="module")
def api(shared_cluster: Cluster) -> Cluster:
    shared_cluster.start_worker(APP, name="run-worker")
    return shared_cluster


def _count(http: httpx.AsyncClient) -> list[str]:
    sent: list[str] = []

    async def hook(request: httpx.Request) -> None:
        sent.append(f"{request.method} {request.url.path}?{request.url.query.decode()}")

    http.event_hooks["request"].append(hook)
    return sent


def test_run_answers_the_ended_task_in_one_request(api: Cluster) -> None:
    with Client(api.url, api.token) as client:
        sent = _count(client._async.http)
        task = client.run("count", {"n": 7}, gpu="never", timeout=60)
        assert (task["state"], task["output"]["n"]) == ("succeeded", 7)
        assert sent == ["POST /v1/tasks?wait=30.0"]
        assert client.get_task(task["id"]) == task  # what a read gives


def test_run_waits_past_one_request_and_times_out_like_result(api: Cluster) -> None:
    async def go() -> None:
        async with AsyncClient(api.url, api.token) as client:
            sent = _count(client.http)
            # a task longer than one wait step: the submission answers it running, the waits go on from there
            task = await client.run("count", {"n": 1, "sleep": 1.5}, gpu="never", timeout=60)
            assert task["state"] == "succeeded"
            assert len(sent) == 1  # 1.5 s is inside the first step
            sent.clear()
            started = time.monotonic()
            with pytest.raises(TimeoutError, match="still"):
                await client.run("count", {"n": 2, "sleep": 5}, gpu="never", timeout=0.5)
            assert 0.4 < time.monotonic() - started < 4
            assert sent[0] == "POST /v1/tasks?wait=0.5" and all("/result" in s for s in sent[1:])

    asyncio.run(go())


def test_run_refuses_a_bad_body_naming_the_field_and_sends_nothing(api: Cluster) -> None:
    with Client(api.url, api.token) as client:
        sent = _count(client._async.http)
        with pytest.raises(InvalidInput) as refused:
            client.run("count", {"x": float("nan")}, gpu="never")
        assert refused.value.field == "input.x" and sent == []
        with pytest.raises(InvalidInput) as refused:
            client.run("count", {"n": 1}, gpu="sometimes", timeout=10)
        assert refused.value.field == "gpu"  # the controller's 422, word for word


def test_submit_wait_on_the_cli_prints_the_result(api: Cluster) -> None:
    done = api.cli("submit", "count", "--input", '{"n": 5}', "--gpu", "never", "--wait", "--json")
    assert done.returncode == 0, done.stderr
    assert '"succeeded"' in done.stdout and '"n": 5' in done.stdout


@pytest.mark.parametrize("bad", [float("nan"), -1, True, "5"], ids=repr)
def test_a_wait_that_could_never_end_or_means_nothing_is_refused_naming_it(bad: object) -> None:
    """NaN compares false with every deadline: a wait on it looped for ever. Refused before any request."""

    async def go() -> None:
        async with AsyncClient("http://127.0.0.1:9", "no-token") as client:
            sent = _count(client.http)
            calls = [
                ("timeout", lambda: client.run("count", timeout=bad)),  # type: ignore[arg-type]
                ("timeout", lambda: AsyncTaskHandle(client, {"id": "t_x"}).result(bad)),  # type: ignore[arg-type]
                ("wait", lambda: client.run_pipeline("p", wait=bad)),  # type: ignore[arg-type]
                ("wait", lambda: client.pipeline_run("r_x", wait=bad)),  # type: ignore[arg-type]
            ]
            for name, call in calls:
                with pytest.raises(InvalidInput) as refused:
                    await asyncio.wait_for(call(), 5)
                assert refused.value.field == name
            assert sent == []

    asyncio.run(go())
