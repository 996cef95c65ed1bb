"""The task lifecycle of DESIGN.md, rule by rule, on the controller itself with a fake clock: over the
memory store, and over SQLite too, to show the controller meets the same rules on both.

| rule (DESIGN.md, Task lifecycle and Routing)                                   | test                          |
|---|---|
| queued -> leased -> running -> succeeded                                       | test_a_task_goes_queued_...   |
| leased/running --lease expired--> queued (attempt + 1)                         | LEASE_EXPIRY table            |
| ... or failed (worker_lost) when attempts are used up                          | LEASE_EXPIRY table            |
| a lease never expires while its worker heartbeats, however long the task runs | LEASE_EXPIRY table            |
| a late result from a worker whose lease expired is refused; one result commits | test_a_late_result_...        |
| queued --no live worker for placement_timeout_s--> failed (no_capacity)        | test_a_task_nobody_can_...    |
| queued/leased/running --cancel--> cancelled (the worker is told to stop)       | CANCEL table                  |
| running --timeout_s passed--> failed (timeout), its GPUs released              | test_a_task_past_its_timeout  |
| retryable failures re-queue within max_retries; gpu_oom avoids that GPU       | test_gpu_oom_..., RETRY table |
| a lease whose answer never reached its worker goes back, not charged           | test_a_lease_that_never_...   |
| a worker leaving cleanly re-queues its tasks at once; a drained one gets none | test_a_worker_that_leaves_... |
| shared workers take tenants in turn, the one holding fewest tasks first        | test_fair_... (two tests)     |
| exclusive GPUs: granted, audited, released, then granted again                 | test_an_exclusive_gpu_...     |
| prefer: CPU when no healthy GPU worker; waits gpu_wait_s while GPUs are busy   | test_prefer_... (two tests)   |
| a lease reads what fits and one more of the queue; further only past its head  | test_a_lease_reads_...        |
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.inprocess.harness import HEARTBEAT_S, SHOUT_CPU, SHOUT_GPU, Harness
from turnout.controller import UNDELIVERED_AFTER_S, WORKER_FORGOTTEN_S
from turnout.errors import NotFound
from turnout.models import GpuMode, Routing, Task, TaskState
from turnout.resources import parse_resources

LEASE_S = 3 * HEARTBEAT_S  # a worker silent this long is unhealthy and its leases expire


def test_a_task_goes_queued_leased_running_succeeded(h: Harness) -> None:
    w = h.worker()
    t = h.submit(gpu=GpuMode.NEVER)
    assert h.state(t) is TaskState.QUEUED
    [lease] = h.lease(w)
    assert (h.state(t), lease.task.attempts, h.task(t).worker_id) == (TaskState.LEASED, 1, w)
    h.clock.advance(1.0)  # the worker lists it as running a moment later: it shows `running`
    assert h.lease(w, running=[t]) == []
    assert h.state(t) is TaskState.RUNNING
    assert h.succeed(w, lease, {"text": "HI"}) == ([t], [])
    done = h.task(t)
    assert (done.state, done.output, done.attempts, done.run_s) == (
        TaskState.SUCCEEDED,
        {"text": "HI"},
        1,
        0.5,
    )
    # a task that succeeded is never run again: the sweep and later leases leave it alone
    h.clock.advance(10 * LEASE_S)
    h.ctrl.reap()
    assert h.lease(h.worker("other")) == [] and h.state(t) is TaskState.SUCCEEDED


@dataclass(frozen=True)
class Expiry:
    max_retries: int
    heartbeating: bool  # whether the worker heartbeats while the clock moves
    state: TaskState
    attempts: int
    error_type: str | None


LEASE_EXPIRY = {
    "silent worker, attempts left: queued again": Expiry(2, False, TaskState.QUEUED, 1, None),
    "silent worker, attempts used up: failed worker_lost": Expiry(
        0, False, TaskState.FAILED, 1, "worker_lost"
    ),
    "heartbeating worker, a long task: still running": Expiry(0, True, TaskState.RUNNING, 1, None),
}


@pytest.mark.parametrize("case", LEASE_EXPIRY.values(), ids=LEASE_EXPIRY.keys())
def test_lease_expiry_is_judged_on_heartbeats_as_the_clock_moves(h: Harness, case: Expiry) -> None:
    w = h.worker()
    t = h.submit(gpu=GpuMode.NEVER, max_retries=case.max_retries)
    h.lease(w)
    h.clock.advance(1.0)
    h.lease(w, running=[t])  # running now
    h.silent_for(100 * LEASE_S, *([w] if case.heartbeating else []))
    h.ctrl.reap()
    task = h.task(t)
    assert (task.state, task.attempts, (task.error or {}).get("type")) == (
        case.state,
        case.attempts,
        case.error_type,
    )
    if case.state is TaskState.QUEUED:
        assert task.worker_id is None and h.ctrl.lease_expiries == 1
        assert [le.task.attempts for le in h.lease(h.worker("next"))] == [2]


def test_a_late_result_from_an_expired_lease_is_refused_and_one_result_commits(h: Harness) -> None:
    first, second = h.worker("first"), h.worker("second")
    t = h.submit(gpu=GpuMode.NEVER)
    [old] = h.lease(first)
    h.silent_for(LEASE_S + 0.5, second)  # `first` goes silent; `second` stays
    h.ctrl.reap()
    [new] = h.lease(second)
    assert new.task.attempts == 2
    assert h.succeed(first, old, {"by": "first"}) == ([], [t])  # its lease expired: refused
    assert h.succeed(second, new, {"by": "second"}) == ([t], [])
    assert h.succeed(second, new, {"by": "second"}) == ([t], [])  # the same report again changes nothing
    assert h.task(t).output == {"by": "second"}


def test_a_task_nobody_can_serve_fails_no_capacity_after_its_placement_timeout(h: Harness) -> None:
    h.worker(variants=[SHOUT_CPU])  # CPU only: a `require` task can never be placed
    t = h.submit(gpu=GpuMode.REQUIRE, placement_timeout_s=30.0)
    h.ctrl.reap()  # the clock starts
    h.silent_for(29.0)
    h.ctrl.reap()
    assert h.state(t) is TaskState.QUEUED
    h.clock.advance(1.0)
    assert h.ctrl.reap()
    assert (h.state(t), h.task(t).error["type"]) == (TaskState.FAILED, "no_capacity")  # type: ignore[union-attr]


CANCEL: dict[str, Callable[[Harness, str, str], None]] = {
    "queued": lambda h, w, t: None,
    "leased": lambda h, w, t: [h.lease(w)][0] and None,
    "running": lambda h, w, t: [h.lease(w), h.clock.advance(1.0), h.lease(w, running=[t])][0] and None,
}


@pytest.mark.parametrize("before", CANCEL.keys())
def test_cancel_ends_a_task_in_any_unfinished_state_and_tells_its_worker(h: Harness, before: str) -> None:
    w = h.worker()
    t = h.submit(gpu=GpuMode.NEVER)
    CANCEL[before](h, w, t)
    assert h.state(t).value == before
    assert h.ctrl.cancel("default", t, by="k_1").state is TaskState.CANCELLED
    assert [r["task"] for r in h.audit("task_cancelled")] == [t]
    result = h.ctrl.lease(w, max_tasks=8, running=[t] if before != "queued" else [])
    assert result.cancel == ([t] if before != "queued" else []) and result.leases == []


def test_a_task_past_its_timeout_fails_and_its_gpu_is_released(h: Harness) -> None:
    w = h.worker(variants=[SHOUT_GPU], gpus=1)
    t = h.submit(gpu=GpuMode.REQUIRE, timeout_s=10.0)
    [lease] = h.lease(w)
    assert lease.grant is not None and lease.grant.uuids == ("GPU-w-0",)
    h.clock.advance(1.0)
    h.lease(w, running=[t])
    h.silent_for(10.0 + HEARTBEAT_S, w)  # timeout_s and one heartbeat's grace: not yet past
    h.ctrl.reap()
    assert h.state(t) is TaskState.RUNNING
    h.silent_for(0.5, w)
    h.ctrl.reap()
    assert (h.state(t), h.task(t).error["type"]) == (TaskState.FAILED, "timeout")  # type: ignore[union-attr]
    [released] = h.audit("gpu_released")
    assert (released["task"], released["gpus"]) == (t, ["GPU-w-0"])
    assert h.lease(w, running=[t]).__len__() == 0  # nothing queued; and the worker is told to stop it
    assert h.ctrl.lease(w, max_tasks=1, running=[t]).cancel == [t]


RETRY = {  # error type -> whether a failure with it is re-queued (within max_retries)
    "gpu_oom": True,
    "gpu_scrub_failed": True,
    "gpu_quarantined": True,  # a task held ahead whose GPU was quarantined before it could start there
    "worker_lost": True,
    "handler_error": False,
    "invalid_output": False,
}


@pytest.mark.parametrize("error_type", RETRY.keys())
def test_only_retryable_failures_are_requeued_and_only_within_max_retries(
    h: Harness, error_type: str
) -> None:
    w = h.worker(variants=[SHOUT_GPU], gpus=2)
    t = h.submit(gpu=GpuMode.REQUIRE, max_retries=1)
    h.fail(w, h.lease(w)[0], error_type)
    if not RETRY[error_type]:
        assert (h.state(t), h.task(t).error["type"]) == (TaskState.FAILED, error_type)  # type: ignore[union-attr]
        return
    assert h.state(t) is TaskState.QUEUED and h.task(t).routing.last_error["type"] == error_type  # type: ignore[union-attr]
    h.clock.advance(2.0)  # past the moment a GPU task waits for the policy's best worker
    h.fail(w, h.lease(w)[0], error_type)  # the second failure uses up max_retries=1
    assert (h.state(t), h.task(t).attempts) == (TaskState.FAILED, 2)


def test_a_cpu_task_that_failed_gpu_oom_is_leased_again(h: Harness) -> None:
    """A task that never held a GPU has no GPUs to avoid: its retry is leased like any other (once a KeyError)."""
    w = h.worker()
    t = h.submit(gpu=GpuMode.NEVER, max_retries=1)
    h.fail(w, h.lease(w)[0], "gpu_oom")  # a CPU handler whose library raised a CUDA out-of-memory error
    [again] = h.lease(w)
    assert again.task.id == t and "gpu out of memory" not in again.task.routing.reason


def test_gpu_oom_retries_on_another_gpu_not_blindly_the_same(h: Harness) -> None:
    w = h.worker(variants=[SHOUT_GPU], gpus=2)
    t = h.submit(gpu=GpuMode.REQUIRE)
    [first] = h.lease(w)
    h.fail(w, first, "gpu_oom")
    h.clock.advance(2.0)  # past the moment a GPU task waits for the policy's best worker
    [second] = h.lease(w)
    assert second.task.id == t and second.grant is not None
    assert second.grant.uuids != first.grant.uuids  # type: ignore[union-attr]
    assert h.task(t).routing.avoid_gpus == first.grant.uuids  # type: ignore[union-attr]


def test_gpu_oom_with_no_other_gpu_fails_with_the_oom_not_a_bare_no_capacity(h: Harness) -> None:
    """Seen on a real H100: a share that ran out of memory on the only GPU was retried, found no other GPU, and
    failed `no_capacity`, which hid the out-of-memory the user must fix."""
    w = h.worker(variants=[SHOUT_GPU], gpus=1)
    t = h.submit(gpu=GpuMode.REQUIRE, placement_timeout_s=30.0)
    [first] = h.lease(w)
    h.fail(w, first, "gpu_oom")
    h.clock.advance(2.0)
    assert h.lease(w) == []  # the only GPU is the one it ran out of memory on
    h.ctrl.reap()  # the clock starts
    h.silent_for(31.0)
    assert h.ctrl.reap()
    error = h.task(t).error
    assert h.state(t) is TaskState.FAILED and error is not None
    assert error["type"] == "gpu_oom"
    assert error["message"].startswith("gpu_oom; its retry found no other place: no live worker offers")
    assert first.grant is not None and first.grant.uuids[0] in error["message"]


def test_a_lease_that_never_reached_its_worker_goes_back_without_counting_as_a_retry(h: Harness) -> None:
    w = h.worker()
    t = h.submit(gpu=GpuMode.NEVER, max_retries=0)
    h.lease(w)  # the answer is lost: the worker never lists the task
    h.clock.advance(UNDELIVERED_AFTER_S + 0.1)
    [again] = h.lease(w)
    assert again.task.id == t and again.task.attempts == 2  # the attempt number stays spent (a fencing token)
    assert h.task(t).routing.undelivered == 1  # type: ignore[union-attr]
    assert h.succeed(w, again) == ([t], [])  # max_retries=0, yet it ran: the lost lease did not count


def test_a_worker_that_leaves_requeues_its_tasks_and_a_drained_one_gets_none(h: Harness) -> None:
    leaving, draining = h.worker("leaving"), h.worker("draining")
    t = h.submit(gpu=GpuMode.NEVER)
    h.lease(leaving)
    h.ctrl.deregister(leaving)
    assert h.state(t) is TaskState.QUEUED
    h.ctrl.drain(draining, by="k_1")
    assert h.lease(draining) == []
    assert [r["worker"] for r in h.audit("worker_drained")] == [draining]


def test_a_worker_silent_for_a_day_is_gone_and_the_sweep_reads_no_gone_worker(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent restarted under a new id, a host gone for good: its row must not be read twice a second for ever."""
    silent, alive = h.worker("silent"), h.worker("alive")

    def state(worker_id: str) -> str:
        found = h.ctrl.store.get_worker(worker_id)
        assert found is not None
        return found.state.value

    t = h.submit(gpu=GpuMode.NEVER)
    assert [le.task.id for le in h.lease(silent)] == [t]
    h.ctrl.reap()  # the clock starts
    h.silent_for(LEASE_S + 1, alive)
    h.ctrl.reap()
    assert state(silent) == "unhealthy" and h.state(t) is TaskState.QUEUED
    h.clock.advance(WORKER_FORGOTTEN_S - LEASE_S - 2 * HEARTBEAT_S)
    h.ctrl.heartbeat(alive)
    h.ctrl.reap()
    assert state(silent) == "unhealthy"  # not yet a day
    h.silent_for(2 * HEARTBEAT_S, alive)
    reads: list[bool] = []
    listed = h.ctrl.store.list_workers

    def counted(include_gone: bool = False) -> list[Any]:
        reads.append(include_gone)
        return listed(include_gone=include_gone)

    monkeypatch.setattr(h.ctrl.store, "list_workers", counted)
    assert h.ctrl.reap()
    assert state(silent) == "gone" and state(alive) == "healthy"
    assert [r["reason"] for r in h.audit("worker_left")] == ["silent for a day"]
    assert h.ctrl.reap() is False and reads and not any(reads)  # the sweep never read a gone worker
    with pytest.raises(NotFound):  # it comes back: it registers again
        h.ctrl.heartbeat(silent)
    assert h.lease(alive)[0].task.id == t


def test_fair_shared_worker_takes_the_tenants_queues_in_turn(h: Harness) -> None:
    w = h.worker(cpu=4.0)
    flood = [h.submit(tenant="acme", gpu=GpuMode.NEVER) for _ in range(10)]
    calm = [h.submit(tenant="globex", gpu=GpuMode.NEVER) for _ in range(2)]
    taken = [le.task.tenant for le in h.lease(w, max_tasks=4)]
    assert sorted(taken) == ["acme", "acme", "globex", "globex"]
    assert {h.state(t) for t in calm} == {TaskState.LEASED} and len(flood) == 10


def test_fair_the_tenant_holding_fewest_tasks_gets_the_next_free_slot(h: Harness) -> None:
    w = h.worker(cpu=4.0)
    flood = [h.submit(tenant="acme", gpu=GpuMode.NEVER) for _ in range(10)]
    [first] = h.lease(w, max_tasks=1)
    assert first.task.id == flood[0]
    calm = h.submit(tenant="globex", gpu=GpuMode.NEVER)  # after the flood, while acme holds a task
    [second] = h.lease(w, max_tasks=1, running=[first.task.id])
    assert second.task.id == calm


def test_an_exclusive_gpu_is_granted_audited_released_and_granted_again(h: Harness) -> None:
    w = h.worker(variants=[SHOUT_GPU], gpus=1)
    a, b = h.submit(gpu=GpuMode.REQUIRE, tenant="acme"), h.submit(gpu=GpuMode.REQUIRE, tenant="acme")
    [lease] = h.lease(w)
    assert (lease.task.id, lease.grant.uuids) == (a, ("GPU-w-0",))  # type: ignore[union-attr]
    assert h.lease(w, running=[a]) == []  # the one GPU is held: b waits
    assert h.store.gpu_use_by_tenant() == {"acme": 1.0}
    h.clock.advance(7.0)
    h.succeed(w, lease)
    [allocated], [released] = h.audit("gpu_allocated"), h.audit("gpu_released")
    assert (allocated["task"], allocated["gpus"]) == (a, ["GPU-w-0"])
    assert (released["task"], released["gpus"], released["seconds"]) == (a, ["GPU-w-0"], 7.0)
    [next_lease] = h.lease(w)
    assert (next_lease.task.id, next_lease.grant.uuids) == (b, ("GPU-w-0",))  # type: ignore[union-attr]


def test_prefer_runs_on_the_cpu_when_no_gpu_worker_is_healthy(h: Harness) -> None:
    w = h.worker(variants=[SHOUT_CPU])
    t = h.submit(gpu=GpuMode.PREFER)
    [lease] = h.lease(w)
    assert lease.device.value == "cpu"
    assert h.task(t).routing == Routing(requested="prefer", device="cpu", reason="no healthy gpu worker")


def test_prefer_waits_gpu_wait_s_for_a_busy_gpu_then_takes_the_cpu(h: Harness) -> None:
    w = h.worker(variants=[SHOUT_CPU, SHOUT_GPU], gpus=1)
    busy = h.submit(gpu=GpuMode.REQUIRE)
    assert [le.task.id for le in h.lease(w)] == [busy]
    t = h.submit(gpu=GpuMode.PREFER, gpu_wait_s=10.0)
    assert h.lease(w, running=[busy]) == []  # the GPU may free up soon: wait for it
    h.silent_for(10.5, w)
    [lease] = h.lease(w, running=[busy])
    assert (lease.task.id, lease.device.value) == (t, "cpu")
    assert "gpu" in h.task(t).routing.reason  # type: ignore[union-attr]


def test_a_lease_reads_what_fits_and_one_more_of_a_deep_queue_and_on_only_past_a_head_it_cannot_take(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    firsts: list[int] = []  # the first page each read of the queue asked the store for
    rows: list[str] = []  # each queued task the lease went through, in order
    queued_tasks = h.store.queued_tasks

    def counted(*args: Any, **kwargs: Any) -> Iterator[Task]:
        firsts.append(kwargs["limit"])
        for task in queued_tasks(*args, **kwargs):
            rows.append(task.id)
            yield task

    monkeypatch.setattr(h.store, "queued_tasks", counted)
    # Given a worker with room for two (cpu 1 each on 2 CPUs), and 300 tasks queued for it
    w = h.worker(cpu=2.0)
    for _ in range(300):
        h.submit(gpu=GpuMode.NEVER)
    # When it leases, Then it takes two, having asked for three rows: what fits and one more, to say more wait
    assert len(h.lease(w)) == 2 and firsts == [3] and len(rows) == 3
    # Given ten tasks at the head of the queue that ask for 2 CPUs, and a worker with one
    two_cpus = parse_resources({"cpu": 2})
    head = [h.submit(gpu=GpuMode.NEVER, priority=9, resources=two_cpus, resource_keys=frozenset({"cpu"}))
            for _ in range(10)]  # fmt: skip
    small = h.worker("small", cpu=1.0)
    rows.clear()
    # When it leases, Then it reads on past the head in growing pages (2, 8, then 32) and takes the first that fits
    [lease] = h.lease(small)
    assert lease.task.id not in head and rows[:10] == head
    assert 10 < len(rows) <= 2 + 8 + 32
    # Given a second tenant's deep queue too, When a worker with room for one leases, Then each tenant's first
    # look is its share of what fits and one more (two rows), not a fixed page of many
    for _ in range(50):
        h.submit(gpu=GpuMode.NEVER, tenant="acme")
    firsts.clear()
    assert len(h.lease(h.worker("third", cpu=1.0))) == 1 and firsts == [2, 2]
