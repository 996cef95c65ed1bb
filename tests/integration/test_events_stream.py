"""Live events over Server-Sent Events: in order, live, resumable without loss or repeats, in every client."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

from tests.conftest import Cluster
from tests.integration.test_command_workers import start_preset_worker
from turnout.client import AsyncClient, Client

WORDS = " ".join(f"w{i}" for i in range(1000))


@pytest.fixture(scope="module")
def served(shared_cluster: Cluster) -> Cluster:
    """A controller and a worker serving the loading worker (session mode) for the whole module."""
    start_preset_worker(shared_cluster)
    return shared_cluster


def test_a_client_reads_1000_deltas_live_and_in_order(served: Cluster) -> None:
    with Client(served.url, served.token) as client:
        handle = client.submit("loading-session", {"prompt": WORDS, "tokens": 1000, "delay_s": 0.001})
        events, state_at_first_delta = [], None
        for event in handle.events():
            if event["event"] == "text_delta" and state_at_first_delta is None:
                state_at_first_delta = client.get_task(handle.id)["state"]
            events.append(event)
    assert state_at_first_delta == "running"  # read while the program was still writing
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    deltas = [e["delta"] for e in events if e["event"] == "text_delta"]
    assert deltas == [f"w{i} " for i in range(1000)]
    assert events[-1]["event"] == "finish" and events[-1]["status"] == "completed"
    assert events[-1]["output"]["text"] == "".join(deltas)


def test_a_client_that_disconnects_and_resumes_with_last_event_id_misses_nothing(served: Cluster) -> None:
    with Client(served.url, served.token) as client:
        handle = client.submit("loading-session", {"prompt": WORDS, "tokens": 1000, "delay_s": 0.001})
        first: list[dict[str, Any]] = []
        for event in handle.events():  # disconnect mid-stream: the generator closes the connection
            first.append(event)
            if len(first) == 300:
                break
    headers = {"Authorization": f"Bearer {served.token}", "Last-Event-ID": str(first[-1]["seq"])}
    rest = []
    with httpx.stream(
        "GET", f"{served.url}/v1/tasks/{handle.id}/events", headers=headers, timeout=30
    ) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data:"):
                rest.append(json.loads(line[5:]))
    seqs = [e["seq"] for e in first + rest]
    assert seqs == list(range(1, len(seqs) + 1))  # nothing missed, nothing twice
    deltas = [e["delta"] for e in first + rest if e["event"] == "text_delta"]
    assert deltas == [f"w{i} " for i in range(1000)]
    assert rest[-1]["event"] == "finish"


def test_after_resumes_an_ended_stream_and_the_stream_stays_readable(served: Cluster) -> None:
    task = served.result(
        served.submit("loading-session", {"prompt": "a b c", "tokens": 5, "delay_s": 0})["id"]
    )
    with Client(served.url, served.token) as client:
        everything = list(client.task(task["id"]).events())
        tail = list(client.task(task["id"]).events(after=everything[-3]["seq"]))
    assert tail == everything[-2:]
    assert [e["event"] for e in everything].count("finish") == 1


def test_the_async_client_streams_the_same_events(served: Cluster) -> None:
    async def read() -> list[dict[str, Any]]:
        async with AsyncClient(served.url, served.token) as client:
            handle = await client.submit("loading-session", {"prompt": "x y", "tokens": 50, "delay_s": 0.001})
            return [e async for e in handle.events()]

    events = asyncio.run(read())
    assert [e["delta"] for e in events if e["event"] == "text_delta"] == ["x ", "y "] * 25
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert events[-1]["event"] == "finish"


def test_submit_follow_prints_deltas_as_they_arrive(served: Cluster) -> None:
    argv = [sys.executable, "-m", "turnout.cli", "submit", "loading-session", "--follow",
            "--input", json.dumps({"prompt": "tick", "tokens": 60, "delay_s": 0.05})]  # fmt: skip
    proc = subprocess.Popen(argv, env=served.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        first = os.read(proc.stdout.fileno(), 5)  # blocks until the CLI prints its first delta
        still_running = proc.poll() is None
        started = time.monotonic()
        rest, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert first == b"tick "
    assert still_running and time.monotonic() - started > 1  # the rest came over the ~3 s the task ran
    assert (first + rest).decode().startswith("tick " * 60)
    assert proc.returncode == 0, err.decode()
