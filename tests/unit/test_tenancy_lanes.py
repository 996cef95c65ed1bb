"""The database thread's order of calls (`lanes.Lanes`), as properties, and on a real service.

Workers' calls never wait behind a tenant's submissions; a tenant's calls run in the order they came; a
group holds at most `per_tenant` of one tenant and `max_group` in all; no tenant waits for ever. Then the
service itself: while one tenant's submissions pile up behind a busy database thread, another tenant's
submission and a worker's call run in the very next group, ahead of the backlog.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnout.api.service import PER_TENANT, Service
from turnout.lanes import WORKER_LANE, Lanes
from turnout.models import Task, TaskState
from turnout.store import open_store

from .test_service import FakeClock, register, run_with_service, spec

TENANTS = ("acme", "globex", "initech")
lanes_of = st.sampled_from((WORKER_LANE, *TENANTS))
# a run: batches of (lane) arrivals, each batch followed by one take()
runs = st.lists(st.lists(lanes_of, max_size=40), min_size=1, max_size=12)
sizes = st.tuples(st.integers(2, 12), st.integers(1, 6))  # max_group, per_tenant

Item = tuple[str | None, int]  # (lane, its arrival number within the lane)


def play(arrivals: list[list[str | None]], max_group: int, per_tenant: int) -> tuple[list[list[Item]], int]:
    """Put each batch, take one group after it, then take until empty; returns the groups and items put."""
    lanes: Lanes[Item] = Lanes(max_group, per_tenant)
    counts: dict[str | None, int] = {}
    groups: list[list[Item]] = []
    for batch in arrivals:
        for lane in batch:
            counts[lane] = counts.get(lane, 0) + 1
            lanes.put((lane, counts[lane]), lane)
        groups.append(lanes.take())
    while lanes:
        groups.append(lanes.take())
    return groups, sum(counts.values())


@given(runs, sizes)
def test_every_call_is_taken_once_in_its_lanes_arrival_order(
    arrivals: list[list[str | None]], size: tuple[int, int]
) -> None:
    groups, put = play(arrivals, *size)
    taken = [item for group in groups for item in group]
    assert len(taken) == put == len(set(taken))
    for lane in (WORKER_LANE, *TENANTS):
        numbers = [n for name, n in taken if name == lane]
        assert numbers == sorted(numbers)


@given(runs, sizes)
def test_a_group_holds_at_most_max_group_calls_and_per_tenant_of_one_tenant(
    arrivals: list[list[str | None]], size: tuple[int, int]
) -> None:
    max_group, per_tenant = size
    groups, _ = play(arrivals, max_group, per_tenant)
    for group in groups:
        assert len(group) <= max_group
        for tenant in TENANTS:
            assert sum(1 for lane, _ in group if lane == tenant) <= per_tenant


@given(runs, sizes)
def test_workers_calls_run_before_every_submission_that_waited_with_them(
    arrivals: list[list[str | None]], size: tuple[int, int]
) -> None:
    max_group, per_tenant = size
    lanes: Lanes[str | None] = Lanes(max_group, per_tenant)
    for batch in arrivals:
        for lane in batch:
            lanes.put(lane, lane)
        workers_waiting = lanes.waiting(WORKER_LANE)
        group = lanes.take()
        workers = group.count(WORKER_LANE)
        # no worker call comes after a submission in a group
        assert group[:workers] == [WORKER_LANE] * workers
        # and every waiting worker call is in it, unless the workers already have half the group or more
        assert workers == workers_waiting or workers >= max_group - max_group // 2


@given(runs, sizes)
def test_a_tenant_with_calls_waiting_is_served_within_a_bounded_number_of_groups(
    arrivals: list[list[str | None]], size: tuple[int, int]
) -> None:
    max_group, per_tenant = size
    lanes: Lanes[str | None] = Lanes(max_group, per_tenant)
    bound = len(TENANTS)  # groups leave at least one place for a waiting tenant; served tenants go last
    unserved: dict[str, int] = {}  # tenant -> groups taken while it waited and got nothing
    for batch in [*arrivals, *([[]] * 200)]:
        for lane in batch:
            lanes.put(lane, lane)
        waiting = {t for t in TENANTS if lanes.waiting(t)}
        group = lanes.take()
        for tenant in waiting:
            unserved[tenant] = 0 if tenant in group else unserved.get(tenant, 0) + 1
            assert unserved[tenant] < bound
        if not lanes:
            break


@given(st.integers(1, 60), st.integers(2, 20), st.integers(1, 8))
def test_a_tenant_alone_still_fills_its_groups_up_to_per_tenant(
    n: int, max_group: int, per_tenant: int
) -> None:
    lanes: Lanes[int] = Lanes(max_group, per_tenant)
    for i in range(n):
        lanes.put(i, "acme")
    sizes = []
    while lanes:
        sizes.append(len(lanes.take()))
    assert sum(sizes) == n
    assert all(s == min(per_tenant, max_group) for s in sizes[:-1])


@pytest.mark.parametrize("max_group, per_tenant", [(1, 1), (2, 0)])
def test_lanes_refuse_sizes_that_cannot_serve_both_workers_and_tenants(
    max_group: int, per_tenant: int
) -> None:
    with pytest.raises(ValueError, match="max_group"):
        Lanes(max_group, per_tenant)


async def submitted(service: Service, tenant: str, text: str) -> list[Task]:
    """A submission as the routes make it: in its tenant's lane."""
    specs = [spec(text)]
    return await service.submit(tenant, functools.partial(service.controller.submit, tenant, specs),
                                [(s.capability, tenant) for s in specs], queued=list)  # fmt: skip


def test_a_calm_tenants_submission_and_a_workers_call_go_ahead_of_a_flooding_tenants_backlog(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'lanes.db'}")
    groups: list[list[str]] = []  # each group the database thread ran: whose calls, in the order they ran
    flood_order: list[str] = []  # the flood's submissions, in the order they ran
    real_run_group = Service._run_group

    def spying_run_group(self: Service, batch: list[Any]) -> bool:
        names = []
        for job in batch:
            fn, args = job.fn.func, job.fn.args
            names.append(args[0] if fn == self.controller.submit else getattr(fn, "__name__", "other"))
            if names[-1] == "flood":
                flood_order.append(args[1][0].input["text"])
        groups.append(names)
        return real_run_group(self, batch)

    monkeypatch.setattr(Service, "_run_group", spying_run_group)

    async def body(service: Service) -> None:
        ctrl = service.controller
        worker = await register(service)
        # Given the database thread held by a slow call, and a flooding tenant's backlog queued behind it
        gate = threading.Event()
        stuck = asyncio.ensure_future(service.call(gate.wait, 30))
        await asyncio.sleep(0.05)
        flood = [asyncio.ensure_future(submitted(service, "flood", str(i))) for i in range(40)]
        await asyncio.sleep(0.05)
        # When a calm tenant submits, and a worker asks for work, after the whole backlog
        calm = asyncio.ensure_future(submitted(service, "calm", "calm"))
        leased = asyncio.ensure_future(service.call(ctrl.lease, worker.id, max_tasks=1))
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(stuck, calm, leased, *flood)
        # Then the next group runs the worker's call first, the calm submission, and no more than PER_TENANT
        # of the flood; the rest of the flood comes in later groups
        held = next(i for i, names in enumerate(groups) if "wait" in names)
        following = groups[held + 1]
        assert following.index("lease") < following.index("calm")
        assert following.count("flood") == PER_TENANT
        assert sum(names.count("flood") for names in groups[held + 2 :]) == 40 - PER_TENANT
        # and the flood's submissions ran in the order they came, every one of them queued
        assert flood_order == [str(i) for i in range(40)]
        assert len(ctrl.list_tasks("flood", state=TaskState.QUEUED.value, limit=1000)) == 40

    run_with_service(store, FakeClock(), body)
