"""A worker's `prefetch` on the controller itself (fake clock, memory store and SQLite): tasks leased ahead
of a free slot, how many, which ones, and what they never do (hold a GPU, starve a GPU task, time out while
they wait)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.inprocess.conftest import Api
from tests.inprocess.harness import HEARTBEAT_S, SHOUT_CPU, SHOUT_GPU, Harness
from turnout.config import ControllerSettings
from turnout.controller import LeaseAsk, LeaseResult
from turnout.models import Completion, Device, GpuMode, Lease, Task, TaskState, Variant
from turnout.resources import parse_resources
from turnout.tenancy import RECENT_S, parse_limits

RENDER_GPU = Variant("render", Device.GPU, parse_resources({"cpu": 1, "gpu": 1}))
HALF = Variant("half", Device.CPU, parse_resources({"cpu": 0.5}))


def lease(h: Harness, w: str, running: Sequence[str] = (), waiting: Sequence[str] = (),
          prefetch: int = 2) -> LeaseResult:  # fmt: skip
    return h.ctrl.lease(w, max_tasks=16, running=list(running), prefetch=prefetch, waiting=list(waiting))


def ids(leases: Sequence[Lease]) -> list[str]:
    return [le.task.id for le in leases]


def test_a_full_worker_takes_prefetch_more_tasks_marked_ahead_and_no_more(h: Harness) -> None:
    w = h.worker(cpu=2.0)
    tasks = [h.submit(gpu=GpuMode.NEVER) for _ in range(7)]
    got = lease(h, w)
    assert ids(got.leases) == tasks[:4]  # its 2 slots, then 2 ahead, oldest first
    assert [le.ahead for le in got.leases] == [False, False, True, True]
    assert [h.task(t).alloc.ahead for t in tasks[:4]] == [False, False, True, True]  # type: ignore[union-attr]
    assert got.full and got.backlog  # the poll parks for freed room: more waits
    # asked again with all four held (two waiting): nothing more
    again = lease(h, w, running=tasks[:4], waiting=tasks[2:4])
    assert (again.leases, again.full) == ([], True)


def test_without_prefetch_a_worker_takes_only_what_fits(h: Harness) -> None:
    w = h.worker(cpu=2.0)
    tasks = [h.submit(gpu=GpuMode.NEVER) for _ in range(4)]
    got = lease(h, w, prefetch=0)
    assert ids(got.leases) == tasks[:2] and not any(le.ahead for le in got.leases)


def test_a_result_refills_what_started_from_the_waiting_ones(h: Harness) -> None:
    w = h.worker(cpu=2.0)
    tasks = [h.submit(gpu=GpuMode.NEVER) for _ in range(7)]
    first = lease(h, w).leases
    # the first ended; the first waiting one started in its slot; its report asks for work
    done = Completion(first[0].task.id, first[0].task.attempts, True, {"ok": True}, run_s=0.01)
    ask = LeaseAsk(16, tuple(tasks[1:4]), prefetch=2, waiting=(tasks[3],))
    exchange = h.ctrl.exchange(w, [done], ask)
    assert exchange.accepted == [tasks[0]]
    assert exchange.lease is not None and ids(exchange.lease.leases) == [tasks[4]]
    assert exchange.lease.leases[0].ahead  # room held by two running and one waiting: it waits too


def test_a_task_that_started_from_waiting_shows_running_and_times_out_from_its_start(h: Harness) -> None:
    w = h.worker(cpu=1.0)
    slow, waiting = h.submit(gpu=GpuMode.NEVER), h.submit(gpu=GpuMode.NEVER, timeout_s=5)
    lease(h, w, prefetch=1)
    # the first runs for a long while; the second waits all that time, past its own timeout: never failed
    for _ in range(10):
        h.silent_for(2.0, w)
        lease(h, w, running=[slow, waiting], waiting=[waiting], prefetch=1)
        h.ctrl.reap()
    assert (h.state(slow), h.state(waiting)) == (TaskState.RUNNING, TaskState.LEASED)
    assert h.task(waiting).started_at is None
    # the first ended; the waiting one started: listed as running, it shows so, and its timeout counts from now
    h.ctrl.complete(w, [Completion(slow, 1, True, {"ok": True}, run_s=20.0)])
    started_at = h.clock.now
    lease(h, w, running=[waiting], prefetch=1)
    assert (h.state(waiting), h.task(waiting).started_at) == (TaskState.RUNNING, started_at)
    h.silent_for(4.0, w)
    h.ctrl.reap()
    assert h.state(waiting) is TaskState.RUNNING
    h.silent_for(5 + HEARTBEAT_S, w)
    h.ctrl.reap()
    task = h.task(waiting)
    assert (task.state, (task.error or {}).get("type")) == (TaskState.FAILED, "timeout")


def test_a_gpu_task_is_never_leased_ahead_nor_starved_by_cpu_tasks_taken_ahead(h: Harness) -> None:
    w = h.worker(cpu=1.0, gpus=1, variants=(SHOUT_CPU, RENDER_GPU))
    cpu_tasks = [h.submit(gpu=GpuMode.NEVER) for _ in range(2)]
    render = h.submit("render", gpu=GpuMode.REQUIRE)
    more = [h.submit(gpu=GpuMode.NEVER) for _ in range(3)]
    got = lease(h, w)
    # one slot: the first CPU task runs, the second waits; the GPU task is next in the queue and cannot wait,
    # so nothing is taken ahead past it (else each CPU task after it would take the slot it needs first)
    assert ids(got.leases) == cpu_tasks and [le.ahead for le in got.leases] == [False, True]
    # the first ended and the waiting one took its slot: still nothing ahead of the GPU task
    h.ctrl.complete(w, [Completion(cpu_tasks[0], 1, True, {"ok": True})])
    assert lease(h, w, running=[cpu_tasks[1]]).leases == []
    # the slot frees: the GPU task is leased for it, not ahead, holding its GPU
    h.ctrl.complete(w, [Completion(cpu_tasks[1], 1, True, {"ok": True})])
    [gpu_lease, *rest] = lease(h, w).leases
    assert (gpu_lease.task.id, gpu_lease.ahead, gpu_lease.device) == (render, False, Device.GPU)
    assert gpu_lease.grant is not None
    assert ids(rest) == more[:2] and all(le.ahead for le in rest)  # then CPU work again, waiting behind it
    assert h.state(more[2]) is TaskState.QUEUED


def test_a_gpu_task_waiting_for_this_workers_busy_gpu_stops_cpu_tasks_being_taken_ahead_of_it(
    h: Harness,
) -> None:
    w = h.worker(cpu=3.0, gpus=1, variants=(SHOUT_CPU, RENDER_GPU))
    first, second = h.submit("render", gpu=GpuMode.REQUIRE), h.submit("render", gpu=GpuMode.REQUIRE)
    cpu_tasks = [h.submit(gpu=GpuMode.NEVER) for _ in range(3)]
    got = lease(h, w, prefetch=4)
    # the GPU runs the first; the second waits for it in the queue; CPU tasks take the free cores, but none is
    # taken ahead of the second (each would take the core it needs when the GPU frees)
    assert ids(got.leases) == [first, *cpu_tasks[:2]] and not any(le.ahead for le in got.leases)
    assert (h.state(second), h.state(cpu_tasks[2])) == (TaskState.QUEUED, TaskState.QUEUED)


def test_a_worker_with_no_cpu_variant_has_no_room_ahead(h: Harness) -> None:
    from turnout import placement

    gpu_only = h.ctrl.store.get_worker(h.worker("g", variants=(RENDER_GPU,), gpus=2, cpu=2.0))
    mixed = h.ctrl.store.get_worker(h.worker("m", variants=(SHOUT_CPU, RENDER_GPU), gpus=2, cpu=2.0))
    assert gpu_only is not None and mixed is not None
    assert placement.ahead_room(gpu_only, [], 64) is None
    assert placement.ahead_room(mixed, [], 64) is not None


def test_a_task_that_prefers_a_gpu_busy_elsewhere_is_not_taken_ahead_to_a_cpu(h: Harness) -> None:
    gpu_worker = h.worker("g", variants=(SHOUT_GPU,), gpus=1, cpu=4.0)
    busy = h.submit(gpu=GpuMode.REQUIRE)
    assert ids(h.lease(gpu_worker)) == [busy]  # its only GPU is taken
    w = h.worker("c", cpu=1.0)
    first, prefers = h.submit(gpu=GpuMode.NEVER), h.submit(gpu=GpuMode.PREFER, gpu_wait_s=60)
    # a healthy GPU worker may take it within gpu_wait_s: it is not leased here, ahead or not
    assert ids(lease(h, w, prefetch=4).leases) == [first]
    assert h.state(prefers) is TaskState.QUEUED


def test_tasks_held_ahead_by_a_lost_worker_go_back_to_the_queue_not_charged_a_retry(h: Harness) -> None:
    w = h.worker(cpu=1.0)
    tasks = [h.submit(gpu=GpuMode.NEVER, max_retries=0) for _ in range(3)]
    assert [le.ahead for le in lease(h, w).leases] == [False, True, True]
    h.silent_for(3 * HEARTBEAT_S + 0.5)  # it stopped heartbeating
    h.ctrl.reap()
    # the one it ran used its only attempt; the two that waited there ran nothing, like leases never delivered
    first = h.task(tasks[0])
    assert (first.state, (first.error or {}).get("type")) == (TaskState.FAILED, "worker_lost")
    assert [h.state(t) for t in tasks[1:]] == [TaskState.QUEUED] * 2
    assert [h.task(t).routing.undelivered for t in tasks[1:]] == [1, 1]  # type: ignore[union-attr]
    other = h.worker("other", cpu=4.0)
    again = lease(h, other, prefetch=0).leases
    assert ids(again) == tasks[1:]  # another worker takes them, inputs and all (the sweep read none of them)
    assert [le.task.spec.input for le in again] == [{"text": "hi"}] * 2


def test_a_shared_worker_whose_room_is_kept_for_tenants_takes_nothing_ahead() -> None:
    shared = parse_limits({"*": {"reserved_share": 0.5}})
    h = Harness(settings=ControllerSettings(heartbeat_s=HEARTBEAT_S, tenant_limits=shared))
    w = h.worker(cpu=2.0)
    tasks = [h.submit(gpu=GpuMode.NEVER, tenant=t) for t in ("acme", "globex", "acme", "globex")]
    got = lease(h, w)
    assert sorted(ids(got.leases)) == sorted(tasks[:2]) and not any(le.ahead for le in got.leases)
    # with one tenant's work left, nothing is kept for another: its tasks are taken ahead as anyone's
    h.ctrl.cancel(None, tasks[3])
    h.silent_for(RECENT_S + 0.5, w)  # globex's client is not between two tasks either
    more = lease(h, w, running=ids(got.leases))
    assert ids(more.leases) == [tasks[2]] and more.leases[0].ahead


# ---- `--prefetch auto`: only tasks known short, within a budget of expected work ----------------------


def learn(h: Harness, w: str, capability: str, run_s: float, times: int = 1) -> None:
    """Tasks of `capability` run on `w` for `run_s` each and succeed: the controller now knows its run time."""
    for _ in range(times):
        task = h.submit(capability, gpu=GpuMode.NEVER)
        assert ids(lease(h, w, prefetch=0).leases) == [task]
        h.ctrl.complete(w, [Completion(task, 1, True, {"ok": True}, run_s=run_s)])


def auto(h: Harness, w: str, running: Sequence[str] = (), waiting: Sequence[str] = ()) -> LeaseResult:
    # 64 at most, and 0.125 s of expected work per core: with 2 cores, 0.25 CPU-seconds
    return h.ctrl.lease(w, max_tasks=64, running=list(running), prefetch=64, prefetch_s=0.125,
                        waiting=list(waiting))  # fmt: skip


def test_with_prefetch_s_nothing_is_held_ahead_before_the_controller_saw_a_task_of_it_end(h: Harness) -> None:
    w = h.worker(cpu=2.0)
    tasks = [h.submit(gpu=GpuMode.NEVER) for _ in range(6)]
    got = auto(h, w)
    assert ids(got.leases) == tasks[:2] and not any(le.ahead for le in got.leases)


def test_with_prefetch_s_tasks_known_short_are_held_ahead_up_to_the_budget_counting_those_waiting(
    h: Harness,
) -> None:
    w = h.worker(cpu=2.0)
    # 10 ms, always: its deviation all but gone, a core each, 24 fit in 0.25 CPU-seconds (25 would need 10 ms flat)
    learn(h, w, "shout", 0.01, times=30)
    tasks = [h.submit(gpu=GpuMode.NEVER) for _ in range(40)]
    got = auto(h, w)
    assert ids(got.leases) == tasks[:26]
    assert [le.ahead for le in got.leases] == [False] * 2 + [True] * 24
    # while the 24 wait there, no more; one started in a freed slot: one more may wait
    assert auto(h, w, running=tasks[:26], waiting=tasks[2:26]).leases == []
    h.ctrl.complete(w, [Completion(tasks[0], 1, True, {"ok": True}, run_s=0.01)])
    got = auto(h, w, running=tasks[1:26], waiting=tasks[3:26])
    assert ids(got.leases) == [tasks[26]] and got.leases[0].ahead


def test_with_prefetch_s_a_long_task_at_the_head_stops_taking_ahead_and_a_short_one_fills_the_budget(
    h: Harness,
) -> None:
    w = h.worker(cpu=2.0, variants=(SHOUT_CPU, HALF))
    learn(h, w, "shout", 0.001)
    learn(h, w, "half", 30.0)  # far beyond 0.125 s per core: never held waiting
    first = [h.submit("shout", gpu=GpuMode.NEVER) for _ in range(2)]
    long_one = h.submit("half", gpu=GpuMode.NEVER)
    after = [h.submit("shout", gpu=GpuMode.NEVER) for _ in range(3)]
    got = auto(h, w)
    # its two cores run the first two; the long one cannot wait, and the short ones behind it must not overtake
    assert ids(got.leases) == first and not any(le.ahead for le in got.leases)
    assert [h.state(t) for t in [long_one, *after]] == [TaskState.QUEUED] * 4


def test_with_prefetch_s_a_capability_that_ran_long_is_short_again_only_after_many_quick_runs(
    h: Harness,
) -> None:
    w = h.worker(cpu=2.0)
    learn(h, w, "shout", 10.0)
    tasks = [h.submit(gpu=GpuMode.NEVER) for _ in range(3)]
    got = auto(h, w)
    assert ids(got.leases) == tasks[:2] and not any(le.ahead for le in got.leases)  # ten seconds: none waits
    for t in tasks[:2]:
        h.ctrl.complete(w, [Completion(t, 1, True, {"ok": True}, run_s=0.001)])
    assert [le.ahead for le in auto(h, w).leases] == [False]  # two quick ones do not outweigh it yet
    h.ctrl.complete(w, [Completion(tasks[2], 1, True, {"ok": True}, run_s=0.001)])
    learn(h, w, "shout", 0.001, times=20)  # twenty quick ones since: the ten seconds still weigh
    check = [h.submit(gpu=GpuMode.NEVER) for _ in range(3)]
    got = auto(h, w)
    assert ids(got.leases) == check[:2] and not any(le.ahead for le in got.leases)
    assert h.state(check[2]) is TaskState.QUEUED
    for t in check[:2]:
        h.ctrl.complete(w, [Completion(t, 1, True, {"ok": True}, run_s=0.001)])
    assert ids(lease(h, w, prefetch=0).leases) == [check[2]]
    h.ctrl.complete(w, [Completion(check[2], 1, True, {"ok": True}, run_s=0.001)])
    learn(h, w, "shout", 0.001, times=80)  # a hundred and more: short now
    more = [h.submit(gpu=GpuMode.NEVER) for _ in range(5)]
    assert [le.ahead for le in auto(h, w).leases] == [False] * 2 + [True] * 3
    assert [h.state(t) for t in more] == [TaskState.LEASED] * 5


@settings(max_examples=200, deadline=None)
@given(
    wait_s=st.floats(0.001, 10),
    cpu=st.sampled_from([1.0, 2.0, 16.0]),
    waiting=st.lists(st.tuples(st.one_of(st.none(), st.floats(0, 5)), st.sampled_from([0.1, 0.5, 1.0])),
                     max_size=5),
    offers=st.lists(st.tuples(st.one_of(st.none(), st.floats(0, 5)), st.sampled_from([0.1, 0.5, 1.0])),
                    max_size=30),
)  # fmt: skip
def test_an_ahead_budget_never_books_more_expected_work_than_it_was_given_nor_an_unknown_run_time(
    wait_s: float, cpu: float, waiting: list[tuple[float | None, float]],
    offers: list[tuple[float | None, float]],
) -> None:  # fmt: skip
    from turnout.models import Worker, WorkerState
    from turnout.placement import AheadBudget

    worker = Worker("w", "w", "h", WorkerState.HEALTHY, (SHOUT_CPU,), cpu, 2**30, (), "pack", 0.0, 0.0, 1.0)
    budget = AheadBudget.of(worker, waiting, wait_s)
    given_s = wait_s * cpu - sum((r or 0.0) * c for r, c in waiting)
    booked = [(r, c) for r, c in offers if budget.take(r, c)]
    assert all(r is not None for r, _ in booked)
    assert sum(r * c for r, c in booked if r is not None) <= max(given_s, 0.0) + 1e-9
    # what it refused did not fit what was left when it came (or had no run time)
    assert budget.left_s >= -1e-9 or not booked


# ---- over the API --------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_over_the_api_a_lease_and_a_completions_lease_say_which_tasks_wait_ahead(api: Api) -> None:
    worker = await api.worker()  # 4 cores, a variant asking 1
    tasks = []
    for _ in range(7):
        api.clock.advance(0.001)  # oldest first, in the order submitted
        tasks.append((await api.submit(gpu="never"))["id"])
    resp = await worker.post("lease", {"max_tasks": 8, "wait_s": 0, "running": [], "prefetch": 2})
    leased = resp.json()["tasks"]
    assert [t["id"] for t in leased] == tasks[:6]
    assert [t.get("ahead", False) for t in leased] == [False] * 4 + [True] * 2
    held = [t["id"] for t in leased]
    body = {"results": [{"task_id": tasks[0], "attempt": 1, "status": "succeeded", "output": {}, "run_s": 0.1}],
            "lease": {"max_tasks": 8, "running": held[1:], "prefetch": 2, "waiting": [tasks[5]]}}  # fmt: skip
    answer = (await worker.post("complete", body)).json()
    assert answer["accepted"] == [tasks[0]] and [t["id"] for t in answer["tasks"]] == [tasks[6]]
    assert answer["tasks"][0]["ahead"] is True


@pytest.mark.anyio
@pytest.mark.parametrize("field,value", [("prefetch", -1), ("prefetch", 1001), ("prefetch", None),
                                         ("prefetch", 2.5), ("prefetch", "many"), ("waiting", [7]), ("waiting", "t_1"),
                                         ("prefetch_s", 0), ("prefetch_s", -1), ("prefetch_s", 3601),
                                         ("prefetch_s", "soon")])  # fmt: skip
async def test_a_lease_with_a_bad_prefetch_or_waiting_list_is_refused_naming_the_field(
    api: Api, field: str, value: object
) -> None:
    worker = await api.worker()
    resp = await worker.post("lease", {"max_tasks": 8, "wait_s": 0, "running": [], field: value})
    assert resp.status_code == 422, resp.text
    assert field in resp.text


def test_a_task_waiting_ahead_is_not_overtaken_by_a_smaller_one_leased_for_the_room(h: Harness) -> None:
    w = h.worker(cpu=1.0, variants=(SHOUT_CPU, HALF))
    big, small = h.submit("shout", gpu=GpuMode.NEVER), h.submit("half", gpu=GpuMode.NEVER)
    assert [(le.task.id, le.ahead) for le in lease(h, w, prefetch=1).leases] == [(big, False), (small, True)]
    h.ctrl.complete(w, [Completion(big, 1, True, {"ok": True})])  # the small one started in its room
    big2, small2 = h.submit("shout", gpu=GpuMode.NEVER), h.submit("half", gpu=GpuMode.NEVER)
    # half a core is free: the big one waits for a whole one, and the small one after it must not take the half
    # first (nor, as it would each time half a core frees, for ever)
    got = lease(h, w, running=[small], prefetch=1)
    assert [(le.task.id, le.ahead) for le in got.leases] == [(big2, True)]
    assert h.state(small2) is TaskState.QUEUED
    # while the big one still waits there (not started yet), the small one may only wait behind it
    h.ctrl.complete(w, [Completion(small, 1, True, {"ok": True})])
    got = lease(h, w, running=[big2], waiting=[big2], prefetch=1)
    assert [(le.task.id, le.ahead) for le in got.leases] == [(small2, True)]


# ---- a property: what a worker holds, whatever the order of leases and results -------------------

STEP = st.one_of(
    st.tuples(st.just("submit"), st.sampled_from(["shout", "half"]), st.integers(1, 4)),
    st.tuples(st.just("lease"), st.just(""), st.integers(0, 0)),
    st.tuples(st.just("finish"), st.just(""), st.integers(0, 3)),
)


@settings(max_examples=200, deadline=None)
@given(cpu=st.sampled_from([1.0, 2.0, 3.0]), prefetch=st.integers(0, 3), steps=st.lists(STEP, max_size=30))
def test_a_worker_never_holds_more_than_its_cores_and_prefetch_nor_starts_more_than_its_cores(
    cpu: float, prefetch: int, steps: list[tuple[str, str, int]]
) -> None:
    h = Harness()
    w = h.worker(cpu=cpu, variants=(SHOUT_CPU, HALF))
    held: dict[str, Lease] = {}  # what the worker holds, in the order it got it
    started: list[str] = []  # the worker starts what it holds as its cores free, leased-for-room first

    def start_what_fits() -> None:
        order = [t for t, le in held.items() if not le.ahead] + [t for t, le in held.items() if le.ahead]
        for t in order:
            used = sum(held[s].resources.cpu for s in started)
            if t not in started and (not started or used + held[t].resources.cpu <= cpu + 1e-9):
                started.append(t)

    for op, capability, n in steps:
        if op == "submit":
            for _ in range(n):
                h.submit(capability, gpu=GpuMode.NEVER)
        elif op == "lease":
            waiting = [t for t in held if t not in started]
            got = lease(h, w, running=list(held), waiting=waiting, prefetch=prefetch)
            for le in got.leases:
                held[le.task.id] = le
        elif started:
            t = started.pop(min(n, len(started) - 1))
            h.ctrl.complete(w, [Completion(t, held.pop(t).task.attempts, True, {"ok": True})])
        mine = [t for t in h.ctrl.active_tasks() if t.worker_id == w]
        assert {t.id for t in mine} == set(held)
        total = sum(t.alloc.cpu for t in mine if t.alloc)
        assert total <= cpu + prefetch * 0.5 + 1e-9 or len(mine) == 1, (total, cpu, prefetch)
        assert all(not le.ahead for le in held.values()) or prefetch > 0
        start_what_fits()
        assert all(t in started for t, le in held.items() if not le.ahead)  # leased for its room: it fits now


def test_a_task_listed_after_its_own_result_ended_it_is_not_stopped_nor_read_again(h: Harness) -> None:
    """Under load a worker lists tasks whose results are on their way: those ended by their own result here
    need no read to know it; one cancelled meanwhile is still stopped."""
    w = h.worker(cpu=2.0)
    done, cancelled = h.submit(gpu=GpuMode.NEVER), h.submit(gpu=GpuMode.NEVER)
    lease(h, w, prefetch=0)
    h.ctrl.complete(w, [Completion(done, 1, True, {"ok": True}, run_s=0.01)])
    h.ctrl.cancel(None, cancelled)
    read: list[str] = []
    get_tasks = h.ctrl.store.get_tasks

    def counted(ids: Sequence[str]) -> list[Task]:
        read.extend(ids)
        return get_tasks(ids)

    h.ctrl.store.get_tasks = counted  # type: ignore[method-assign]
    got = lease(h, w, running=[done, cancelled], prefetch=0)
    assert got.cancel == [cancelled] and read == [cancelled]


def test_a_lease_reads_what_its_worker_holds_without_their_inputs_and_loses_none(h: Harness) -> None:
    """A worker may hold 64 tasks (`--prefetch auto`) whose inputs may be large: its room needs none of them
    (`bench_controller`: a lease of 64 held tasks of 100 kB each cost 8.1 ms of CPU, 2.4 without their inputs,
    against 1.2 with none at all)."""
    w = h.worker(cpu=2.0)
    tasks = [h.submit(gpu=GpuMode.NEVER) for _ in range(4)]
    lease(h, w)
    asked: list[bool] = []
    active_tasks = h.ctrl.store.active_tasks

    def spied(worker_ids: Sequence[str] | None = None, *, inputs: bool = True) -> list[Task]:
        asked.append(inputs)
        return active_tasks(worker_ids, inputs=inputs)

    h.ctrl.store.active_tasks = spied  # type: ignore[method-assign]
    h.silent_for(1.0, w)  # the two in its slots have run a while: this lease marks them running
    lease(h, w, running=tasks, waiting=tasks[2:])
    assert asked == [False]
    assert [h.state(t) for t in tasks] == [TaskState.RUNNING] * 2 + [TaskState.LEASED] * 2
    assert {str(h.task(t).spec.input) for t in tasks} == {"{'text': 'hi'}"}  # written back as they were
