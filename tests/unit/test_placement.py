"""Placement facts as pure functions: a worker's free room, what the cluster could serve, the fleet's pick."""

from __future__ import annotations

from turnout import placement
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
from turnout.resources import parse_resources

GiB = 2**30


def worker(wid: str, gpus: int = 1, gpu_mem: int = 24, variants: tuple[Variant, ...] = ()) -> Worker:
    devs = tuple(GpuDevice(i, f"GPU-{wid}-{i}", "Fake GPU", gpu_mem * GiB).to_dict() for i in range(gpus))
    return Worker(id=wid, name=wid, host="h", state=WorkerState.HEALTHY, variants=variants, cpu=4.0,
                  memory_bytes=16 * GiB, gpus=devs, strategy="pack", registered_at=0.0, last_heartbeat=0.0,
                  heartbeat_s=5.0)  # fmt: skip


def task(tid: str, cap: str = "c", tenant: str = "t", **fields: object) -> Task:
    spec = TaskSpec(capability=cap, input=None, gpu=GpuMode.PREFER)
    fields.setdefault("state", TaskState.QUEUED)
    return Task(id=tid, tenant=tenant, spec=spec, created_at=0.0, **fields)  # type: ignore[arg-type]


SHARE = Variant("c", Device.GPU, parse_resources({"gpu_memory": "4Gi", "cpu": 1}))
CPU = Variant("c", Device.CPU, parse_resources({"cpu": 1, "memory": "1Gi"}))


def test_room_is_capacity_less_what_active_tasks_hold() -> None:
    w = worker("a", variants=(SHARE, CPU))
    held = task("t1", state=TaskState.RUNNING, worker_id="a", device=Device.GPU, alloc=Allocation(cpu=1.5, memory=GiB),
                gpus=GpuGrant(("GPU-a-0",), (0,), 4 * GiB, False, "Fake GPU", False))  # fmt: skip
    room = placement.room_of(w, [held])
    assert room.cpu == 2.5 and room.memory_bytes == 15 * GiB
    assert room.usage["GPU-a-0"].memory_bytes == 4 * GiB


def test_cluster_view_sees_gpu_variants_only_where_a_gpu_could_ever_fit() -> None:
    big = Variant("c", Device.GPU, parse_resources({"gpu_memory": "40Gi"}))
    assert placement.cluster_view([worker("a", variants=(big, CPU))], task("x")).gpu_possible is False
    assert (
        placement.cluster_view([worker("a", gpu_mem=80, variants=(big, CPU))], task("x")).gpu_possible is True
    )
    assert placement.cluster_view([worker("a", gpus=0, variants=(CPU,))], task("x")).cpu_possible is True


def test_a_gpu_that_ran_out_of_memory_is_not_offered_again() -> None:
    w = worker("a", gpus=2, variants=(SHARE,))
    retry = task("x", routing=Routing(avoid_gpus=("GPU-a-0",)))
    grant = placement.try_gpu(placement.room_of(w, []), SHARE.resources, retry)
    assert grant is not None and grant.uuids == ("GPU-a-1",)


def test_the_fleet_packs_a_share_next_to_a_running_share() -> None:
    a, b = worker("a", variants=(SHARE,)), worker("b", variants=(SHARE,))
    running = task("t1", state=TaskState.RUNNING, worker_id="b", device=Device.GPU, alloc=Allocation(cpu=1, memory=0),
                   gpus=GpuGrant(("GPU-b-0",), (0,), 4 * GiB, False, "Fake GPU", False))  # fmt: skip
    fleet = placement.Fleet("fgd", [a, b], {"b": [running]})
    assert fleet.best(SHARE.resources, task("new")) == "b"


def share_of(wid: str, tenant: str, tid: str = "t1") -> Task:
    return task(tid, tenant=tenant, state=TaskState.RUNNING, worker_id=wid, device=Device.GPU,
                alloc=Allocation(cpu=1, memory=0),
                gpus=GpuGrant((f"GPU-{wid}-0",), (0,), 4 * GiB, False, "Fake GPU", False))  # fmt: skip


def test_another_tenants_share_waits_while_a_gpu_holds_one_tenants_shares() -> None:
    w = worker("a", variants=(SHARE,))
    room = placement.room_of(w, [share_of("a", "acme")])
    assert room.usage["GPU-a-0"].tenants == frozenset({"acme"})
    assert placement.try_gpu(room, SHARE.resources, task("x", tenant="globex")) is None
    grant = placement.try_gpu(room, SHARE.resources, task("y", tenant="acme"))
    assert grant is not None and grant.uuids == ("GPU-a-0",)


def test_the_fleet_sends_another_tenants_share_to_a_gpu_of_its_own() -> None:
    a, b = worker("a", variants=(SHARE,)), worker("b", variants=(SHARE,))
    fleet = placement.Fleet("fgd", [a, b], {"b": [share_of("b", "acme")]})
    assert fleet.best(SHARE.resources, task("same", tenant="acme")) == "b"  # packs beside its own tenant
    assert fleet.best(SHARE.resources, task("other", tenant="globex")) == "a"
