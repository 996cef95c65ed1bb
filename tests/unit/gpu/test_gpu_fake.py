"""The fake provider: spec grammar, realistic devices, live metrics, and faults driven by API or file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnout.errors import InvalidInput
from turnout.gpu.devices import units_of
from turnout.gpu.fake import FakeGpuGroup, FakeGpuProvider, parse_fake_spec, write_fake_state
from turnout.gpu.health import FELL_OFF_BUS, NOT_ANSWERING

GIB = 1024**3


def test_two_generic_gpus_get_deterministic_uuids_and_a_generic_name() -> None:
    devices = FakeGpuProvider("fake:2x80Gi").devices()
    assert [(d.index, d.uuid, d.name, d.memory_total_bytes) for d in devices] == [
        (0, "GPU-fake-0", "Fake GPU 80Gi", 80 * GIB),
        (1, "GPU-fake-1", "Fake GPU 80Gi", 80 * GIB),
    ]
    assert all(d.provider == "fake" and d.driver_version and d.cuda_version for d in devices)


def test_known_models_get_real_names_and_compute_capability() -> None:
    devices = FakeGpuProvider("1xH100-80Gi,1xL4-24Gi,1xT4,1xV100-16Gi,1xA100-40Gi,1xMystery-8Gi").devices()
    assert [(d.name, d.compute_capability) for d in devices] == [
        ("NVIDIA H100 80GB HBM3", "9.0"),
        ("NVIDIA L4", "8.9"),
        ("Tesla T4", "7.5"),
        ("Tesla V100-SXM2-16GB", "7.0"),
        ("NVIDIA A100-SXM4-40GB", "8.0"),
        ("NVIDIA Mystery", "8.0"),
    ]
    assert devices[2].memory_total_bytes == 16 * GIB  # a known model may omit its memory


def test_comma_after_mig_lists_profiles_of_one_gpu_until_the_next_group() -> None:
    devices = FakeGpuProvider("fake:1xA100-40Gi-mig:3g.20gb,2g.10gb,1xL4-24Gi").devices()
    a100, l4 = devices
    assert a100.mig_mode and not l4.mig_mode
    assert [(m.uuid, m.profile, m.memory_total_bytes) for m in a100.mig_devices] == [
        ("MIG-fake-0-0", "3g.20gb", 20 * GIB),
        ("MIG-fake-0-1", "2g.10gb", 10 * GIB),
    ]
    units = units_of(devices)
    assert [u.uuid for u in units] == ["MIG-fake-0-0", "MIG-fake-0-1", "GPU-fake-1"]


@pytest.mark.parametrize(
    "spec",
    ["", "fake:", "2", "2x", "0x80Gi", "2x80", "2x80Zi", "2xMystery", "1xA100-40Gi-mig:", "1xA100-40Gi-mig:3g",
     "1xA100-40Gi-mig:3g.20gb,4g.40gb", "80Gi,1x80Gi", "1x80Gi,3g.20gb", "1xH1$0-80Gi"],
)  # fmt: skip
def test_bad_fake_spec_is_invalid_input_naming_gpus(spec: str) -> None:
    with pytest.raises(InvalidInput) as err:
        parse_fake_spec(spec)
    assert err.value.field == "gpus"


_groups = st.builds(
    FakeGpuGroup,
    count=st.integers(1, 8),
    memory_bytes=st.sampled_from([40, 48, 80, 141]).map(lambda g: g * GIB),
    model=st.sampled_from([None, "H100", "A100", "L4", "T4", "RTX6000"]),
    mig_profiles=st.sampled_from(
        [(), ("1g.5gb",), ("3g.20gb", "2g.10gb"), ("1g.10gb", "1g.10gb", "2g.10gb")]
    ),
)


@given(st.lists(_groups, min_size=1, max_size=4))
def test_fake_spec_round_trips_through_its_text(groups: list[FakeGpuGroup]) -> None:
    text = ",".join(str(g) for g in groups)
    assert parse_fake_spec(f"fake:{text}") == tuple(groups)
    assert len(FakeGpuProvider(text).devices()) == sum(g.count for g in groups)


def test_metrics_are_idle_until_processes_and_readings_are_set() -> None:
    fake = FakeGpuProvider("fake:2x80Gi")
    idle = fake.metrics()[0]
    assert (idle.memory_used_bytes, idle.utilization_pct, idle.health) == (0, 0.0, "ok")
    fake.set_process("GPU-fake-0", 123, 3 * GIB)
    fake.set_readings("GPU-fake-0", utilization_pct=90)
    busy = fake.metrics()[0]
    assert busy.memory_used_bytes == 3 * GIB and busy.utilization_pct == 90
    assert busy.temperature_c is not None and busy.temperature_c > idle.temperature_c  # type: ignore[operator]
    assert fake.devices()[0].memory_free_bytes == 77 * GIB
    fake.set_process("GPU-fake-0", 123, 0)
    assert fake.metrics()[0].processes == ()


def test_processes_and_faults_on_a_mig_device_count_towards_its_parent() -> None:
    fake = FakeGpuProvider("1xA100-40Gi-mig:3g.20gb,2g.10gb")
    fake.set_process("MIG-fake-0-1", 7, GIB)
    assert fake.metrics()[0].memory_used_bytes == GIB
    fake.inject("MIG-fake-0-0", xid=[94])
    assert fake.metrics()[0].xid_errors == (94,) and not fake.canary("MIG-fake-0-0")
    fake.clear_faults("MIG-fake-0-0")
    assert fake.canary("GPU-fake-0")


def test_injected_faults_show_in_metrics_and_clear() -> None:
    fake = FakeGpuProvider("fake:2x80Gi")
    fake.inject("GPU-fake-1", xid=[79], fell_off_bus=True)
    lost = fake.metrics()[1]
    assert lost.health == FELL_OFF_BUS and lost.xid_errors == (79,) and lost.memory_used_bytes is None
    assert not fake.canary("GPU-fake-1") and fake.canary("GPU-fake-0")
    fake.clear_faults("GPU-fake-1")
    assert fake.metrics()[1].health == "ok" and fake.canary("GPU-fake-1")


def test_application_xids_do_not_block_the_canary() -> None:
    fake = FakeGpuProvider("fake:1x80Gi")
    fake.inject("GPU-fake-0", xid=[13, 31])
    assert fake.canary("GPU-fake-0")


def test_unknown_uuid_is_refused() -> None:
    with pytest.raises(KeyError):
        FakeGpuProvider("fake:1x80Gi").set_process("GPU-nope", 1, 1)


def test_a_second_process_drives_faults_through_the_state_file(tmp_path: Path) -> None:
    state = tmp_path / "gpus.json"
    worker_side = FakeGpuProvider("fake:2x80Gi", state_file=state)
    assert worker_side.metrics()[0].health == "ok"  # no file yet: idle and healthy

    write_fake_state(state, "GPU-fake-0", unresponsive=True, ecc_uncorrected=2)
    write_fake_state(
        state, "GPU-fake-1", processes=[{"pid": 9, "used_memory_bytes": GIB}], utilization_pct=50
    )
    first, second = worker_side.metrics()
    assert first.health == NOT_ANSWERING and first.ecc_uncorrected == 2
    assert second.memory_used_bytes == GIB and second.utilization_pct == 50

    write_fake_state(state, "GPU-fake-0", unresponsive=False)
    assert worker_side.metrics()[0].health == "ok"


def test_provider_methods_write_the_state_file_for_other_readers(tmp_path: Path) -> None:
    state = tmp_path / "gpus.json"
    FakeGpuProvider("fake:1x80Gi", state_file=state).inject("GPU-fake-0", xid=[48])
    assert json.loads(state.read_text())["GPU-fake-0"]["xid"] == [48]
    assert FakeGpuProvider("fake:1x80Gi", state_file=state).metrics()[0].xid_errors == (48,)


def test_a_garbled_state_file_keeps_the_last_good_state(tmp_path: Path) -> None:
    state = tmp_path / "gpus.json"
    fake = FakeGpuProvider("fake:1x80Gi", state_file=state)
    write_fake_state(state, "GPU-fake-0", utilization_pct=40)
    assert fake.metrics()[0].utilization_pct == 40
    state.write_text('{"GPU-fake-0": {"utilization_pct": ')
    assert fake.metrics()[0].utilization_pct == 40
