"""`placement.place`, the one per-task lease decision, as a table and as properties over random rooms."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnout import placement, profiles
from turnout.batching import BatchBook
from turnout.gpu.allocation import GpuGrant
from turnout.gpu.devices import GpuDevice
from turnout.models import (
    Allocation,
    Device,
    GpuMode,
    Routing,
    Task,
    TaskSpec,
    TaskState,
    Variant,
    Worker,
    WorkerState,
)
from turnout.placement import BatchRole, Facts, Placement, place
from turnout.resources import parse_resources
from turnout.tenancy import LimitsTable, TenantLimits

GiB = 2**30
NOW = 100.0

SHARE = Variant("c", Device.GPU, parse_resources({"gpu_memory": "4Gi", "cpu": 1}))
WHOLE = Variant("c", Device.GPU, parse_resources({"gpu": 1, "cpu": 1}))
CPU = Variant("c", Device.CPU, parse_resources({"cpu": 1, "memory": "1Gi"}))
BATCHED = Variant(
    "c", Device.GPU, parse_resources({"gpu": 1, "cpu": 1}), max_batch_size=4, max_batch_wait_ms=50
)


def worker(wid: str, variants: tuple[Variant, ...], gpus: int = 1, gpu_mem: int = 24, cpu: float = 4.0,
           metrics: Mapping[str, object] | None = None) -> Worker:  # fmt: skip
    devs = tuple(GpuDevice(i, f"GPU-{wid}-{i}", "Fake GPU", gpu_mem * GiB).to_dict() for i in range(gpus))
    return Worker(id=wid, name=wid, host="h", state=WorkerState.HEALTHY, variants=variants, cpu=cpu,
                  memory_bytes=16 * GiB, gpus=devs, strategy="pack", registered_at=0.0, last_heartbeat=0.0,
                  heartbeat_s=5.0, metrics=dict(metrics or {}))  # fmt: skip


def task(tid: str = "x", gpu: GpuMode = GpuMode.PREFER, tenant: str = "t", queued_at: float = NOW,
         **fields: object) -> Task:  # fmt: skip
    spec = TaskSpec(capability="c", input=None, gpu=gpu)
    fields.setdefault("state", TaskState.QUEUED)
    return Task(id=tid, tenant=tenant, spec=spec, created_at=0.0, queued_at=queued_at,
                **fields)  # type: ignore[arg-type]  # fmt: skip


@dataclass
class FakeReads:
    """The store's answers as plain values: what a lease request would read."""

    held_gpus: dict[str, float] = field(default_factory=dict)
    rate_wait_s: float = 0.0
    fleet: placement.Fleet | None = None
    serves: dict[str, str] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)

    def gpu_use(self) -> Mapping[str, float]:
        self.calls.append("gpu_use")
        return self.held_gpus

    def gpu_rate_wait_s(self, tenant: str, n: int) -> float:
        return self.rate_wait_s

    def auto_fleet(self) -> profiles.Fleet:
        return profiles.Fleet((), (), (), ())

    def gpu_fleet(self) -> placement.Fleet:
        assert self.fleet is not None, "the test gave no fleet"
        return self.fleet

    def worker_tenants(self) -> Mapping[str, str]:
        self.calls.append("worker_tenants")
        return self.serves


def decide(t: Task, here: Worker, *others: Worker, reads: FakeReads | None = None,
           limits: LimitsTable | None = None, book: BatchBook | None = None) -> Placement | None:  # fmt: skip
    workers = [here, *others]
    reads = reads or FakeReads()
    if reads.fleet is None:
        reads.fleet = placement.Fleet("fgd", [w for w in workers if w.gpus], {})
    facts = Facts(workers, reads, limits or LimitsTable())
    return place(t, here, placement.room_of(here, []), facts, now=NOW, book=book)


def test_given_a_free_gpu_when_a_prefer_task_is_placed_then_it_takes_the_gpu_and_says_so() -> None:
    p = decide(task(), worker("a", (SHARE, CPU)))
    assert p is not None and p.device is Device.GPU and p.reason == "gpu available"
    assert p.grant is not None and p.grant.uuids == ("GPU-a-0",) and p.grant.memory_bytes == 4 * GiB
    assert p.unit_memory_bytes == 24 * GiB and p.gpu_share == pytest.approx(4 / 24)
    assert p.gpus() == replace(p.grant, unit_memory_bytes=24 * GiB)


def test_given_a_never_task_when_placed_then_it_runs_on_the_cpu_with_no_grant() -> None:
    p = decide(task(gpu=GpuMode.NEVER), worker("a", (SHARE, CPU)))
    assert p is not None and (p.device, p.reason, p.grant, p.gpus()) == (Device.CPU, "gpu: never", None, None)


def test_given_a_cpu_only_worker_when_a_require_task_asks_then_it_stays_queued() -> None:
    assert decide(task(gpu=GpuMode.REQUIRE), worker("a", (CPU,), gpus=0), worker("g", (SHARE,))) is None


@pytest.mark.parametrize(
    ("limits", "reads", "why"),
    [
        (TenantLimits(max_gpus=0), FakeReads(), "tenant t holds its max_gpus 0"),
        (TenantLimits(max_gpus=1), FakeReads(held_gpus={"t": 1.0}), "tenant t holds its max_gpus 1"),
        (TenantLimits(), FakeReads(rate_wait_s=3.0), "tenant t is over its gpu_allocations_per_min"),
    ],
)
def test_given_a_tenant_refused_a_gpu_when_its_prefer_task_waited_then_it_runs_on_the_cpu_saying_why(
    limits: TenantLimits, reads: FakeReads, why: str
) -> None:
    here = worker("a", (SHARE, CPU))
    table = LimitsTable(default=limits)
    assert decide(task(), here, reads=reads, limits=table) is None  # not waited gpu_wait_s yet: stays queued
    p = decide(task(queued_at=NOW - 11), here, reads=reads, limits=table)
    assert p is not None and p.device is Device.CPU and p.reason.startswith(f"{why}; gpu queue wait 11 s")


def test_given_no_quota_when_a_gpu_is_granted_then_tenant_usage_is_never_read() -> None:
    reads = FakeReads()
    assert decide(task(), worker("a", (SHARE, CPU)), reads=reads) is not None
    assert "gpu_use" not in reads.calls


def test_given_an_oom_on_the_only_gpu_when_retried_then_it_goes_to_the_cpu_naming_the_gpu() -> None:
    routing = Routing(avoid_gpus=("GPU-a-0",), last_error={"type": "gpu_oom"})
    p = decide(task(routing=routing), worker("a", (SHARE, CPU)))
    assert p is not None and p.device is Device.CPU
    assert p.reason == "gpu out of memory on GPU-a-0; no healthy gpu worker"


def test_given_a_better_fitting_worker_when_a_fresh_gpu_task_asks_then_it_is_left_to_that_worker_a_moment() -> (
    None
):
    a, b = worker("a", (SHARE,)), worker("b", (SHARE,))
    running = task("r", state=TaskState.RUNNING, worker_id="b", device=Device.GPU, alloc=Allocation(cpu=1, memory=0),
                   gpus=GpuGrant(("GPU-b-0",), (0,), 4 * GiB, False, "Fake GPU", False))  # fmt: skip
    reads = FakeReads(fleet=placement.Fleet("fgd", [a, b], {"b": [running]}))
    assert decide(task(), a, b, reads=reads) is None
    reads = FakeReads(fleet=placement.Fleet("fgd", [a, b], {"b": [running]}))
    settled = decide(task(queued_at=NOW - placement.PLACEMENT_SETTLE_S), a, b, reads=reads)
    assert settled is not None and settled.device is Device.GPU


def test_given_a_warm_worker_that_serves_the_tenant_when_a_cold_one_asks_then_the_task_waits_for_the_warm() -> (
    None
):
    warm = worker("w", (SHARE, CPU), metrics={"pools": {"c:gpu": {"loaded": 1}}})
    cold = worker("a", (SHARE, CPU))
    assert decide(task(), cold, warm) is None
    reads = FakeReads(serves={"w": "other"})  # the warm worker serves another tenant only
    assert decide(task(), cold, warm, reads=reads) is not None and "worker_tenants" in reads.calls


def test_given_a_batched_variant_when_two_tasks_are_placed_then_the_second_rides_on_the_first_grant() -> None:
    here = worker("a", (BATCHED,))
    facts = Facts([here], FakeReads(fleet=placement.Fleet("fgd", [here], {})))
    room, book = placement.room_of(here, []), BatchBook()
    lead = place(task("l"), here, room, facts, now=NOW, book=book)
    assert lead is not None and lead.batch is BatchRole.LEADER and lead.grant is not None
    room.take(task("l"), lead)
    book.start(task("l"), lead.device, lead.variant, lead.grant, lead.gpu_share, lead.unit_memory_bytes)
    rider = place(task("r"), here, room, facts, now=NOW, book=book)
    assert rider is not None and rider.batch is BatchRole.RIDER and rider.riding is not None
    assert rider.grant == lead.grant and rider.gpus() == lead.gpus()
    assert rider.reason == "gpu available; batched with l"


def test_given_a_full_worker_when_a_task_asks_then_it_stays_queued() -> None:
    here = worker("a", (CPU,), gpus=0, cpu=0.5)
    assert decide(task(gpu=GpuMode.NEVER), here) is None


# ---- properties over random rooms ----------------------------------------------------------------------

held_shares = st.lists(
    st.integers(min_value=1, max_value=24), max_size=3
)  # GiB held on each of a GPU's shares


@settings(max_examples=150, deadline=None)
@given(
    gpus=st.lists(held_shares, min_size=0, max_size=3),
    ask_gib=st.integers(min_value=1, max_value=30),
    whole=st.booleans(),
    mode=st.sampled_from(list(GpuMode)),
    cpu_free=st.floats(min_value=0, max_value=4),
    offers_cpu=st.booleans(),
)
def test_a_placement_never_exceeds_free_gpu_memory_or_the_room_and_a_gpu_only_task_never_lands_on_a_cpu(
    gpus: list[list[int]], ask_gib: int, whole: bool, mode: GpuMode, cpu_free: float, offers_cpu: bool
) -> None:
    gpu_variant = Variant("c", Device.GPU, parse_resources({"gpu": 1, "cpu": 0.5} if whole else
                                                           {"gpu_memory": f"{ask_gib}Gi", "cpu": 0.5}))  # fmt: skip
    variants = (gpu_variant, CPU) if offers_cpu else (gpu_variant,)
    here = worker("a", variants, gpus=len(gpus), cpu=4.0)
    active = []
    for i, shares in enumerate(gpus):
        for j, gib in enumerate(shares):
            grant = GpuGrant((f"GPU-a-{i}",), (i,), gib * GiB, False, "Fake GPU", False)
            active.append(task(f"h{i}-{j}", state=TaskState.RUNNING, worker_id="a", device=Device.GPU,
                               alloc=Allocation(cpu=0, memory=0), gpus=grant))  # fmt: skip
    room = placement.room_of(here, active)
    room.cpu = cpu_free
    facts = Facts([here], FakeReads(fleet=placement.Fleet("fgd", [here], {"a": active})))
    p = place(task(gpu=mode, queued_at=0.0), here, room, facts, now=NOW)
    if p is None:
        return
    assert p.resources.cpu <= room.cpu + 1e-9 and p.resources.memory_bytes <= room.memory_bytes
    if p.device is Device.CPU:
        assert offers_cpu and mode is not GpuMode.REQUIRE and p.grant is None
        return
    assert mode is not GpuMode.NEVER and p.grant is not None
    for uuid in p.grant.uuids:
        i = int(uuid.rsplit("-", 1)[1])
        held = sum(gpus[i]) * GiB
        if p.grant.exclusive:
            assert held == 0  # a whole GPU is taken only when nothing is on it
        else:
            assert held + p.grant.memory_bytes <= 24 * GiB  # never more than the unit has free


def test_auto_counts_only_the_slots_of_workers_that_serve_the_tasks_tenant() -> None:
    """`auto` divides the work queued ahead on a device class by the slots that serve it: the slots of workers
    that serve the task's tenant. Acme's 400 private CPU slots would make the CPU look free to bob, whose
    tasks they will never run."""
    here = worker("g", (SHARE, CPU), gpus=1, cpu=4.0)
    acmes = worker("acme-big", (CPU,), gpus=0, cpu=400.0)
    fleet = profiles.Fleet(
        (profiles.Profile("c", "cpu", None, 5, 2.0), profiles.Profile("c", "gpu", None, 5, 0.2)),
        (here, acmes), (), (("c", "never", 100), ("c", "require", 20)),
    )  # fmt: skip

    class Reads(FakeReads):
        def auto_fleet(self) -> profiles.Fleet:
            return fleet

    reads = Reads(serves={"acme-big": "acme"})
    # 100 CPU tasks of 2 s ahead over bob's 4 slots (52 s) against 20 GPU tasks of 0.2 s on one GPU (4.2 s)
    placed = decide(task(gpu=GpuMode.AUTO, tenant="bob"), here, acmes, reads=reads)
    assert placed is not None and placed.device is Device.GPU, placed
    # for acme, whose workers they are, the CPU is sooner (200 s over 404 slots, 2.5 s)
    mine = decide(task(gpu=GpuMode.AUTO, tenant="acme"), here, acmes, reads=reads)
    assert mine is not None and mine.device is Device.CPU, mine
