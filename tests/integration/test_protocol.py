"""The worker protocol's exchange: results and the next lease in one request, against a real controller.

A worker stand-in speaks the protocol over HTTP on loopback to a controller subprocess on a real SQLite file
(the agent itself is tested further down, in-process against the same kind of controller); two replicas on
one PostgreSQL database race for one worker at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.conftest import Cluster, Processes
from tests.pg import fresh_database
from turnout.config import ControllerSettings
from turnout.controller import Controller
from turnout.gpu.provider import discover
from turnout.models import Device, TaskSpec, Variant
from turnout.resources import parse_resources
from turnout.store import open_store
from turnout.worker.agent import Agent, AgentSettings
from turnout.worker.pools import ProcessPool, Runnable
from turnout.worker.processes import EventSink, Outcome, ProtocolProcess

CONFIG = """
pipelines:
  hop2:
    stages:
      - {capability: hop, gpu: never}
      - {capability: hop, gpu: never}
  naps:
    stages:
      - {capability: napstage, gpu: never}
      - {capability: napstage, gpu: never}
      - {capability: napstage, gpu: never}
"""
LINKS = 10  # pipelines links0..links9, each of its own capability: one per test below, whatever ran before
CONFIG += "".join(
    f"  links{n}:\n    stages:\n      - {{capability: link{n}, gpu: never}}\n"
    f"      - {{capability: link{n}, gpu: never, timeout_s: 7}}\n      - {{capability: link{n}, gpu: never}}\n"
    for n in range(LINKS)
)
CONFIG += "  drained:\n    stages:\n      - {capability: napd, gpu: never}\n      - {capability: napd, gpu: never}\n"
# a first stage smaller than the next: the room it frees does not hold the next stage while another task runs
CONFIG += (
    "  bigger:\n    stages:\n      - {capability: tiny, gpu: never}\n      - {capability: big, gpu: never}\n"
)


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One controller with the pipeline above; each test registers stand-ins of its own capabilities."""
    tmp = tmp_path_factory.mktemp("protocol")
    (tmp / "turnout.yaml").write_text(CONFIG)
    procs = Processes()
    try:
        c = Cluster(
            tmp, procs, f"sqlite:///{tmp / 'turnout.db'}", extra_args=["--config", str(tmp / "turnout.yaml")]
        )
        c.start_controller()
        yield c
    finally:
        procs.stop_all()


@dataclass
class StandIn:
    """A worker that speaks the protocol by hand: register, lease, complete."""

    c: Cluster
    id: str
    headers: dict[str, str]
    features: list[str]

    def lease(
        self, max_tasks: int = 16, running: list[str] | None = None, wait_s: float = 0
    ) -> dict[str, Any]:
        body = {"max_tasks": max_tasks, "running": running or [], "wait_s": wait_s}
        resp = self.c.api("POST", f"/v1/workers/{self.id}/lease", json=body, headers=self.headers)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def complete(self, results: list[dict[str, Any]], lease: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"results": results}
        if lease is not None:
            body["lease"] = lease
        resp = self.c.api("POST", f"/v1/workers/{self.id}/complete", json=body, headers=self.headers)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def heartbeat(self) -> None:
        resp = self.c.api("POST", f"/v1/workers/{self.id}/heartbeat", json={}, headers=self.headers)
        assert resp.status_code == 200, resp.text


def stand_in(
    c: Cluster,
    capability: str,
    *,
    cpu: float = 1.0,
    task_cpu: float = 0.5,
    heartbeat_s: float = 60,
    also: dict[str, float] | None = None,
) -> StandIn:
    """A stand-in offering `capability` (each task `task_cpu`) and the capabilities in `also` (name: cpu)."""
    sizes = {capability: task_cpu, **(also or {})}
    variants = [
        {"capability": name, "device": "cpu", "resources": {"cpu": size}} for name, size in sizes.items()
    ]
    body = {"name": f"stand-in-{capability}", "host": "h", "variants": variants, "cpu": cpu, "memory": 2**30,
            "heartbeat_s": heartbeat_s}  # fmt: skip
    answer = c.api("POST", "/v1/workers/register", json=body).json()
    return StandIn(c, answer["id"], {"X-Worker-Secret": answer["secret"]}, answer.get("features", []))


@contextlib.contextmanager
def heartbeating(w: StandIn, every_s: float = 0.3) -> Iterator[None]:
    """Keep the stand-in alive (a heartbeat every `every_s`) for as long as the block runs."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(every_s):
            w.heartbeat()

    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    try:
        yield
    finally:
        stop.set()
        beater.join(timeout=10)


def ok(lease: dict[str, Any], output: Any = None) -> dict[str, Any]:
    return {
        "task_id": lease["id"],
        "attempt": lease["attempt"],
        "status": "succeeded",
        "output": output or {},
    }


def submit(c: Cluster, capability: str, n: int) -> list[str]:
    resp = c.api("POST", "/v1/tasks/batch", json={"tasks": [{"capability": capability, "input": {"i": i}}
                                                             for i in range(n)]})  # fmt: skip
    assert resp.status_code == 201, resp.text
    return [t["id"] for t in resp.json()["tasks"]]


def task(c: Cluster, task_id: str) -> dict[str, Any]:
    return c.api("GET", f"/v1/tasks/{task_id}").json()


def test_a_completion_carrying_a_lease_answers_its_verdicts_and_the_next_tasks(controller: Cluster) -> None:
    w = stand_in(controller, "ex1")  # room for two tasks of 0.5 cpu
    # named at registration: a worker uses only what is offered
    assert w.features == [
        "complete_lease",
        "chain",
        "lease_if_queued",
        "channel",
        "prefetch",
        "prefetch_s",
        "prefetch_gpu",
    ]
    ids = submit(controller, "ex1", 4)  # one batch: leased in id order, not the order submitted
    (first,) = w.lease(max_tasks=1)["tasks"]

    answer = w.complete([ok(first, {"n": 1})], lease={"max_tasks": 16, "running": []})

    assert answer["accepted"] == [first["id"]] and answer["refused"] == [] and answer["cancel"] == []
    assert answer["backlog"] is True  # one task for it stays queued: its next results should ask for work
    given = {t["id"] for t in answer["tasks"]}
    assert len(given) == 2 and first["id"] not in given  # the room the result freed, and what was free
    assert task(controller, first["id"])["state"] == "succeeded"
    assert {task(controller, i)["worker"] for i in given} == {w.id}
    (left,) = set(ids) - given - {first["id"]}
    assert task(controller, left)["state"] == "queued"
    # without `lease`, the answer is what it always was
    assert set(w.complete([ok(answer["tasks"][0])])) == {"accepted", "refused"}


def test_a_completion_asking_for_work_with_none_queued_gets_its_verdicts_and_no_tasks(
    controller: Cluster,
) -> None:
    w = stand_in(controller, "ex5")
    submit(controller, "ex5", 1)
    (leased,) = w.lease()["tasks"]
    assert w.complete([ok(leased)], lease={"max_tasks": 16, "running": []}) == {
        "accepted": [leased["id"]], "refused": [], "tasks": [], "cancel": [], "backlog": False}  # fmt: skip


def test_a_refused_result_is_refused_and_the_lease_it_carries_still_answers(controller: Cluster) -> None:
    w = stand_in(controller, "ex2", cpu=0.5)  # room for one
    submit(controller, "ex2", 2)
    (leased,) = w.lease()["tasks"]
    late = {**ok(leased), "attempt": leased["attempt"] + 1}  # not the current attempt: refused
    answer = w.complete([late], lease={"max_tasks": 4, "running": [leased["id"]]})
    assert answer["accepted"] == [] and answer["refused"] == [leased["id"]]
    assert answer["tasks"] == [] and answer["cancel"] == []  # still full: the first task still runs here


def test_a_pipelines_next_stage_goes_straight_back_to_the_worker_that_ran_the_last(
    controller: Cluster,
) -> None:
    w = stand_in(controller, "hop")
    run = controller.api("POST", "/v1/pipelines/hop2/runs", json={"input": {"x": 1}}).json()
    (stage0,) = w.lease()["tasks"]
    assert stage0["labels"] == {"pipeline": "hop2", "stage": "0"}

    answer = w.complete([ok(stage0, {"first": True})], lease={"max_tasks": 16, "running": []})

    (stage1,) = answer["tasks"]  # queued by the result, leased in the same commit
    assert stage1["labels"] == {"pipeline": "hop2", "stage": "1"}
    assert stage1["input"] == {"x": 1, "first": True}
    assert w.complete([ok(stage1, {"second": True})])["accepted"] == [stage1["id"]]
    done = controller.api("GET", f"/v1/pipeline-runs/{run['id']}", params={"wait": 10}).json()
    assert done["state"] == "succeeded"
    assert [s["worker"] for s in done["stages"]] == [w.id, w.id]


def test_a_lease_asked_if_queued_looks_only_where_the_results_queued_work(controller: Cluster) -> None:
    """`if_queued`: the worker asks for what its results may queue (a pipeline's next stage, a retry). Where
    they queued nothing, the commit waits for no look at the queue, though other work is queued there (the
    long poll takes that); where they did, the lease answers as any."""
    w = stand_in(controller, "hop")
    run = controller.api("POST", "/v1/pipelines/hop2/runs", json={"input": {"x": 1}}).json()
    (stage0,) = w.lease()["tasks"]

    answer = w.complete([ok(stage0)], lease={"max_tasks": 16, "running": [], "if_queued": True})
    (stage1,) = answer["tasks"]  # the result queued the run's next stage: leased in the same commit
    assert stage1["labels"] == {"pipeline": "hop2", "stage": "1"}
    submit(controller, "hop", 1)  # other work this worker could take, queued by a client

    answer = w.complete([ok(stage1)], lease={"max_tasks": 16, "running": [], "if_queued": True})
    assert answer["accepted"] == [stage1["id"]]
    assert answer["tasks"] == []  # the last stage queued nothing: the client's task was not looked for
    assert controller.api("GET", f"/v1/pipeline-runs/{run['id']}").json()["state"] == "succeeded"
    (other,) = w.lease()["tasks"]  # the long poll takes it
    assert other["labels"] == {}
    # without if_queued, the same ask looks as it always did
    submit(controller, "hop", 1)
    assert len(w.complete([ok(other)], lease={"max_tasks": 16, "running": []})["tasks"]) == 1


def test_concurrent_lease_requests_of_one_worker_never_over_commit_it(controller: Cluster) -> None:
    """Long polls and completions asking for work, all at once: room comes from the store, so the worker never
    holds more than fits and no task is leased twice. The polls' lists of what runs are written before the
    completions' leases and wait past the undelivered grace (3 s): they re-queue none of those leases."""
    w = stand_in(controller, "ex3", cpu=1.0, task_cpu=0.25, heartbeat_s=1)  # room for four
    ids = submit(controller, "ex3", 24)
    with heartbeating(w):
        held = w.lease(max_tasks=4)["tasks"]
        assert len(held) == 4
        running = [t["id"] for t in held]

        def poll() -> dict[str, Any]:
            return w.lease(max_tasks=16, running=running, wait_s=5)

        def finish(lease: dict[str, Any]) -> dict[str, Any]:
            rest = [t for t in running if t != lease["id"]]
            return w.complete([ok(lease)], lease={"max_tasks": 16, "running": rest})

        with ThreadPoolExecutor(max_workers=5) as pool:
            polls = [pool.submit(poll) for _ in range(3)]
            exchanges = [pool.submit(finish, lease) for lease in held[:2]]
            answers = [f.result(timeout=60) for f in exchanges + polls]

        given = [t["id"] for a in answers for t in a["tasks"]]
        assert len(given) == len(set(given)), "a task was leased twice"
        assert len(given) == 2, f"two results freed two slots; {len(given)} tasks were leased"
        states = {i: task(controller, i) for i in ids}
        active = [i for i, t in states.items() if t["state"] in ("leased", "running")]
        assert sorted(active) == sorted([*running[2:], *given])  # four, none taken back as undelivered
        assert all(states[i]["attempts"] == 1 for i in given)
        assert not any(a["cancel"] for a in answers)


# ---- the agent uses the exchange ----------------------------------------------------------------


class Napping(ProtocolProcess):
    """A task process in-process: naps `nap_s` of its input, then answers its input."""

    def __init__(self) -> None:
        super().__init__([], {})

    async def start(self) -> None:
        return None

    async def run(self, task_line: str, sink: EventSink, timeout_s: float | None) -> Outcome:
        data = json.loads(task_line)
        await asyncio.sleep(float(data.get("nap_s", 0)))
        return Outcome(True, output=data, started_at=time.time())


class Recorded(httpx.AsyncBaseTransport):
    """Real HTTP to the controller, each `complete` exchange kept (request body and answer) for the test."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.exchanges: list[tuple[dict[str, Any], dict[str, Any]]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path.endswith("/complete"):
            await response.aread()
            self.exchanges.append((json.loads(request.content), json.loads(response.content)))
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def agent_for(c: Cluster, capability: str, transport: httpx.AsyncBaseTransport, cpus: float = 1) -> Agent:
    """An agent whose tasks each take one CPU: `cpus` is how many it runs at once."""
    runnable = Runnable(Variant(capability, Device.CPU, parse_resources({"cpu": 1})),
                        ProcessPool(lambda key: Napping()), lambda lease: json.dumps(lease["input"]))  # fmt: skip
    settings = AgentSettings(controller_url=c.url, token=c.token, name=f"agent-{capability}", gpus="none",
                             cpus=cpus, heartbeat_s=1, drain_grace_s=2)  # fmt: skip
    return Agent(settings, [runnable], discover("none"), transport=transport)


def serving(c: Cluster, capability: str, cpus: float, work: Callable[[], None]) -> Recorded:
    """Run an agent (its HTTP recorded) while `work` runs on a thread; stop it however `work` ends."""
    recorded = Recorded()

    async def go() -> None:
        agent = agent_for(c, capability, recorded, cpus)
        stop = asyncio.Event()
        running = asyncio.create_task(agent.run(stop))
        try:
            await asyncio.wait_for(agent._registered.wait(), 30)
            await asyncio.to_thread(work)
        finally:
            stop.set()
            await asyncio.wait_for(running, 30)

    asyncio.run(go())
    return recorded


def test_a_pipelines_later_stages_start_where_the_first_ran_with_no_round_trip_between_them(
    controller: Cluster,
) -> None:
    done: dict[str, Any] = {}

    def work() -> None:
        run = controller.api("POST", "/v1/pipelines/naps/runs", json={"input": {"nap_s": 0}}).json()
        done.update(controller.api("GET", f"/v1/pipeline-runs/{run['id']}", params={"wait": 30}).json())

    recorded = serving(controller, "napstage", 4, work)  # room to spare: no backlog, nothing asks for work

    assert done["state"] == "succeeded", done
    assert [s["reason"].split(";")[0] for s in done["stages"][1:]] == [
        f"chained after stage 0 on {done['stages'][0]['worker']}",
        f"chained after stage 1 on {done['stages'][0]['worker']}",
    ]
    results = [r for body, _ in recorded.exchanges for r in body["results"]]
    named = [r.get("chain") for r in results]
    assert named == [done["stages"][1]["task_id"], done["stages"][2]["task_id"], None]  # each named the next
    assert not [t for _, answer in recorded.exchanges for t in answer.get("tasks", [])]  # none was leased
    assert [c for _, answer in recorded.exchanges for c in answer.get("chained", [])] == named[:2]


def test_an_idle_workers_result_asks_for_no_work_and_its_long_poll_takes_the_next(
    controller: Cluster,
) -> None:
    def work() -> None:
        for i in range(3):
            task_id = controller.submit("nap3", {"nap_s": 0, "i": i})["id"]
            assert controller.result(task_id, 30)["state"] == "succeeded"

    recorded = serving(controller, "nap3", 4, work)
    assert len(recorded.exchanges) >= 1
    assert not any("lease" in body for body, _ in recorded.exchanges)  # its commit waits for no empty lease


def test_a_full_workers_result_asks_for_work_and_runs_what_the_answer_leases(controller: Cluster) -> None:
    """Room for one task: while the first naps, the worker's long poll waits for capacity; the first one's
    result asks for work, and the second task comes back in that answer and runs."""

    def work() -> None:
        ids = [controller.submit("nap1", {"nap_s": 0.5, "i": i})["id"] for i in range(2)]
        for task_id in ids:
            assert controller.result(task_id, 30)["state"] == "succeeded"

    recorded = serving(controller, "nap1", 1, work)
    asked = [(body, answer) for body, answer in recorded.exchanges if "lease" in body]
    assert asked, "no completion asked for work"
    leased_by_exchange = [t["id"] for _, answer in asked for t in answer.get("tasks", [])]
    assert leased_by_exchange, "no task came back in a completion's answer"


def test_a_cancel_answers_only_the_tasks_started_before_its_request_was_sent(controller: Cluster) -> None:
    """Two lease answers may cross: a `cancel` written for an older list must not stop a task leased since."""

    async def go() -> None:
        agent = agent_for(controller, "nap2", httpx.AsyncHTTPTransport())
        try:
            before = agent._started
            agent._accept({"tasks": [{"id": "t_x", "attempt": 2, "capability": "nap2", "device": "cpu",
                                      "input": {"nap_s": 30}}], "cancel": []}, before)  # fmt: skip
            job = agent.running["t_x"]
            agent._accept({"tasks": [], "cancel": ["t_x"]}, before)  # sent before t_x started: not about it
            await asyncio.sleep(0.05)
            assert not job.done()
            agent._accept({"tasks": [], "cancel": ["t_x"]}, agent._started)  # sent after: it is
            await asyncio.wait_for(job, 5)
            assert "t_x" not in agent.running and agent._completions == []  # stopped, and nothing to report
        finally:
            for r in agent.runnables.values():
                await r.pool.close()
            await agent.client.aclose()
            agent.files.close()

    asyncio.run(go())


# ---- two replicas, one worker -------------------------------------------------------------------


@pytest.mark.postgres
def test_two_replicas_leasing_for_one_worker_at_once_take_turns() -> None:
    """Replica A leases for a worker and has not committed; replica B's lease for the same worker waits for it,
    then finds the worker full. Without the hold, B would compute the same free room and lease it again."""
    with fresh_database() as url:
        stores = [open_store(url), open_store(url)]
        try:
            a, b = (Controller(s, ControllerSettings()) for s in stores)
            hop = Variant("race", Device.CPU, parse_resources({"cpu": 0.5}))
            worker = a.register_worker(name="w", host="h", variants=[hop], cpu=1.0, memory_bytes=2**30, gpus=[],
                                       strategy="pack")  # fmt: skip
            a.submit("default", [TaskSpec(capability="race", input={"i": i}) for i in range(6)])
            got: dict[str, int] = {}
            with stores[0].group():
                got["a"] = len(a.lease(worker.id, max_tasks=16).leases)

                def other() -> None:
                    with stores[1].group():
                        got["b"] = len(b.lease(worker.id, max_tasks=16).leases)

                racer = threading.Thread(target=other)
                racer.start()
                racer.join(timeout=1.0)
                assert racer.is_alive(), "replica B leased while replica A held the worker"
            racer.join(timeout=30)
            assert got == {"a": 2, "b": 0}
        finally:
            for s in stores:
                s.close()


def test_answers_encoded_in_one_step_still_carry_integers_beyond_64_bits(controller: Cluster) -> None:
    """orjson writes the hot routes' answers; an input integer it cannot write (past 64 bits) is written by the
    standard library instead, never a 500: in the submit answer, the task, its result and the lease."""
    w = stand_in(controller, "big")
    huge = 2**70 + 1
    made = controller.api("POST", "/v1/tasks", json={"capability": "big", "input": {"n": huge}})
    assert made.status_code == 201, made.text
    assert made.json()["input"] == {"n": huge}
    (leased,) = w.lease()["tasks"]
    assert leased["input"] == {"n": huge}
    assert w.complete([ok(leased, {"m": -huge})])["accepted"] == [leased["id"]]
    assert controller.result(leased["id"], 10)["output"] == {"m": -huge}


# ---- chained stages by hand: what the controller accepts and refuses ----------------------------------------


def chain_id() -> str:
    from turnout.models import new_id

    return new_id("t_")


def links(
    c: Cluster, n: int, *, cpu: float = 4, data: dict[str, Any] | None = None
) -> tuple[StandIn, dict[str, Any], dict[str, Any]]:
    """A stand-in serving `link{n}`, a `links{n}` run, and its first stage's lease, taken by the stand-in."""
    w = stand_in(c, f"link{n}", cpu=cpu)
    run = c.api("POST", f"/v1/pipelines/links{n}/runs", json={"input": data or {"x": 1}}).json()
    (stage0,) = w.lease()["tasks"]
    assert stage0["labels"] == {"pipeline": f"links{n}", "stage": "0"}
    return w, run, stage0


def test_a_stage_lease_lists_the_stages_that_may_start_after_it_on_the_same_worker(
    controller: Cluster,
) -> None:
    _, _, stage0 = links(controller, 0)
    assert stage0["chain"] == [
        {"stage": 1, "capability": "link0", "timeout_s": 7.0, "labels": {"pipeline": "links0", "stage": "1"}},
        {
            "stage": 2,
            "capability": "link0",
            "timeout_s": None,
            "labels": {"pipeline": "links0", "stage": "2"},
        },
    ]


def test_results_naming_chained_stages_create_each_leased_here_and_settle_in_one_report(
    controller: Cluster,
) -> None:
    w, run, stage0 = links(controller, 1, data={"x": 1})
    one, two = chain_id(), chain_id()

    answer = w.complete([
        {**ok(stage0, {"a": 1}), "chain": one},
        {"task_id": one, "attempt": 1, "status": "succeeded", "output": {"b": 2}, "chain": two},
        {"task_id": two, "attempt": 1, "status": "succeeded", "output": {"c": 3}},
    ])  # fmt: skip

    assert answer == {
        "accepted": [stage0["id"], one, two],
        "refused": [],
        "chained": [one, two],
        "unchained": [],
    }
    done = controller.api("GET", f"/v1/pipeline-runs/{run['id']}", params={"wait": 10}).json()
    assert done["state"] == "succeeded" and done["output"] == {"c": 3}
    assert [s["task_id"] for s in done["stages"]] == [stage0["id"], one, two]
    assert [s["worker"] for s in done["stages"]] == [w.id] * 3
    assert task(controller, one)["input"] == {"x": 1, "a": 1}  # what the controller would have queued
    assert task(controller, two)["input"] == {"x": 1, "a": 1, "b": 2}
    assert all(s["queue_s"] is not None and s["queue_s"] >= 0 for s in done["stages"])


@pytest.mark.parametrize("n,why", [(2, "taken"), (3, "malformed"), (4, "drained")])
def test_a_chain_that_cannot_stand_is_refused_and_the_stage_is_queued_as_usual(
    controller: Cluster, n: int, why: str
) -> None:
    w, run, stage0 = links(controller, n)
    child = {"taken": stage0["id"], "malformed": "t_nothex", "drained": chain_id()}[why]
    if why == "drained":
        assert controller.api("POST", f"/v1/workers/{w.id}/drain").status_code == 200

    answer = w.complete([{**ok(stage0), "chain": child}])

    assert answer["accepted"] == [stage0["id"]]
    assert answer["chained"] == [] and answer["unchained"] == [child]
    queued = controller.api("GET", f"/v1/pipeline-runs/{run['id']}").json()["stages"][1]
    assert queued["task_id"] != child and queued["state"] == "queued"


def test_a_chain_the_worker_has_no_room_for_is_refused(controller: Cluster) -> None:
    w = stand_in(controller, "tiny", cpu=1.0, task_cpu=0.25, also={"big": 1.0})
    run = controller.api("POST", "/v1/pipelines/bigger/runs", json={"input": {}}).json()
    (stage0,) = w.lease(max_tasks=1)["tasks"]
    other = controller.submit("tiny", {"other": True})
    assert [t["id"] for t in w.lease()["tasks"]] == [other["id"]]  # 0.5 of 1 CPU held; stage 0 frees 0.25
    child = chain_id()

    answer = w.complete([{**ok(stage0), "chain": child}])

    assert answer["unchained"] == [child]
    assert controller.api("GET", f"/v1/pipeline-runs/{run['id']}").json()["stages"][1]["state"] == "queued"


def test_a_chain_named_again_after_a_lost_answer_is_answered_the_same(controller: Cluster) -> None:
    w, _, stage0 = links(controller, 6)
    one = chain_id()
    first = w.complete([{**ok(stage0), "chain": one}])
    again = w.complete([{**ok(stage0), "chain": one}])
    assert first["chained"] == again["chained"] == [one] and again["accepted"] == [stage0["id"]]
    assert task(controller, one)["state"] == "leased" and task(controller, one)["worker"] == w.id


def test_a_chain_after_a_refused_result_is_never_created(controller: Cluster) -> None:
    w, run, stage0 = links(controller, 7)
    assert controller.api("POST", f"/v1/pipeline-runs/{run['id']}/cancel").status_code == 200
    one = chain_id()
    answer = w.complete([{**ok(stage0), "chain": one}, {"task_id": one, "attempt": 1, "status": "succeeded"}])
    assert answer["accepted"] == [] and set(answer["refused"]) == {stage0["id"], one}
    assert controller.api("GET", f"/v1/tasks/{one}").status_code == 404


def test_an_agent_whose_chain_is_refused_stops_that_stage_and_never_reports_it(controller: Cluster) -> None:
    """The worker is drained while stage 0 naps: the agent does not know, starts stage 1 as stage 0 ends, and
    the controller refuses the chain (a draining worker takes no new work) and queues stage 1 instead."""
    seen: dict[str, Any] = {}

    def work() -> None:
        run = controller.api("POST", "/v1/pipelines/drained/runs", json={"input": {"nap_s": 0.5}}).json()
        workers = controller.api("GET", "/v1/workers").json()["workers"]
        (me,) = [w["id"] for w in workers if w["name"] == "agent-napd" and w["state"] == "healthy"]
        assert controller.api("POST", f"/v1/workers/{me}/drain").status_code == 200
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            seen.update(controller.api("GET", f"/v1/pipeline-runs/{run['id']}").json())
            if seen["stages"][1]["state"] == "queued":
                break
            time.sleep(0.05)
        time.sleep(1.0)  # what the agent stopped stays stopped: no report of it comes
        controller.api("POST", f"/v1/pipeline-runs/{run['id']}/cancel")

    recorded = serving(controller, "napd", 4, work)

    assert seen["stages"][0]["state"] == "succeeded" and seen["stages"][1]["state"] == "queued", seen
    named = [r["chain"] for body, _ in recorded.exchanges for r in body["results"] if r.get("chain")]
    refused = [c for _, answer in recorded.exchanges for c in answer.get("unchained", [])]
    assert len(named) == 1 and refused == named and named[0] != seen["stages"][1]["task_id"]
    reported = {r["task_id"] for body, _ in recorded.exchanges for r in body["results"]}
    assert named[0] not in reported  # the stage it started was stopped, and its result never sent
    assert controller.api("GET", f"/v1/tasks/{named[0]}").status_code == 404
