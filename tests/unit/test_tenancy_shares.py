"""A tenant's reserved share of a shared worker, and the 429 given before a submission's body is read.

The rules as properties (`tenancy.reservations`, `tenancy.early_refusal`), then the reservation on the
controller itself: a real SQLite file, a fake clock, no worker processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnout.access import ALL_TENANTS
from turnout.config import ControllerSettings
from turnout.controller import Controller
from turnout.errors import InvalidInput, RateLimited
from turnout.models import Completion, Device, TaskSpec, Variant
from turnout.resources import parse_resources
from turnout.store import SqlStore, open_store
from turnout.tenancy import (
    RECENT_S,
    LimitsTable,
    RecentTenants,
    RefusalPace,
    TenantBuckets,
    TenantLimits,
    admit_submission,
    early_refusal,
    gpu_allocation_rule,
    parse_limits,
    reservations,
    submit_rule,
)

TENANTS = ("acme", "globex", "initech", "umbrella")
shares = st.one_of(st.none(), st.floats(0.01, 1.0))
tables = st.builds(
    lambda default, named: LimitsTable(TenantLimits(reserved_share=default),
                                       {t: TenantLimits(reserved_share=s) for t, s in named.items()}),
    shares, st.dictionaries(st.sampled_from(TENANTS), shares),
)  # fmt: skip
helds = st.dictionaries(st.sampled_from(TENANTS), st.floats(0, 4))

# ---- the limit -----------------------------------------------------------------------------------


def test_reserved_share_is_a_fraction_of_a_worker_and_inherits_from_the_star_entry() -> None:
    table = parse_limits({"*": {"submit_per_s": 200, "reserved_share": 0.25}, "acme": {"reserved_share": 1}})
    assert table.of("acme").reserved_share == 1.0 and table.of("globex").reserved_share == 0.25
    assert table.any_reserved_share and not LimitsTable().any_reserved_share


@pytest.mark.parametrize("value", [0, -0.25, 1.5, "half", True, float("inf")])
def test_a_reserved_share_outside_zero_to_one_is_an_error_naming_the_key(value: object) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_limits({"acme": {"reserved_share": value}})
    assert caught.value.field == "limits.acme.reserved_share"
    assert "a fraction > 0 and <= 1" in caught.value.message


# ---- reservations as properties ----------------------------------------------------------------


@given(tables, st.floats(0.1, 64), helds, st.sampled_from(TENANTS), st.floats(0.01, 4), st.floats(0, 64))
def test_no_tenant_is_refused_a_slot_when_no_other_tenant_has_work(
    table: LimitsTable, capacity: float, held: dict[str, float], tenant: str, cpu: float, free: float
) -> None:
    for with_work in (set(), {tenant}):
        for queued, recent in ((with_work, set()), (set(), with_work)):
            share = reservations(table, capacity, held, queued, recent)
            assert share is None or share.may_take(tenant, cpu, free)


@given(tables, st.floats(0.1, 64), helds, st.sets(st.sampled_from(TENANTS), min_size=2))
def test_the_reserved_share_never_exceeds_the_configured_amount_nor_the_worker(
    table: LimitsTable, capacity: float, held: dict[str, float], with_work: set[str]
) -> None:
    share = reservations(table, capacity, held, with_work)
    if share is None:
        assert all(table.of(t).reserved_share is None for t in with_work)
        return
    for tenant, cpu in share.guaranteed.items():
        configured = table.of(tenant).reserved_share
        assert tenant in with_work and configured is not None
        assert cpu <= configured * capacity + 1e-9 and cpu <= capacity / len(with_work) + 1e-9
    assert sum(share.guaranteed.values()) <= capacity + 1e-9


@given(tables, st.floats(0.1, 64), helds, st.sets(st.sampled_from(TENANTS), min_size=2),
       st.sampled_from(TENANTS), st.floats(0.01, 4), st.floats(0, 64))  # fmt: skip
def test_a_refusal_is_only_ever_for_another_tenants_unmet_guarantee(
    table: LimitsTable,
    capacity: float,
    held: dict[str, float],
    with_work: set[str],
    tenant: str,
    cpu: float,
    free: float,
) -> None:
    share = reservations(table, capacity, held, with_work)
    if share is None or share.may_take(tenant, cpu, free):
        return
    assert held.get(tenant, 0.0) >= share.guaranteed.get(tenant, 0.0) - 1e-9  # never below its own
    owed = {t: g - held.get(t, 0.0) for t, g in share.guaranteed.items() if t != tenant}
    assert any(v > 0 for v in owed.values())
    assert free - cpu < sum(max(0.0, v) for v in owed.values())


@given(tables, st.floats(0.1, 64), helds, st.sets(st.sampled_from(TENANTS), min_size=2),
       st.sets(st.sampled_from(TENANTS)), st.floats(0.01, 4), st.floats(0, 64), st.floats(0, 4))  # fmt: skip
def test_when_no_queued_tenant_may_take_the_smallest_task_none_may_take_a_bigger_one(
    table: LimitsTable,
    capacity: float,
    held: dict[str, float],
    with_work: set[str],
    queued: set[str],
    smallest: float,
    free: float,
    more: float,
) -> None:
    share = reservations(table, capacity, held, queued, with_work)
    if share is None or share.anyone_may_take(smallest, free):
        return
    for tenant in queued:  # the lease that skips reading the queue would have taken nothing
        assert free + 1e-9 < smallest + more or not share.may_take(tenant, smallest + more, free)


kept_rooms = st.tuples(tables, st.floats(0.1, 64), helds, st.sets(st.sampled_from(TENANTS)),
                       st.sets(st.sampled_from(TENANTS), min_size=2), st.floats(0.01, 4), st.floats(0, 64))  # fmt: skip


@given(kept_rooms, st.floats(0, 4))
def test_a_barred_tenant_may_take_no_task_and_a_tenant_not_known_is_never_barred(
    room: tuple[LimitsTable, float, dict[str, float], set[str], set[str], float, float], more: float
) -> None:
    """A lease poll skips waking for a barred tenant's new tasks: a task of any size it would refuse."""
    table, capacity, held, queued, recent, smallest, free = room
    share = reservations(table, capacity, held, queued, recent)
    if share is None:
        return
    barred = share.barred(smallest, free)
    known = share.queued | share.guaranteed.keys()
    assert barred <= known
    for tenant in known:
        assert (tenant in barred) == (not share.may_take(tenant, smallest, free))
        if tenant in barred:
            assert not share.may_take(tenant, smallest + more, free)


def test_the_flooding_tenant_is_barred_from_the_room_kept_for_the_calm_one() -> None:
    # a worker of 4 CPUs, half kept for each tenant with work; the hog holds its half, 2 CPUs are free
    table = parse_limits({"*": {"reserved_share": 0.5}})
    share = reservations(table, 4.0, {"hog": 2.0}, {"hog"}, {"calm"})
    assert share is not None and not share.anyone_may_take(1.0, 2.0)
    assert share.barred(1.0, 2.0) == {"hog"}  # the calm tenant may take its half; a newcomer is not barred


@given(tables, st.floats(0.1, 64), helds, st.sets(st.sampled_from(TENANTS), min_size=2),
       st.sampled_from(TENANTS), st.floats(0.01, 4), st.floats(0, 64),
       st.lists(st.tuples(st.sampled_from(TENANTS), st.floats(0.01, 4)), max_size=10))  # fmt: skip
def test_a_refusal_holds_whatever_the_same_lease_takes_after_it(
    table: LimitsTable,
    capacity: float,
    held: dict[str, float],
    with_work: set[str],
    tenant: str,
    cpu: float,
    free: float,
    later: list[tuple[str, float]],
) -> None:
    """So a lease may stop reading the queue once no tenant with tasks queued may take the smallest task. A
    task that no longer fits is refused by its size, not its share: `may_take` does not ask whether it fits
    (once the others hold all they are owed, the tenant may take what is left, which may be nothing)."""
    share = reservations(table, capacity, held, with_work)
    if share is None or share.may_take(tenant, cpu, free):
        return
    for other, size in later:
        if free >= size and share.take(other, size, free):
            free -= size
        assert not (free + 1e-9 >= cpu and share.may_take(tenant, cpu, free))


@given(tables, st.integers(1, 16), st.sets(st.sampled_from(TENANTS), min_size=2), st.integers(0, 3))
def test_tenants_that_all_have_queued_work_leave_no_slot_idle(
    table: LimitsTable, slots: int, with_work: set[str], start: int
) -> None:
    """Given every tenant with work has tasks queued (none is only recently active), when a shared worker
    fills one task at a time in turn, then it ends with no free slot."""
    slot = 0.1
    share = reservations(table, slots * slot, {}, with_work)
    free = slots * slot
    order = sorted(with_work)
    order = order[start % len(order) :] + order[: start % len(order)]
    progress = True
    while progress:
        progress = False
        for tenant in order:
            if free + 1e-9 >= slot and (share is None or share.take(tenant, slot, free)):
                free -= slot
                progress = True
    assert free < slot - 1e-9


def test_a_recent_submission_counts_as_work_for_recent_s() -> None:
    recent = RecentTenants()
    recent.saw("acme", 100.0)
    assert recent.within(100.0 + RECENT_S) == {"acme"}
    assert recent.within(100.0 + RECENT_S + 0.01) == set()


# ---- the 429 before the body -------------------------------------------------------------------

steps = st.lists(st.tuples(st.floats(0, 1), st.integers(0, 3), st.booleans()), min_size=1, max_size=40)


@given(st.floats(0.5, 50), st.floats(1, 120), steps)
def test_an_early_refusal_is_exactly_the_429_the_route_would_answer_and_takes_nothing(
    rate: float, gpu_per_min: float, history: list[tuple[float, int, bool]]
) -> None:
    clock = [0.0]
    table = LimitsTable(TenantLimits(submit_per_s=rate, gpu_allocations_per_min=gpu_per_min))
    subs = TenantBuckets(submit_rule(table), lambda: clock[0])
    gpus = TenantBuckets(gpu_allocation_rule(table), lambda: clock[0])
    for dt, n, gpu_only in history:
        clock[0] += dt
        early = early_refusal(subs, gpus, "acme")
        levels = (subs.wait_s("acme", 1), gpus.wait_s("acme", 1))
        if early is not None:
            for n_gpu in (0, 1):  # whatever the unread body asks: a task for the CPU, or for a GPU only
                with pytest.raises(RateLimited) as caught:
                    admit_submission(subs, gpus, "acme", 1, n_gpu)
                assert caught.value.to_dict() == early.to_dict()
            assert (subs.wait_s("acme", 1), gpus.wait_s("acme", 1)) == levels  # nothing taken
        if n:
            with contextlib.suppress(RateLimited):
                admit_submission(subs, gpus, "acme", n, n if gpu_only else 0)


def test_no_early_refusal_within_the_rate_or_without_a_limit() -> None:
    table = parse_limits({"acme": {"submit_per_s": 2}})
    subs, gpus = TenantBuckets(submit_rule(table), lambda: 0.0), TenantBuckets(gpu_allocation_rule(table))
    assert early_refusal(subs, gpus, "acme") is None
    admit_submission(subs, gpus, "acme", 2, 0)
    refused = early_refusal(subs, gpus, "acme")
    assert refused is not None and refused.retry_after_s == pytest.approx(0.5)
    assert early_refusal(subs, gpus, "globex") is None  # not named, no "*": unlimited


# ---- on the controller ---------------------------------------------------------------------------

NAP = Variant("nap", Device.CPU, parse_resources({"cpu": 0.1}))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlStore]:
    s = open_store(f"sqlite:///{tmp_path / 'turnout.db'}")
    try:
        yield s
    finally:
        s.close()


def shared_worker(store: SqlStore, limits: LimitsTable) -> tuple[Controller, str, FakeClock]:
    """A controller and one shared worker of four 0.1-CPU slots."""
    clock = FakeClock()
    ctrl = Controller(store, ControllerSettings(tenant_limits=limits), clock=clock)
    worker = ctrl.register_worker(name="pool", host="h", variants=[NAP], cpu=0.4, memory_bytes=2**30, gpus=[],
                                  strategy="pack", tenant=ALL_TENANTS)  # fmt: skip
    return ctrl, worker.id, clock


def submit(ctrl: Controller, tenant: str, n: int) -> list[str]:
    return [t.id for t in ctrl.submit(tenant, [TaskSpec("nap", {"i": i}) for i in range(n)])]


def leased(ctrl: Controller, wid: str, running: list[str]) -> list[tuple[str, str]]:
    return [(le.task.tenant, le.task.id) for le in ctrl.lease(wid, max_tasks=10, running=running).leases]


QUARTER = LimitsTable(TenantLimits(reserved_share=0.25))


def test_a_tenant_between_two_tasks_keeps_a_slot_that_a_flooding_tenant_may_not_take(store: SqlStore) -> None:
    ctrl, wid, clock = shared_worker(store, QUARTER)
    calm = submit(ctrl, "calm", 1)
    first = leased(ctrl, wid, [])
    assert first == [("calm", calm[0])]
    assert ctrl.complete(wid, [Completion(calm[0], 1, True, {}, run_s=0.01)])[0] == calm
    flood = submit(ctrl, "flood", 10)
    # calm submitted a moment ago: it has work, so one slot of four stays its
    taken = leased(ctrl, wid, [])
    assert [t for t, _ in taken] == ["flood"] * 3
    assert leased(ctrl, wid, [i for _, i in taken]) == []
    clock.now += 0.05
    again = submit(ctrl, "calm", 1)
    running = [i for _, i in taken]
    assert leased(ctrl, wid, running) == [("calm", again[0])]  # at once, though flood's queued first
    assert len(flood) == 10


def test_a_tenant_alone_takes_every_slot(store: SqlStore) -> None:
    ctrl, wid, _ = shared_worker(store, QUARTER)
    submit(ctrl, "flood", 6)
    assert [t for t, _ in leased(ctrl, wid, [])] == ["flood"] * 4  # no other tenant has work: all four


def test_a_reservation_ends_recent_s_after_the_tenants_last_submission(store: SqlStore) -> None:
    ctrl, wid, clock = shared_worker(store, QUARTER)
    calm = submit(ctrl, "calm", 1)
    leased(ctrl, wid, [])
    ctrl.complete(wid, [Completion(calm[0], 1, True, {}, run_s=0.01)])
    submit(ctrl, "flood", 10)
    taken = [i for _, i in leased(ctrl, wid, [])]
    assert len(taken) == 3
    clock.now += RECENT_S + 1
    ctrl.forget_cached()  # as the controller's list of tenants with queued tasks is read again (0.5 s)
    assert [t for t, _ in leased(ctrl, wid, taken)] == ["flood"]  # calm's slot is free for the taking


def test_without_a_reserved_share_a_flooding_tenant_takes_every_free_slot(store: SqlStore) -> None:
    ctrl, wid, _ = shared_worker(store, LimitsTable())
    calm = submit(ctrl, "calm", 1)
    leased(ctrl, wid, [])
    ctrl.complete(wid, [Completion(calm[0], 1, True, {}, run_s=0.01)])
    submit(ctrl, "flood", 10)
    assert [t for t, _ in leased(ctrl, wid, [])] == ["flood"] * 4


def test_a_worker_serving_one_tenant_reserves_nothing(store: SqlStore) -> None:
    clock = FakeClock()
    ctrl = Controller(store, ControllerSettings(tenant_limits=QUARTER), clock=clock)
    own = ctrl.register_worker(name="acme-own", host="h", variants=[NAP], cpu=0.4, memory_bytes=2**30, gpus=[],
                               strategy="pack", tenant="acme")  # fmt: skip
    submit(ctrl, "calm", 1)
    submit(ctrl, "acme", 6)
    got = ctrl.lease(own.id, max_tasks=10, tenant="acme").leases
    assert [le.task.tenant for le in got] == ["acme"] * 4


# ---- refusals held for a tenant that keeps sending ----------------------------------------------------


def test_a_tenants_first_refusals_in_a_second_are_answered_at_once_and_the_rest_held() -> None:
    pace = RefusalPace(free=3, hold_s=1.0, max_held=8)
    assert [pace.refused("acme", 100.0 + i * 0.1) for i in range(5)] == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert pace.refused("globex", 100.45) == 0.0  # another tenant counts its own
    assert pace.held == {"acme": 2}
    pace.released("acme")
    pace.released("acme")
    assert pace.held == {}
    # a second later the tenant starts afresh: a client that waits out its 429s is never held
    assert [pace.refused("acme", 101.0 + i * 0.4) for i in range(3)] == [0.0, 0.0, 0.0]


def test_past_max_held_a_tenants_refusals_are_answered_at_once() -> None:
    pace = RefusalPace(free=0, hold_s=1.0, max_held=2)
    assert [pace.refused("acme", 5.0) for _ in range(4)] == [1.0, 1.0, 0.0, 0.0]
    pace.released("acme")
    assert pace.refused("acme", 5.1) == 1.0
    assert RefusalPace(free=0, hold_s=0.0).refused("acme", 5.0) == 0.0  # holding switched off


@given(st.lists(st.tuples(st.sampled_from(TENANTS), st.floats(0, 0.999)), max_size=60))
def test_no_tenant_is_ever_held_for_its_first_free_refusals_of_a_second(
    calls: list[tuple[str, float]],
) -> None:
    pace = RefusalPace(free=4, hold_s=1.0, max_held=1000)
    seen: dict[str, int] = {}
    for tenant, at in sorted(calls, key=lambda c: c[1]):  # all within the first second
        seen[tenant] = seen.get(tenant, 0) + 1
        assert (pace.refused(tenant, 50.0 + at) > 0) == (seen[tenant] > 4)
    assert sum(pace.held.values()) == sum(max(0, n - 4) for n in seen.values())


def test_a_tenants_own_refusal_hold_from_its_limits_wins_and_zero_switches_it_off() -> None:
    limits = parse_limits({"*": {"refusal_hold_s": 2.5}, "bench": {"refusal_hold_s": 0}}, "turnout.yaml")
    pace = RefusalPace(limits, free=0)
    assert (pace.refused("acme", 1.0), pace.refused("bench", 1.0)) == (2.5, 0.0)
    assert RefusalPace(parse_limits({"acme": {"submit_per_s": 5}}), free=0).refused("acme", 1.0) == 1.0
    with pytest.raises(
        InvalidInput, match=r"turnout.yaml: limits.acme.refusal_hold_s: expected seconds >= 0"
    ):
        parse_limits({"acme": {"refusal_hold_s": -1}}, "turnout.yaml")
