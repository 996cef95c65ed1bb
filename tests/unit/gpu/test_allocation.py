"""Behaviour of GPU allocation on one worker, as tables of small examples."""

from __future__ import annotations

import pytest

from turnout.errors import Conflict, InvalidInput
from turnout.gpu.allocation import (
    GpuGrant,
    GpuRequest,
    Strategy,
    add_grant,
    allocate,
    fits_ever,
    remove_grant,
    usage_from_grants,
)
from turnout.gpu.devices import GpuDevice, GpuUnit, MigDevice, UnitUsage, units_of
from turnout.resources import Resources

GI = 1024**3


def gpu(index: int, model: str = "A100-80GB", mem_gi: int = 80, **kw: object) -> GpuUnit:
    return GpuUnit(f"GPU-{index}", index, model, mem_gi * GI, kw.pop("cc", "8.0"), **kw)  # type: ignore[arg-type]


@pytest.fixture
def four_a100() -> list[GpuUnit]:
    return [gpu(i) for i in range(4)]


def test_whole_gpu_request_takes_a_free_gpu_exclusively(four_a100: list[GpuUnit]) -> None:
    grant = allocate(GpuRequest(count=1), four_a100, {})
    assert grant == GpuGrant(("GPU-0",), (0,), 80 * GI, True, "A100-80GB", False)


def test_whole_gpu_request_skips_gpus_that_hold_a_share(four_a100: list[GpuUnit]) -> None:
    usage = {"GPU-0": UnitUsage(GI, False, 1), "GPU-1": UnitUsage(80 * GI, True, 1)}
    grant = allocate(GpuRequest(count=2), four_a100, usage)
    assert grant is not None and grant.uuids == ("GPU-2", "GPU-3")
    assert allocate(GpuRequest(count=3), four_a100, usage) is None


def test_shared_request_never_lands_on_an_exclusively_held_gpu() -> None:
    units = [gpu(0), gpu(1)]
    usage = {"GPU-0": UnitUsage(80 * GI, True, 1), "GPU-1": UnitUsage(79 * GI, False, 3)}
    assert allocate(GpuRequest(memory_bytes=GI), units, usage) == GpuGrant(
        ("GPU-1",), (1,), GI, False, "A100-80GB", False
    )
    assert allocate(GpuRequest(memory_bytes=2 * GI), units, usage) is None


def test_fraction_is_a_share_of_the_chosen_units_memory() -> None:
    grant = allocate(GpuRequest(fraction=0.25), [gpu(0, "L4", 24)], {})
    assert grant is not None and grant.memory_bytes == 6 * GI and not grant.exclusive


def test_fraction_and_memory_together_need_the_larger_of_both() -> None:
    grant = allocate(GpuRequest(fraction=0.1, memory_bytes=10 * GI), [gpu(0)], {})
    assert grant is not None and grant.memory_bytes == 10 * GI


def test_complementary_fractions_fill_a_gpu_exactly() -> None:
    units = [GpuUnit("GPU-0", 0, "T4", 16_000_000_000)]
    first = allocate(GpuRequest(fraction=0.46), units, {})
    assert first is not None
    usage = add_grant({}, first, None)
    second = allocate(GpuRequest(fraction=0.54), units, usage)
    assert second is not None and first.memory_bytes + second.memory_bytes == 16_000_000_000


def test_pack_takes_the_fullest_gpu_that_fits_and_spread_the_emptiest() -> None:
    units = [gpu(0), gpu(1), gpu(2)]
    usage = {"GPU-0": UnitUsage(10 * GI, False, 1), "GPU-1": UnitUsage(70 * GI, False, 1)}
    request = GpuRequest(memory_bytes=8 * GI)
    assert allocate(request, units, usage, Strategy.PACK).uuids == ("GPU-1",)  # type: ignore[union-attr]
    assert allocate(request, units, usage, Strategy.SPREAD).uuids == ("GPU-2",)  # type: ignore[union-attr]


def test_spread_breaks_ties_on_the_coolest_gpu() -> None:
    units = [gpu(0, temperature_c=70.0), gpu(1, temperature_c=40.0), gpu(2)]
    grant = allocate(GpuRequest(memory_bytes=GI), units, {}, Strategy.SPREAD)
    assert grant is not None and grant.uuids == ("GPU-1",)


def test_model_preference_wins_before_the_strategy() -> None:
    units = [gpu(0, "NVIDIA L40S", 48), gpu(1, "NVIDIA H100 80GB HBM3", 80)]
    usage = {"GPU-0": UnitUsage(40 * GI, False, 1)}  # L40S is the best fit by memory
    grant = allocate(GpuRequest(memory_bytes=GI, models=("h100", "L40S")), units, usage)
    assert grant is not None and grant.model == "NVIDIA H100 80GB HBM3"
    assert allocate(GpuRequest(count=1, models=("V100",)), units, {}) is None


def test_min_compute_capability_excludes_older_and_unknown_gpus() -> None:
    units = [gpu(0, "T4", 16, cc="7.5"), gpu(1, "A10", 24, cc=None), gpu(2, "A100", 40, cc="8.0")]
    grant = allocate(GpuRequest(count=1, min_compute_capability=(8, 0)), units, {})
    assert grant is not None and grant.uuids == ("GPU-2",)
    assert not fits_ever(GpuRequest(count=1, min_compute_capability=(9, 0)), units)


def test_unhealthy_gpus_are_never_chosen() -> None:
    units = [gpu(0, healthy=False), gpu(1)]
    assert allocate(GpuRequest(count=1), units, {}).uuids == ("GPU-1",)  # type: ignore[union-attr]
    assert allocate(GpuRequest(count=2), units, {}) is None


def test_multi_gpu_request_stays_on_one_model() -> None:
    units = [gpu(0, "A100"), gpu(1, "L4", 24), gpu(2, "L4", 24)]
    assert allocate(GpuRequest(count=2), units, {}).model == "L4"  # type: ignore[union-attr]
    assert not fits_ever(GpuRequest(count=3), units)


def test_pack_keeps_the_larger_free_group_for_larger_requests() -> None:
    units = [gpu(0, "A100"), gpu(1, "A100"), gpu(2, "A100"), gpu(3, "L4", 24)]
    assert allocate(GpuRequest(count=1), units, {}, Strategy.PACK).model == "L4"  # type: ignore[union-attr]
    assert allocate(GpuRequest(count=1), units, {}, Strategy.SPREAD).model == "A100"  # type: ignore[union-attr]


def test_whole_gpu_request_with_memory_needs_that_much_per_gpu() -> None:
    units = [gpu(0, "L4", 24), gpu(1, "A100", 80)]
    grant = allocate(GpuRequest(count=1, memory_bytes=40 * GI), units, {})
    assert grant is not None and grant.uuids == ("GPU-1",)


MIG_HOST = [
    GpuDevice(0, "GPU-M", "NVIDIA A100-SXM4-40GB", 40 * GI, compute_capability="8.0", mig_mode=True,
              mig_devices=(MigDevice("MIG-a", "3g.20gb", 20 * GI), MigDevice("MIG-b", "2g.10gb", 10 * GI, index=1))),
    GpuDevice(1, "GPU-W", "NVIDIA A100-SXM4-40GB", 40 * GI, compute_capability="8.0"),
]  # fmt: skip


def test_shared_request_takes_the_smallest_mig_device_that_fits_whole() -> None:
    units = units_of(MIG_HOST)
    grant = allocate(GpuRequest(memory_bytes=8 * GI), units, {})
    assert grant == GpuGrant(("MIG-b",), (0,), 10 * GI, True, "NVIDIA A100-SXM4-40GB", True)
    usage = add_grant({}, grant, None)
    assert allocate(GpuRequest(memory_bytes=GI), units, usage).uuids == ("MIG-a",)  # type: ignore[union-attr]


def test_whole_gpu_request_never_takes_a_mig_device_or_its_parent() -> None:
    units = units_of(MIG_HOST)
    assert allocate(GpuRequest(count=1), units, {}).uuids == ("GPU-W",)  # type: ignore[union-attr]
    assert not fits_ever(GpuRequest(count=2), units)


def test_training_and_inference_never_share_a_gpu() -> None:
    units = [gpu(0), gpu(1)]
    usage = usage_from_grants([(GpuGrant(("GPU-0",), (0,), GI, False, "A100-80GB", False), "training")])
    grant = allocate(GpuRequest(memory_bytes=GI, workload="inference"), units, usage)
    assert grant is not None and grant.uuids == ("GPU-1",)
    grant = allocate(GpuRequest(memory_bytes=GI, workload="training"), units, usage)
    assert grant is not None and grant.uuids == ("GPU-0",)


def test_from_resources_maps_each_gpu_shape() -> None:
    assert GpuRequest.from_resources(Resources(gpu=2, gpu_models=("H100",))).count == 2
    shared = GpuRequest.from_resources(Resources(cpu=2, gpu=0.5, memory_bytes=GI), workload="inference")
    assert (shared.count, shared.fraction, shared.cpu, shared.workload) == (0, 0.5, 2, "inference")
    by_memory = GpuRequest.from_resources(Resources(gpu_memory_bytes=4 * GI, min_compute_capability=(8, 0)))
    assert (by_memory.memory_bytes, by_memory.min_compute_capability) == (4 * GI, (8, 0))


@pytest.mark.parametrize(
    "kwargs",
    [{"count": -1}, {"fraction": 1.0}, {"fraction": 0.0}, {"count": 1, "fraction": 0.5}, {"memory_bytes": 0}],
)
def test_impossible_requests_are_invalid_input(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidInput):
        GpuRequest(**kwargs)  # type: ignore[arg-type]


def test_allocating_for_a_request_without_gpu_is_invalid_input(four_a100: list[GpuUnit]) -> None:
    with pytest.raises(InvalidInput):
        allocate(GpuRequest(), four_a100, {})


def test_grant_round_trips_through_a_dict() -> None:
    grant = GpuGrant(("GPU-1", "GPU-2"), (1, 2), 80 * GI, True, "H100", False)
    assert GpuGrant.from_dict(grant.to_dict()) == grant
    with pytest.raises(InvalidInput):
        GpuGrant.from_dict({"uuids": ["x"]})


def test_releasing_a_grant_that_is_not_held_is_a_conflict() -> None:
    with pytest.raises(Conflict):
        remove_grant({}, GpuGrant(("GPU-0",), (0,), GI, False, "A100", False), None)


def test_workload_label_stays_until_the_last_task_leaves() -> None:
    share = GpuGrant(("GPU-0",), (0,), GI, False, "A100", False)
    usage = usage_from_grants([(share, "training"), (share, None)])
    after = remove_grant(usage, share, "training")
    assert after["GPU-0"] == UnitUsage(GI, False, 1, frozenset({"training"}))
    assert remove_grant(after, share, None) == {}


# ---- tenancy: one tenant at a time on a shared non-MIG GPU ------------------------------------------


def _held_by(tenant: str, memory_gi: int = 10, exclusive: bool = False) -> UnitUsage:
    return UnitUsage(memory_gi * GI, exclusive, 1, frozenset(), frozenset({tenant}))


MIG_UNITS = units_of([GpuDevice(0, "GPU-M", "A100-40GB", 40 * GI, compute_capability="8.0", mig_mode=True,
                               mig_devices=(MigDevice("MIG-a", "3g.20gb", 20 * GI), MigDevice("MIG-b", "3g.20gb", 20 * GI)))])  # fmt: skip


@pytest.mark.parametrize(
    ("units", "usage", "request_", "expected"),
    [
        ([gpu(0), gpu(1)], {"GPU-0": _held_by("acme")}, GpuRequest(memory_bytes=GI, tenant="globex"), ("GPU-1",)),
        ([gpu(0)], {"GPU-0": _held_by("acme")}, GpuRequest(memory_bytes=GI, tenant="globex"), None),
        ([gpu(0)], {"GPU-0": _held_by("acme")}, GpuRequest(fraction=0.1, tenant="globex"), None),
        ([gpu(0), gpu(1)], {"GPU-0": _held_by("acme")}, GpuRequest(memory_bytes=GI, tenant="acme"), ("GPU-0",)),
        ([gpu(0)], {"GPU-0": _held_by("acme")}, GpuRequest(memory_bytes=GI), ("GPU-0",)),
        ([gpu(0), gpu(1)], {"GPU-0": _held_by("acme")}, GpuRequest(count=1, tenant="globex"), ("GPU-1",)),
        (MIG_UNITS, {"MIG-a": _held_by("acme", 20, True)}, GpuRequest(memory_bytes=GI, tenant="globex"), ("MIG-b",)),
    ],
    ids=["another tenant's share sends a share elsewhere", "and it waits when there is no elsewhere",
         "a fraction too", "the same tenant packs onto it", "a request with no tenant (the simulator) is not bound",
         "a whole GPU is its own", "a MIG device beside another tenant's is isolated by hardware"],
)  # fmt: skip
def test_a_shared_non_mig_gpu_holds_one_tenants_tasks_at_a_time(
    units: list[GpuUnit], usage: dict[str, UnitUsage], request_: GpuRequest, expected: tuple[str, ...] | None
) -> None:
    grant = allocate(request_, units, usage)
    assert (grant.uuids if grant else None) == expected


def test_usage_from_grants_records_whose_tasks_hold_each_unit() -> None:
    share = GpuGrant(("GPU-0",), (0,), GI, False, "A100-80GB", False)
    usage = usage_from_grants([(share, None, "acme"), (share, "inference", "acme"), (share, None)])
    assert usage["GPU-0"].tenants == frozenset({"acme"}) and usage["GPU-0"].tasks == 3
    assert allocate(GpuRequest(memory_bytes=GI, tenant="globex"), [gpu(0)], usage) is None
    emptied = remove_grant(remove_grant(remove_grant(usage, share, None), share, "inference"), share, None)
    assert emptied == {}  # the last task leaving frees the unit for any tenant
