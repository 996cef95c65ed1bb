"""Invariants of GPU allocation over random hosts, usages and requests (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from turnout.gpu.allocation import (
    GpuGrant,
    GpuRequest,
    Strategy,
    add_grant,
    allocate,
    fits_ever,
    model_rank,
    remove_grant,
)
from turnout.gpu.devices import GpuUnit, UnitUsage

GI = 1024**3
MODELS = ("A100-80GB", "H100", "L4", "T4")


@st.composite
def hosts(draw: st.DrawFn) -> list[GpuUnit]:
    """A host of 1-8 GPUs; some in MIG mode (only their MIG devices are units), some unhealthy."""
    units: list[GpuUnit] = []
    for index in range(draw(st.integers(1, 8))):
        model = draw(st.sampled_from(MODELS))
        mem = draw(st.sampled_from([16, 24, 40, 80])) * GI
        cc = draw(st.sampled_from(["7.5", "8.0", "9.0", None]))
        healthy = draw(st.integers(0, 3)) > 0
        temp = draw(st.none() | st.floats(20, 90))
        if draw(st.integers(0, 4)) == 0:
            for k, size in enumerate(draw(st.lists(st.sampled_from([5, 10, 20]), min_size=1, max_size=3))):
                units.append(GpuUnit(f"MIG-{index}-{k}", index, model, size * GI, cc, f"GPU-{index}",
                                     f"{size // 5}g.{size}gb", healthy, temp))  # fmt: skip
        else:
            units.append(GpuUnit(f"GPU-{index}", index, model, mem, cc, None, None, healthy, temp))
    return units


requests = st.one_of(
    st.builds(
        GpuRequest, count=st.integers(1, 4), memory_bytes=st.none() | st.sampled_from([20 * GI, 50 * GI])
    ),
    st.builds(GpuRequest, fraction=st.sampled_from([0.1, 0.25, 0.46, 0.5, 0.54, 0.9])),
    st.builds(GpuRequest, memory_bytes=st.integers(1, 30).map(lambda g: g * GI)),
).flatmap(
    lambda r: st.builds(
        GpuRequest,
        count=st.just(r.count),
        memory_bytes=st.just(r.memory_bytes),
        fraction=st.just(r.fraction),
        models=st.lists(st.sampled_from(("a100", "H100", "l4", "T4", "V100")), max_size=2).map(tuple),
        min_compute_capability=st.sampled_from([None, (8, 0), (9, 0)]),
        workload=st.sampled_from([None, "training", "inference"]),
        tenant=st.sampled_from([None, "acme", "globex"]),
    )
)
strategies = st.sampled_from(list(Strategy))


@st.composite
def busy_hosts(
    draw: st.DrawFn,
) -> tuple[list[GpuUnit], dict[str, UnitUsage], list[tuple[GpuGrant, str | None]]]:
    """A host and the usage left by a random sequence of successful allocations."""
    units = draw(hosts())
    usage: dict[str, UnitUsage] = {}
    held: list[tuple[GpuGrant, str | None]] = []
    for request in draw(st.lists(requests, max_size=12)):
        grant = allocate(request, units, usage, draw(strategies))
        if grant is not None:
            usage = add_grant(usage, grant, request.workload, request.tenant)
            held.append((grant, request.workload))
    return units, usage, held


def _check_invariants(units: list[GpuUnit], usage: dict[str, UnitUsage]) -> None:
    by_uuid = {u.uuid: u for u in units}
    for uuid, used in usage.items():
        unit = by_uuid[uuid]
        assert used.memory_bytes <= unit.memory_bytes, "memory over-committed"
        if used.exclusive:
            assert used.tasks == 1, "an exclusive unit is shared"
        if unit.is_mig:
            assert used.tasks == 1 and used.exclusive, "a MIG device is given whole to one task"
        assert not {"training", "inference"} <= used.workloads
        assert len(used.tenants) <= 1, "two tenants share one GPU's memory"
        assert unit.healthy


@settings(max_examples=150, deadline=None)
@given(busy_hosts())
def test_sequences_of_allocations_never_overcommit_or_share_exclusive_units(busy: tuple) -> None:  # type: ignore[type-arg]
    units, usage, _ = busy
    _check_invariants(units, usage)


@settings(max_examples=150, deadline=None)
@given(busy_hosts(), requests, strategies)
def test_a_grant_honours_health_models_capability_and_never_names_a_mig_parent(
    busy: tuple,  # type: ignore[type-arg]
    request: GpuRequest,
    strategy: Strategy,
) -> None:
    units, usage, _ = busy
    grant = allocate(request, units, usage, strategy)
    if grant is None:
        return
    by_uuid = {u.uuid: u for u in units}
    parents = {u.parent_uuid for u in units if u.is_mig}
    assert len(set(grant.uuids)) == len(grant.uuids) == max(request.count, 1)
    for uuid in grant.uuids:
        unit = by_uuid[uuid]
        assert uuid not in parents
        assert unit.healthy and model_rank(request, unit) is not None
        if request.min_compute_capability:
            assert unit.compute_capability is not None
    # The best-ranked model among units that could take it now was chosen.
    alone = [allocate(request, [u], usage, strategy) for u in units]
    feasible_ranks = [model_rank(request, u) for u, g in zip(units, alone, strict=True) if g is not None]
    if request.count <= 1 and feasible_ranks:
        assert model_rank(request, by_uuid[grant.uuids[0]]) == min(r for r in feasible_ranks if r is not None)
    _check_invariants(units, add_grant(usage, grant, request.workload, request.tenant))


@settings(max_examples=150, deadline=None)
@given(busy_hosts(), requests, strategies)
def test_add_then_remove_restores_the_prior_usage(
    busy: tuple, request: GpuRequest, strategy: Strategy
) -> None:  # type: ignore[type-arg]
    units, usage, _ = busy
    grant = allocate(request, units, usage, strategy)
    if grant is None:
        return
    after = remove_grant(add_grant(usage, grant, request.workload, request.tenant), grant, request.workload)
    for uuid, prior in usage.items():
        # a set cannot tell whether another task still has a label: kept (safe) until the unit empties
        assert after[uuid].workloads - {request.workload} == prior.workloads - {request.workload}
        assert after[uuid].tenants - {request.tenant} == prior.tenants - {request.tenant}
        assert prior.workloads <= after[uuid].workloads and prior.tenants <= after[uuid].tenants
        assert (after[uuid].memory_bytes, after[uuid].tasks, after[uuid].exclusive) == (
            prior.memory_bytes, prior.tasks, prior.exclusive)  # fmt: skip
    assert set(after) == set(usage)


@settings(max_examples=100, deadline=None)
@given(busy_hosts())
def test_releasing_every_grant_empties_the_host(busy: tuple) -> None:  # type: ignore[type-arg]
    _, usage, held = busy
    for grant, workload in reversed(held):
        usage = remove_grant(usage, grant, workload)
    assert usage == {}


@settings(max_examples=150, deadline=None)
@given(hosts(), requests, strategies)
def test_fits_ever_agrees_with_allocate_on_an_idle_host(
    units: list[GpuUnit], request: GpuRequest, strategy: Strategy
) -> None:
    assert fits_ever(request, units) == (allocate(request, units, {}, strategy) is not None)
