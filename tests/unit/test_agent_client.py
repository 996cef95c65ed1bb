"""The agent against a controller faked with `httpx.MockTransport`: no subprocess, no socket.

Given a stand-in controller that leases tasks and records what the worker sends, when a real `Agent` runs all
its loops, then each leased task runs in its variant's pool and its result comes back in a `complete`; a result
sent while work stays queued asks for the next lease in the same request, and what that answer leases runs too.
`ControllerClient` itself is checked call by call.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from turnout.errors import InvalidInput
from turnout.gpu.provider import discover
from turnout.models import Device, Variant
from turnout.resources import parse_resources
from turnout.worker.agent import Agent, AgentSettings, prefetch_of
from turnout.worker.client import ControllerClient
from turnout.worker.pools import ProcessPool, Runnable
from turnout.worker.processes import EventSink, Outcome, ProtocolProcess

SECRET = "tws_fake"


class Doubler(ProtocolProcess):
    """A warm process that answers `{"n": x}` with `{"n": 2x}` and a progress event; counts who is alive."""

    live = 0
    peak = 0

    def __init__(self) -> None:
        super().__init__([], {})
        self.up = False

    @property
    def alive(self) -> bool:
        return self.up

    async def start(self) -> None:
        self.up = True
        Doubler.live += 1
        Doubler.peak = max(Doubler.peak, Doubler.live)

    async def run(self, task_line: str, sink: EventSink, timeout_s: float | None) -> Outcome:
        data = json.loads(task_line)
        sink({"event": "progress", "done": 1, "total": 1})
        await asyncio.sleep(0.01)
        return Outcome(True, output={"n": 2 * data["n"]})

    def kill(self) -> None:
        if self.up:
            self.up = False
            Doubler.live -= 1

    async def close(self) -> None:
        self.kill()


def task(task_id: str, n: int) -> dict[str, Any]:
    return {"id": task_id, "attempt": 1, "capability": "double", "device": "cpu", "input": {"n": n},
            "gpus": None, "timeout_s": None, "resources": {"cpu": 1.0}}  # fmt: skip


class FakeController:
    """Leases `first` on the first poll (saying more work waits: `backlog`), and `then` to the first completion
    that asks for work; records every call by path."""

    def __init__(self, first: list[dict[str, Any]], then: list[dict[str, Any]],
                 features: tuple[str, ...] = ("complete_lease",)) -> None:  # fmt: skip
        self.first, self.then, self.features = first, then, list(features)
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.results: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        self.calls.append((path, body))
        if path == "/v1/workers/register":
            return httpx.Response(200, json={"id": "w1", "secret": SECRET, "features": self.features})
        assert request.headers.get("X-Worker-Secret") == SECRET
        if path.endswith("/lifeline"):  # not held here: the agent keeps asking, with backoff
            return httpx.Response(503, json={"error": {"type": "unavailable", "message": "starting"}})
        if path.endswith("/lease"):
            if self.first:
                tasks, self.first = self.first, []
                return httpx.Response(200, json={"tasks": tasks, "cancel": [], "backlog": bool(self.then)})
            await asyncio.sleep(0.02)  # a long poll, shortened
            return httpx.Response(200, json={"tasks": [], "cancel": []})
        if path.endswith("/events"):
            self.events += body["events"]
            return httpx.Response(200, json={})
        if path.endswith("/complete"):
            self.results.update({r["task_id"]: r for r in body["results"]})
            answer: dict[str, Any] = {"accepted": [r["task_id"] for r in body["results"]]}
            if "lease" in body:
                answer.update(tasks=self.then, cancel=[], backlog=False)
                self.then = []
            return httpx.Response(200, json=answer)
        return httpx.Response(200, json={})


def run_agent(
    fake: FakeController, cpus: float, max_processes: int | None, want: int, **options: Any
) -> None:
    """Run an agent serving `double` until `want` results arrived (or 15 s passed), then stop it."""

    async def go() -> None:
        pool = ProcessPool(lambda key: Doubler(), max_processes=max_processes)
        runnable = Runnable(Variant("double", Device.CPU, parse_resources({"cpu": 1})), pool,
                            lambda lease: json.dumps(lease["input"]))  # fmt: skip
        settings = AgentSettings(controller_url="http://controller", token="t", name="w", gpus="none", cpus=cpus,
                                 heartbeat_s=60, drain_grace_s=2, **options)  # fmt: skip
        agent = Agent(settings, [runnable], discover("none"), transport=httpx.MockTransport(fake.handle))
        stop = asyncio.Event()
        running = asyncio.create_task(agent.run(stop))
        deadline = time.monotonic() + 15
        while len(fake.results) < want and time.monotonic() < deadline and not running.done():
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(running, timeout=10)

    Doubler.live = Doubler.peak = 0
    asyncio.run(go())


def test_a_leased_task_runs_and_its_result_comes_back_in_a_completion() -> None:
    fake = FakeController([task("t1", 21)], [])
    run_agent(fake, cpus=2, max_processes=None, want=1)

    paths = [p for p, _ in fake.calls]
    assert paths[0] == "/v1/workers/register"
    register = fake.calls[0][1]
    assert [v["capability"] for v in register["variants"]] == ["double"] and register["cpu"] == 2
    assert fake.results["t1"]["status"] == "succeeded" and fake.results["t1"]["output"] == {"n": 42}
    assert fake.results["t1"]["attempt"] == 1
    assert [e["event"]["event"] for e in fake.events if e["task_id"] == "t1"] == ["progress"]
    assert paths.index("/v1/workers/w1/events") < paths.index("/v1/workers/w1/complete")  # events first
    assert "/v1/workers/w1/leave" in paths


def test_a_result_sent_while_work_waits_asks_for_it_and_runs_what_the_answer_leases() -> None:
    fake = FakeController([task("t1", 1)], [task("t2", 2)])
    run_agent(fake, cpus=1, max_processes=None, want=2)

    completes = [body for path, body in fake.calls if path.endswith("/complete")]
    asked = [body for body in completes if "lease" in body]
    assert asked and asked[0]["results"][0]["task_id"] == "t1"  # t1's completion asked for the next task
    assert asked[0]["lease"]["max_tasks"] == 64
    assert fake.results["t2"]["output"] == {"n": 4}  # leased by that answer, and run
    assert not any(
        "t2" in [t["id"] for t in b.get("tasks", [])] for p, b in fake.calls if p.endswith("/lease")
    )


def test_an_agent_running_three_tasks_at_once_starts_no_more_processes_than_max_processes() -> None:
    fake = FakeController([task("a", 1), task("b", 2), task("c", 3)], [])
    run_agent(fake, cpus=4, max_processes=1, want=3)

    assert {t: r["output"] for t, r in fake.results.items()} == {"a": {"n": 2}, "b": {"n": 4}, "c": {"n": 6}}
    assert Doubler.peak == 1 and Doubler.live == 0


@pytest.mark.parametrize(
    "features,options,asked",
    [
        # the default, `--prefetch auto`: 64 tasks at most, 0.1 s of work per core, only to a controller that
        # tells short tasks from long (one that cannot would hold any task waiting here: it gets no prefetch)
        (("complete_lease", "prefetch", "prefetch_s"), {}, {"prefetch": 64, "prefetch_s": 0.1}),
        (("complete_lease", "prefetch"), {}, {}),
        (
            ("complete_lease", "prefetch"),
            {"prefetch": 3, "prefetch_s": None},
            {"prefetch": 3},
        ),  # --prefetch 3
        (
            ("complete_lease", "prefetch", "prefetch_s"),
            {"prefetch": 0, "prefetch_s": None},
            {},
        ),  # --prefetch 0
        # a controller that holds GPU tasks ahead, each after a running one: the worker says it honours `after`
        (
            ("complete_lease", "prefetch", "prefetch_s", "prefetch_gpu"),
            {},
            {"prefetch": 64, "prefetch_s": 0.1, "prefetch_gpu": True},
        ),
        (("complete_lease", "prefetch", "prefetch_gpu"), {"prefetch": 0, "prefetch_s": None}, {}),
    ],
)
def test_a_lease_asks_for_prefetch_as_set_and_as_the_controller_understands_it(
    features: tuple[str, ...], options: dict[str, Any], asked: dict[str, Any]
) -> None:
    fake = FakeController([task("t1", 1)], [], features=features)
    run_agent(fake, cpus=1, max_processes=None, want=1, **options)

    polls = [body for path, body in fake.calls if path.endswith("/lease")]
    assert polls
    for body in polls:
        assert {k: body[k] for k in ("prefetch", "prefetch_s", "prefetch_gpu") if k in body} == asked
        assert ("waiting" in body) == bool(asked)


@pytest.mark.parametrize(
    "text,expected", [("auto", (64, 0.1)), ("AUTO", (64, 0.1)), ("0", (0, None)), ("12", (12, None))]
)
def test_prefetch_reads_auto_or_a_number_of_tasks(text: str, expected: tuple[int, float | None]) -> None:
    assert prefetch_of(text) == expected


@pytest.mark.parametrize("text", ["", "soon", "2.5", "auto2"])
def test_a_prefetch_that_is_neither_auto_nor_a_number_is_refused_naming_the_option(text: str) -> None:
    with pytest.raises(InvalidInput, match="--prefetch") as caught:
        prefetch_of(text)
    assert caught.value.field == "prefetch"


@pytest.mark.parametrize("seconds", [0.0, -1.0, float("nan"), float("inf"), 3601.0])
def test_a_prefetch_budget_that_is_no_number_of_seconds_is_refused_naming_it(seconds: float) -> None:
    with pytest.raises(InvalidInput, match="prefetch_s") as caught:
        AgentSettings(controller_url="http://c", token="t", prefetch_s=seconds)
    assert caught.value.field == "prefetch_s"


# ---- the client, call by call ----------------------------------------------------------------------------


def client_for(handler: Any) -> ControllerClient:
    return ControllerClient("http://controller/", "tok", transport=httpx.MockTransport(handler))


def test_the_client_registers_and_then_carries_its_secret_and_token_on_every_call() -> None:
    seen: list[tuple[str, str | None, str | None]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(
            (request.url.path, request.headers.get("Authorization"), request.headers.get("X-Worker-Secret"))
        )
        if request.url.path.endswith("/register"):
            return httpx.Response(200, json={"id": "w9", "secret": SECRET, "features": ["chain"]})
        return httpx.Response(200, json={"tasks": [], "cancel": []})

    async def go() -> ControllerClient:
        client = client_for(handler)
        await client.register({"name": "w"})
        assert await client.heartbeat({}, [], timeout_s=2) is True
        assert await client.lease({"max_tasks": 1, "running": []}, wait_s=1) == {"tasks": [], "cancel": []}
        await client.report("complete", b'{"results":[]}')
        await client.leave()
        await client.aclose()
        return client

    client = asyncio.run(go())
    assert client.worker_id == "w9" and client.features == frozenset({"chain"})
    assert [p for p, _, _ in seen] == ["/v1/workers/register", "/v1/workers/w9/heartbeat", "/v1/workers/w9/lease",
                                       "/v1/workers/w9/complete", "/v1/workers/w9/leave"]  # fmt: skip
    assert all(auth == "Bearer tok" for _, auth, _ in seen)
    assert [s for _, _, s in seen[1:]] == [SECRET] * 4


def test_a_controller_that_forgot_the_worker_asks_it_to_register_again() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"error": {"type": "not_found", "message": "no such worker"}})

    async def go() -> tuple[bool, Any]:
        client = client_for(handler)
        try:
            return await client.heartbeat({}, [], timeout_s=2), await client.lease({"max_tasks": 1}, wait_s=1)
        finally:
            await client.aclose()

    assert asyncio.run(go()) == (False, None)


def test_a_refused_registration_is_invalid_input_naming_the_worker() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, json={"error": {"type": "unauthorized", "message": "bad token"}})

    async def go() -> None:
        client = client_for(handler)
        try:
            await client.register({"name": "w"})
        finally:
            await client.aclose()

    with pytest.raises(InvalidInput) as info:
        asyncio.run(go())
    assert info.value.field == "worker" and "bad token" in info.value.message


def test_leaving_and_the_lifeline_survive_a_controller_that_is_gone() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async def go() -> bool:
        client = client_for(handler)
        try:
            await client.leave()
            return await client.hold_lifeline()
        finally:
            await client.aclose()

    assert asyncio.run(go()) is False
