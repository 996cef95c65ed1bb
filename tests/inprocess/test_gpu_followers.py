"""GPU tasks held ahead on the controller itself (fake clock, memory store): with `prefetch_gpu`, a queued GPU
task may wait on its worker `after` a running one, on that task's share (`placement.Followers`). What it must
never do: hold a GPU share another task holds while both run, follow a task of another tenant, follow a task
that already has a follower, or wait where the worker cannot start it by itself."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.inprocess.harness import Harness
from turnout import placement
from turnout.controller import LeaseResult
from turnout.models import Completion, Device, GpuMode, Lease, TaskState, Variant
from turnout.resources import parse_resources

QUARTER = Variant("quarter", Device.GPU, parse_resources({"cpu": 0.25, "gpu": 0.25}))
HALF = Variant("half", Device.GPU, parse_resources({"cpu": 0.5, "gpu": 0.5}))


def lease(h: Harness, w: str, running: Sequence[str] = (), waiting: Sequence[str] = (), *,
          prefetch_gpu: bool = True, prefetch_s: float | None = None, prefetch: int = 64) -> LeaseResult:  # fmt: skip
    return h.ctrl.lease(w, max_tasks=64, running=list(running), prefetch=prefetch, prefetch_s=prefetch_s,
                        waiting=list(waiting), prefetch_gpu=prefetch_gpu)  # fmt: skip


def ids(leases: Sequence[Lease]) -> list[str]:
    return [le.task.id for le in leases]


def test_each_gpu_task_held_gets_one_follower_on_its_share_chains_grow_evenly_up_to_prefetch(
    h: Harness,
) -> None:
    w = h.worker(variants=(QUARTER,), gpus=1, cpu=1.0)
    tasks = [h.submit("quarter", gpu=GpuMode.REQUIRE) for _ in range(12)]
    first = lease(h, w, prefetch=6)
    assert ids(first.leases) == tasks[:4] and not any(le.ahead or le.after for le in first.leases)
    second = lease(h, w, running=tasks[:4], prefetch=6)
    # one follower for each of the four that run, then one for the first two of those: six wait
    assert ids(second.leases) == tasks[4:10] and all(le.ahead for le in second.leases)
    assert [le.after for le in second.leases] == [*tasks[:4], *tasks[4:6]]
    leaders = {le.task.id: le for le in [*first.leases, *second.leases]}
    for le in second.leases:
        assert le.grant is not None and le.after is not None
        assert le.grant.uuids == leaders[le.after].grant.uuids  # type: ignore[union-attr]
        assert h.task(le.task.id).alloc.after == le.after  # type: ignore[union-attr]
    # `prefetch` wait there: nothing more, and the worker hears it is full
    third = lease(h, w, running=tasks[:10], waiting=tasks[4:10], prefetch=6)
    assert (third.leases, third.full) == ([], True)
    assert [h.state(t) for t in tasks[10:]] == [TaskState.QUEUED] * 2


def test_without_prefetch_gpu_no_gpu_task_waits(h: Harness) -> None:
    w = h.worker(variants=(QUARTER,), gpus=1, cpu=1.0)
    tasks = [h.submit("quarter", gpu=GpuMode.REQUIRE) for _ in range(6)]
    assert ids(lease(h, w).leases) == tasks[:4]
    assert lease(h, w, running=tasks[:4], prefetch_gpu=False).leases == []


def test_a_follower_takes_its_leaders_share_when_it_ends_and_may_be_followed_in_turn(h: Harness) -> None:
    w = h.worker(variants=(QUARTER,), gpus=1, cpu=1.0)
    tasks = [h.submit("quarter", gpu=GpuMode.REQUIRE) for _ in range(9)]
    lease(h, w)
    followers = {le.after: le.task.id for le in lease(h, w, running=tasks[:4], prefetch=4).leases}
    assert sorted(followers) == sorted(tasks[:4])
    # the first ended; its follower started on its share; the next lease sees three leaders with followers,
    # and the started follower with none: one more task, after it, and no task for the freed share at once
    h.ctrl.complete(w, [Completion(tasks[0], 1, True, {"ok": True}, run_s=0.001)])
    started = followers[tasks[0]]
    waiting = [t for t in tasks[4:8] if t != started]
    got = lease(h, w, running=[*tasks[1:4], *tasks[4:8]], waiting=waiting, prefetch=4)
    assert [(le.task.id, le.after) for le in got.leases] == [(tasks[8], started)]


def test_a_task_of_another_tenant_never_follows_and_nothing_is_taken_ahead_of_it(h: Harness) -> None:
    w = h.worker(variants=(QUARTER,), gpus=1, cpu=1.0)
    mine = [h.submit("quarter", tenant="acme", gpu=GpuMode.REQUIRE) for _ in range(4)]
    assert ids(lease(h, w).leases) == mine
    other = h.submit("quarter", tenant="globex", gpu=GpuMode.REQUIRE)
    later = h.submit("quarter", tenant="acme", gpu=GpuMode.REQUIRE)
    # globex's task may not wait on acme's share (no scrub between them), and acme's after it may not overtake
    assert lease(h, w, running=mine).leases == []
    assert (h.state(other), h.state(later)) == (TaskState.QUEUED, TaskState.QUEUED)


def test_with_prefetch_s_a_gpu_task_follows_only_once_its_gpu_run_time_is_known_short(h: Harness) -> None:
    w = h.worker(variants=(QUARTER,), gpus=1, cpu=1.0)
    tasks = [h.submit("quarter", gpu=GpuMode.REQUIRE) for _ in range(12)]
    assert ids(lease(h, w, prefetch_s=0.1).leases) == tasks[:4]
    assert lease(h, w, running=tasks[:4], prefetch_s=0.1).leases == []  # its run time is unknown yet
    h.ctrl.complete(w, [Completion(t, 1, True, {"ok": True}, run_s=0.001) for t in tasks[:4]])
    assert ids(lease(h, w, prefetch_s=0.1).leases) == tasks[4:8]
    got = lease(h, w, running=tasks[4:8], prefetch_s=0.1)
    assert ids(got.leases) == tasks[8:12] and all(le.after for le in got.leases)


def test_a_task_waiting_for_a_cpu_slot_or_a_pipeline_stage_never_leads(h: Harness) -> None:
    w = h.worker(variants=(QUARTER,), gpus=1, cpu=1.0)
    task = h.submit("quarter", gpu=GpuMode.REQUIRE)
    lease(h, w)
    worker = h.ctrl.store.get_worker(w)
    assert worker is not None
    held = h.task(task)
    assert [t.id for t in placement.Followers.of(worker, [held], [task], [], 64).leaders] == [task]
    assert placement.Followers.of(worker, [held], [task], [task], 64).leaders == []  # it waits for a slot
    staged = replace(held, pipeline_run_id="run-1")  # a chained stage would take its room over
    assert placement.Followers.of(worker, [staged], [task], [], 64).leaders == []


def test_followers_placed_on_a_share_free_now_count_against_each_other(h: Harness) -> None:
    """A share freed by a task with no follower may go to a follower of a task on another GPU: then that
    follower holds it beside its own leader's, and the next follower may not be placed on it too."""
    w = h.worker(variants=(QUARTER,), gpus=2, cpu=8.0)
    first = [h.submit("quarter", gpu=GpuMode.REQUIRE) for _ in range(8)]
    assert ids(lease(h, w).leases) == first  # both GPUs full
    two = [h.submit("quarter", gpu=GpuMode.REQUIRE) for _ in range(2)]
    followed = {le.after: le.task.id for le in lease(h, w, running=first).leases}
    assert set(followed.values()) == set(two)
    free = next(t for t in first if t not in followed)  # it ends with no follower: its share is free
    h.ctrl.complete(w, [Completion(free, 1, True, {"ok": True}, run_s=0.001)])
    running = [t for t in first if t != free]
    more = [h.submit("quarter", gpu=GpuMode.REQUIRE) for _ in range(6)]
    got = lease(h, w, running=[*running, *two], waiting=two)
    assert got.leases and all(le.after for le in got.leases)
    # every leader ends, every follower starts: at no moment more than a GPU's memory on either GPU
    everyone = [h.task(t) for t in [*running, *two, *ids(got.leases)]]
    leaders = {t.alloc.after for t in everyone if t.alloc is not None and t.alloc.after}
    at_end = [t for t in everyone if t.id not in leaders]  # what runs once every leader ended
    for uuid in {u for t in at_end if t.gpus for u in t.gpus.uuids}:
        held = sum(t.gpus.memory_bytes for t in at_end if t.gpus and uuid in t.gpus.uuids)
        assert held <= 80 * 2**30, uuid
    assert [h.state(t) for t in more].count(TaskState.QUEUED) == 6 - len(got.leases)


# ---- the invariant: what the worker runs never holds a GPU share twice -------------------------------------


STEP = st.one_of(
    st.tuples(st.just("submit"), st.sampled_from(["quarter", "half"]), st.sampled_from(["acme", "globex"])),
    st.tuples(st.just("lease"), st.booleans(), st.just("")),
    st.tuples(st.just("end"), st.integers(0, 15), st.just("")),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(STEP, min_size=1, max_size=40))
def test_whatever_the_order_of_submits_leases_and_ends_no_gpu_is_held_past_its_memory(
    steps: list[tuple[str, object, object]],
) -> None:
    """A model worker: it starts a lease at once, or a follower when its leader ends here (at once if its
    leader ended before the lease came, as the agent does); the tasks it runs never hold more of a GPU than
    it has."""
    h = Harness()
    w = h.worker(variants=(QUARTER, HALF), gpus=2, cpu=4.0)
    running: list[str] = []
    waiting: dict[str, str] = {}  # follower -> leader
    for kind, a, b in steps:
        if kind == "submit":
            h.submit(str(a), tenant=str(b), gpu=GpuMode.REQUIRE)
        elif kind == "lease":
            got = lease(h, w, running=[*running, *waiting], waiting=list(waiting), prefetch_gpu=bool(a))
            for le in got.leases:
                if le.after is not None and (le.after in running or le.after in waiting):
                    waiting[le.task.id] = le.after
                else:
                    running.append(le.task.id)
        elif running:
            ended = running.pop(int(str(a)) % len(running))
            t = h.task(ended)
            h.ctrl.complete(w, [Completion(ended, t.attempts, True, {"ok": True}, run_s=0.001)])
            for follower, leader in list(waiting.items()):
                if leader == ended:
                    del waiting[follower]
                    running.append(follower)
        held: dict[str, int] = {}
        for tid in running:
            t = h.task(tid)
            assert t.gpus is not None
            for uuid in t.gpus.uuids:
                held[uuid] = held.get(uuid, 0) + t.gpus.memory_bytes
        for uuid, used in held.items():
            assert used <= 80 * 2**30, (uuid, used)
