"""A real `Agent` running chained pipeline stages against a controller faked with `httpx.MockTransport`.

Given leases of runs whose stages may all chain on this worker, when the agent runs them back to back, then each
run's results travel in one report (a result waits for the stage chained after it, and a hold left over from an
earlier run never sends a later run's first result alone), and that report asks for work only if its results
queue some (`lease.if_queued`): the run's last stage queues nothing, so its commit waits for no look at the queue.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from turnout.gpu.provider import discover
from turnout.models import Device, Variant
from turnout.resources import parse_resources
from turnout.worker import agent as agent_module
from turnout.worker.agent import Agent, AgentSettings
from turnout.worker.pools import ProcessPool, Runnable
from turnout.worker.processes import EventSink, Outcome, ProtocolProcess

SECRET = "tws_fake"
STAGE_S = 0.1  # each stage's run: a run of three spans more than one hold (see the test); long enough that a
# loaded CI host's scheduling jitter (30 ms seen) stays well inside the hold's margin over a stage (150 ms)
STAGES = 3


class Quiet(ProtocolProcess):
    """A warm process that sleeps STAGE_S and answers with no events (a stage's events would keep its
    unconfirmed result out of its parent's report)."""

    def __init__(self) -> None:
        super().__init__([], {})

    @property
    def alive(self) -> bool:
        return True

    async def start(self) -> None:
        return None

    async def run(self, task_line: str, sink: EventSink, timeout_s: float | None) -> Outcome:
        await asyncio.sleep(STAGE_S)
        return Outcome(True, output={f"s{json.loads(task_line).get('n', 0)}": True})


def first_stage(run: int) -> dict[str, Any]:
    labels = {"pipeline": "p", "stage": "0"}
    chain = [{"stage": i, "capability": "quiet", "timeout_s": None, "labels": {"pipeline": "p", "stage": str(i)}}
             for i in range(1, STAGES)]  # fmt: skip
    return {"id": f"t_run{run}", "attempt": 1, "capability": "quiet", "device": "cpu", "input": {"run": run},
            "gpus": None, "timeout_s": None, "resources": {"cpu": 1.0}, "labels": labels, "chain": chain}  # fmt: skip


class ChainingController:
    """Leases one run's first stage per poll, the next run only once the last run's report is in; accepts every
    result and confirms every chain it names; records each report."""

    def __init__(self, runs: int) -> None:
        self.waiting = [first_stage(i) for i in range(runs)]
        self.reports: list[dict[str, Any]] = []
        self.results: dict[str, dict[str, Any]] = {}
        self.idle = True  # no run in flight: the next poll may have one

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        if path == "/v1/workers/register":
            return httpx.Response(200, json={"id": "w1", "secret": SECRET,
                                             "features": ["complete_lease", "chain", "lease_if_queued"]})  # fmt: skip
        if path.endswith("/lifeline"):
            return httpx.Response(503, json={"error": {"type": "unavailable", "message": "starting"}})
        if path.endswith("/lease"):
            if self.waiting and self.idle:
                self.idle = False
                return httpx.Response(200, json={"tasks": [self.waiting.pop(0)], "cancel": []})
            await asyncio.sleep(0.005)  # a long poll, shortened
            return httpx.Response(200, json={"tasks": [], "cancel": []})
        if path.endswith("/complete"):
            self.reports.append(body)
            self.results.update({r["task_id"]: r for r in body["results"]})
            if not any(r.get("chain") for r in body["results"][-1:]):
                self.idle = True  # the run's last stage is in
            answer: dict[str, Any] = {"accepted": [r["task_id"] for r in body["results"]], "refused": []}
            chained = [r["chain"] for r in body["results"] if r.get("chain")]
            if chained:
                answer.update(chained=chained, unchained=[])
            if "lease" in body:
                answer.update(tasks=[], cancel=[], backlog=False)
            return httpx.Response(200, json=answer)
        return httpx.Response(200, json={})


def run_agent(fake: ChainingController, want: int) -> None:
    async def go() -> None:
        pool = ProcessPool(lambda key: Quiet())
        runnable = Runnable(Variant("quiet", Device.CPU, parse_resources({"cpu": 1})), pool,
                            lambda lease: json.dumps({"n": int(lease["labels"]["stage"])}))  # fmt: skip
        settings = AgentSettings(controller_url="http://controller", token="t", name="w", gpus="none", cpus=2,
                                 heartbeat_s=60, drain_grace_s=2)  # fmt: skip
        agent = Agent(settings, [runnable], discover("none"), transport=httpx.MockTransport(fake.handle))
        stop = asyncio.Event()
        running = asyncio.create_task(agent.run(stop))
        deadline = time.monotonic() + 20
        while len(fake.results) < want and time.monotonic() < deadline and not running.done():
            await asyncio.sleep(0.005)
        stop.set()
        await asyncio.wait_for(running, timeout=10)

    asyncio.run(go())


def test_back_to_back_runs_each_report_their_chained_stages_in_one_exchange(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the hold outlasts a stage (so a run's results wait for one another) but not a run: a hold left from one
    # run expires in the middle of the next one, while that run's first result waits for its second stage
    monkeypatch.setattr(agent_module, "CHAIN_HOLD_S", 2.5 * STAGE_S)
    runs = 4
    fake = ChainingController(runs)
    run_agent(fake, want=runs * STAGES)

    assert len(fake.results) == runs * STAGES
    assert all(r["status"] == "succeeded" for r in fake.results.values())
    assert [len(r["results"]) for r in fake.reports] == [STAGES] * runs  # one report per run, none split
    for report in fake.reports:
        stages = [r["task_id"] for r in report["results"]]
        assert [r.get("chain") for r in report["results"]] == [
            *stages[1:],
            None,
        ]  # in order, each naming the next
        # only the last stage asks, and only for what its result queues: a last stage queues nothing
        assert report["lease"]["if_queued"] is True


class Counting(Quiet):
    """A quiet stage that counts how many run at once, and records the order they started in."""

    now = 0
    most = 0
    started: list[str] = []

    async def run(self, task_line: str, sink: EventSink, timeout_s: float | None) -> Outcome:
        Counting.now += 1
        Counting.most = max(Counting.most, Counting.now)
        Counting.started.append(json.loads(task_line)["id"])
        try:
            return await super().run(task_line, sink, timeout_s)
        finally:
            Counting.now -= 1


class AheadController(ChainingController):
    """Leases a run's first stage and, held ahead of a free slot, one more task, in one answer."""

    def __init__(self) -> None:
        super().__init__(1)
        ahead = {**first_stage(9), "id": "t_ahead", "labels": {}, "chain": [], "ahead": True}
        self.waiting = [first_stage(0), ahead]

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/lease") and self.waiting:
            tasks, self.waiting = self.waiting, []
            return httpx.Response(200, json={"tasks": tasks, "cancel": []})
        return await super().handle(request)


def test_with_prefetch_a_chained_stage_takes_its_parents_slot_before_a_task_waiting_ahead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(agent_module, "CHAIN_HOLD_S", 2.5 * STAGE_S)  # a run's results wait for one another
    Counting.now = Counting.most = 0
    Counting.started = []
    fake = AheadController()

    async def go() -> None:
        pool = ProcessPool(lambda key: Counting())
        runnable = Runnable(Variant("quiet", Device.CPU, parse_resources({"cpu": 1})), pool,
                            lambda lease: json.dumps({"id": lease["id"], "n": int(lease["labels"].get("stage", 0))}))  # fmt: skip
        settings = AgentSettings(controller_url="http://controller", token="t", name="w", gpus="none", cpus=1,
                                 heartbeat_s=60, drain_grace_s=2, prefetch=1)  # fmt: skip
        agent = Agent(settings, [runnable], discover("none"), transport=httpx.MockTransport(fake.handle))
        stop = asyncio.Event()
        running = asyncio.create_task(agent.run(stop))
        deadline = time.monotonic() + 20
        while len(fake.results) < STAGES + 1 and time.monotonic() < deadline and not running.done():
            await asyncio.sleep(0.005)
        stop.set()
        await asyncio.wait_for(running, timeout=10)

    asyncio.run(go())
    assert len(fake.results) == STAGES + 1 and all(r["status"] == "succeeded" for r in fake.results.values())
    assert Counting.most == 1  # one core: one at a time
    run_report = next(r for r in fake.reports if r["results"][0]["task_id"] == "t_run0")
    assert len(run_report["results"]) == STAGES  # every stage chained here, in one report
    assert Counting.started[0] == "t_run0" and Counting.started[-1] == "t_ahead"  # the run's stages first
