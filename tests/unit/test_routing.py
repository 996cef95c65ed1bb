"""The routing rules as a table: given what the asking worker and the cluster can do, where does a task go."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnout.errors import InvalidInput
from turnout.models import Device, GpuMode
from turnout.routing import ClusterView, WorkerOffer, route, servable

GPU_FREE = WorkerOffer(cpu_variant=True, gpu_variant=True, cpu_fits=True, gpu_fits=True)
CPU_ONLY = WorkerOffer(cpu_variant=True, cpu_fits=True)
NO_ROOM = WorkerOffer(cpu_variant=True, gpu_variant=True)
GPUS_EXIST = ClusterView(gpu_possible=True, cpu_possible=True)
NO_GPUS = ClusterView(gpu_possible=False, cpu_possible=True)


@pytest.mark.parametrize(
    ("mode", "waited", "offer", "cluster", "device", "reason"),
    [
        (GpuMode.PREFER, 0, GPU_FREE, GPUS_EXIST, Device.GPU, "gpu available"),
        (GpuMode.AUTO, 0, GPU_FREE, GPUS_EXIST, Device.GPU, "gpu available"),
        (GpuMode.PREFER, 0, CPU_ONLY, NO_GPUS, Device.CPU, "no healthy gpu worker"),
        (GpuMode.PREFER, 0, CPU_ONLY, GPUS_EXIST, None, None),  # a GPU worker exists: wait for it
        (GpuMode.PREFER, 11, CPU_ONLY, GPUS_EXIST, Device.CPU, "gpu queue wait 11 s > gpu_wait_s 10 s"),
        (GpuMode.NEVER, 0, GPU_FREE, GPUS_EXIST, Device.CPU, "gpu: never"),
        (GpuMode.NEVER, 0, WorkerOffer(gpu_variant=True, gpu_fits=True), GPUS_EXIST, None, None),
        (GpuMode.REQUIRE, 0, CPU_ONLY, NO_GPUS, None, None),
        (GpuMode.REQUIRE, 99, CPU_ONLY, GPUS_EXIST, None, None),
        (GpuMode.REQUIRE, 0, GPU_FREE, GPUS_EXIST, Device.GPU, "gpu: require"),
        (GpuMode.PREFER, 0, NO_ROOM, NO_GPUS, None, None),
    ],
)
def test_route_table(mode: GpuMode, waited: float, offer: WorkerOffer, cluster: ClusterView,
                     device: Device | None, reason: str | None) -> None:  # fmt: skip
    decision = route(mode, waited, 10.0, offer, cluster)
    assert (decision.device if decision else None) is device
    assert (decision.reason if decision else None) == reason


@given(
    st.sampled_from(list(GpuMode)),
    st.floats(0, 1e6),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
def test_route_never_picks_a_device_that_does_not_fit_or_is_forbidden(
    mode: GpuMode, waited: float, cpu_fits: bool, gpu_fits: bool, gpu_possible: bool, cpu_possible: bool
) -> None:
    offer = WorkerOffer(cpu_variant=cpu_fits, gpu_variant=gpu_fits, cpu_fits=cpu_fits, gpu_fits=gpu_fits)
    decision = route(mode, waited, 10.0, offer, ClusterView(gpu_possible, cpu_possible))
    if decision is None:
        return
    assert decision.device is not Device.GPU or gpu_fits
    assert decision.device is not Device.CPU or cpu_fits
    assert not (mode is GpuMode.NEVER and decision.device is Device.GPU)
    assert not (mode is GpuMode.REQUIRE and decision.device is Device.CPU)


def test_servable_follows_what_the_gpu_value_allows() -> None:
    assert servable(GpuMode.REQUIRE, GPUS_EXIST)
    assert not servable(GpuMode.REQUIRE, NO_GPUS)
    assert servable(GpuMode.NEVER, NO_GPUS)
    assert not servable(GpuMode.NEVER, ClusterView(gpu_possible=True, cpu_possible=False))
    assert servable(GpuMode.PREFER, ClusterView(gpu_possible=True, cpu_possible=False))


@pytest.mark.parametrize(("value", "mode"), [(True, GpuMode.PREFER), (False, GpuMode.NEVER), ("auto", GpuMode.AUTO),
                                             (None, GpuMode.AUTO), ("require", GpuMode.REQUIRE)])  # fmt: skip
def test_gpu_field_values(value: object, mode: GpuMode) -> None:
    assert GpuMode.parse(value) is mode


def test_a_bad_gpu_value_names_the_field() -> None:
    with pytest.raises(InvalidInput) as err:
        GpuMode.parse("sometimes", "tasks.3.gpu")
    assert err.value.field == "tasks.3.gpu"
