"""The agent's senders against a stand-in controller that refuses some reports: the refused ones become task
failures, the others (and every later one) still arrive, and stopping the agent is clean.

The real `Agent` runs all its loops; the controller is an in-process `httpx.MockTransport`, and each task
"runs" in a scripted process that emits the events and returns the output its input names.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx

from turnout.gpu.provider import discover
from turnout.models import Device, Variant
from turnout.resources import parse_resources
from turnout.worker.agent import Agent, AgentSettings
from turnout.worker.pools import ProcessPool, Runnable
from turnout.worker.processes import EventSink, Outcome, ProtocolProcess


class Scripted(ProtocolProcess):
    """Emits `events`, then returns `output` (with `x: NaN` added when `nan` is set), from the task line."""

    def __init__(self) -> None:
        super().__init__([], {})

    async def start(self) -> None:
        return None

    async def run(self, task_line: str, sink: EventSink, timeout_s: float | None) -> Outcome:
        script = json.loads(task_line)
        for event in script.get("events", []):
            sink(event)
        output = script.get("output")
        if script.get("nan"):
            output = {**output, "x": float("nan")}
        return Outcome(True, output=output)


SECRET = "tws_stand-in"


def refuses(item: Any) -> bool:
    return isinstance(item, dict) and bool(item.get("refuse"))


class StandIn:
    """A controller: leases the queued tasks one per poll, stores reports, and refuses (422) any batch that
    holds an output or event marked `refuse`, as a real one refuses what it will not store."""

    def __init__(self, inputs: list[dict[str, Any]]) -> None:
        self.queue = [{"id": f"t{i}", "attempt": 1, "capability": "script", "device": "cpu", "input": data,
                       "gpus": None, "timeout_s": None} for i, data in enumerate(inputs)]  # fmt: skip
        self.results: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.refusals = 0
        self.left = False
        self.unproven: list[str] = []  # worker calls that came without the secret registration answered
        self.seen_lifeline = 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/workers/register":
            return httpx.Response(200, json={"id": "w1", "secret": SECRET})
        if path.endswith("/lifeline"):
            self.seen_lifeline += 1
        if request.headers.get("X-Worker-Secret") != SECRET:  # every call as the worker carries its secret
            self.unproven.append(path)
            return httpx.Response(403, json={"error": {"type": "forbidden", "message": "not worker w1"}})
        if path.endswith("/lease"):
            if not self.queue:
                await asyncio.sleep(0.02)  # a long poll, shortened
                return httpx.Response(200, json={"tasks": [], "cancel": []})
            return httpx.Response(200, json={"tasks": [self.queue.pop(0)], "cancel": []})
        if path.endswith("/events") or path.endswith("/complete"):
            body = json.loads(request.content)  # strict: NaN would fail the test here
            items = body.get("events") or body.get("results") or []
            if any(refuses(i.get("event")) or refuses(i.get("output")) for i in items):
                self.refusals += 1
                return httpx.Response(422, json={"error": {"type": "invalid_input", "message": "too large",
                                                           "field": "results.0.output"}})  # fmt: skip
            if path.endswith("/events"):
                self.events += items
            else:
                self.results.update({r["task_id"]: r for r in items})
            return httpx.Response(200, json={"accepted": [], "refused": []})
        if path.endswith("/leave"):
            self.left = True
        return httpx.Response(200, json={})


def serve(inputs: list[dict[str, Any]], until: Callable[[StandIn], bool]) -> StandIn:
    """Run an agent against a stand-in until `until` holds (or 15 s pass), then stop it; it must stop in 10 s."""
    stand_in = StandIn(inputs)

    async def go() -> None:
        resources = parse_resources({"cpu": 0.1})
        runnable = Runnable(Variant("script", Device.CPU, resources), ProcessPool(lambda key: Scripted()),
                            lambda lease: json.dumps(lease["input"]))  # fmt: skip
        settings = AgentSettings(controller_url="http://controller", token="t", name="w", gpus="none",
                                 heartbeat_s=60, drain_grace_s=2)  # fmt: skip
        agent = Agent(settings, [runnable], discover("none"), transport=httpx.MockTransport(stand_in.handle))
        stop = asyncio.Event()
        running = asyncio.create_task(agent.run(stop))
        deadline = time.monotonic() + 15
        while not until(stand_in) and time.monotonic() < deadline and not running.done():
            await asyncio.sleep(0.02)
        stop.set()
        await asyncio.wait_for(running, timeout=10)

    asyncio.run(go())
    return stand_in


def test_a_result_the_controller_refuses_becomes_a_failure_and_later_results_still_arrive() -> None:
    inputs: list[dict[str, Any]] = [
        {"output": {"refuse": True, "rows": [1, 2, 3]}},
        {"output": {"n": 2}},
        {"output": {"n": 3}},
    ]
    stand_in = serve(inputs, lambda s: len(s.results) == 3)
    refused = stand_in.results["t0"]
    assert refused["status"] == "failed" and refused["error"]["type"] == "invalid_output"
    assert "422: too large" in refused["error"]["message"] and refused["error"]["field"] == "output"
    assert [stand_in.results[t]["output"] for t in ("t1", "t2")] == [{"n": 2}, {"n": 3}]
    assert stand_in.refusals <= 3  # refused once per batch it was in, never again
    assert stand_in.left


def test_every_call_as_the_worker_carries_the_secret_its_registration_answered() -> None:
    stand_in = serve([{"output": {"n": 1}}], lambda s: len(s.results) == 1 and bool(s.seen_lifeline))
    assert stand_in.seen_lifeline  # the held connection too: the controller judges the worker by it
    assert stand_in.unproven == []


def test_a_refused_event_is_dropped_and_fails_its_task_while_its_other_events_arrive() -> None:
    events = [{"event": "progress", "done": 1, "refuse": True}, {"event": "text_delta", "delta": "kept"}]
    inputs: list[dict[str, Any]] = [{"events": events, "output": {"n": 1}}, {"output": {"n": 2}}]
    stand_in = serve(inputs, lambda s: len(s.results) == 2)
    failed = stand_in.results["t0"]
    assert failed["status"] == "failed" and failed["error"]["type"] == "invalid_output"
    assert "the controller refused event 'progress'" in failed["error"]["message"]
    assert [e["event"] for e in stand_in.events if e["task_id"] == "t0"] == [
        {"event": "text_delta", "delta": "kept"}
    ]
    assert stand_in.results["t1"]["status"] == "succeeded"


def test_a_nan_output_is_reported_as_invalid_output_and_the_agent_stops_cleanly() -> None:
    stand_in = serve([{"output": {"a": 1}, "nan": True}, {"output": {"n": 2}}], lambda s: len(s.results) == 2)
    assert stand_in.results["t0"]["status"] == "failed"
    assert stand_in.results["t0"]["error"]["field"] == "output.x"
    assert stand_in.results["t1"]["output"] == {"n": 2}
    assert stand_in.left
