"""The NVML provider against a stand-in `pynvml` answering what real nvidia-smi captures show."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pynvml
import pytest
from nvidia_paths import NVIDIA_FIXTURES, nvidia_samples
from nvml_standin import StandInNvml, standin_from_xml

from turnout.gpu.devices import GpuDevice, GpuMetrics, MigDevice
from turnout.gpu.fake import FakeGpuProvider
from turnout.gpu.health import FELL_OFF_BUS
from turnout.gpu.nvml import NvmlProvider
from turnout.gpu.provider import ProviderError, discover
from turnout.gpu.smi import devices_from_xml, metrics_from_xml, parse_list

GIB = 1024**3
XML = nvidia_samples("smi-xml", "*.xml")
pytestmark = pytest.mark.usefixtures("nvidia_fixtures")


@pytest.mark.parametrize("sample", XML, ids=lambda p: p.name)
def test_nvml_reports_what_nvidia_smi_reports_for_the_same_gpus(sample: Path) -> None:
    text = sample.read_text()
    provider = NvmlProvider(standin_from_xml(sample, driver="535.54.03", cuda=12020))
    expected = [replace(d, provider="nvml", driver_version="535.54.03", cuda_version="12.2")
                for d in devices_from_xml(text)]  # fmt: skip
    assert provider.devices() == expected
    assert provider.metrics() == metrics_from_xml(text)  # N/A readings are None on both paths


def test_mig_devices_come_with_uuids_profiles_and_instance_ids() -> None:
    (gpu,) = parse_list(
        (NVIDIA_FIXTURES / "smi-list" / "h100-80gb-hbm3-mig-mixed-crlf.txt").read_bytes().decode()
    )
    migs = tuple(
        MigDevice(m.uuid, m.profile, int(m.profile.split(".")[1][:-2]) * GIB, gpu_instance_id=i + 1,
                  compute_instance_id=0, index=i)
        for i, m in enumerate(gpu.migs)
    )  # fmt: skip
    device = GpuDevice(0, gpu.uuid, gpu.name, 80 * GIB, 80 * GIB, "9.0", "00000000:00:09.0", 0, mig_mode=True,
                       mig_devices=migs)  # fmt: skip
    provider = NvmlProvider(StandInNvml([device], [GpuMetrics(gpu.uuid, memory_used_bytes=59 << 20)]))
    (found,) = provider.devices()
    assert found.mig_mode and [(m.uuid, m.profile) for m in found.mig_devices] == [
        (m.uuid, m.profile) for m in migs
    ]
    assert [m.gpu_instance_id for m in found.mig_devices] == [1, 2, 3, 4]
    (reading,) = provider.metrics()
    assert reading.utilization_pct is None and reading.temperature_c is None  # NotSupported -> None


@pytest.mark.parametrize(
    ("code", "absent"),
    [(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, True), (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, True),
     (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, False), (pynvml.NVML_ERROR_NO_PERMISSION, False)],
)  # fmt: skip
def test_nvml_init_failure_is_a_provider_error(code: int, absent: bool) -> None:
    with pytest.raises(ProviderError, match="NVML init failed") as err:
        NvmlProvider(StandInNvml([], [], init_error=code))
    assert err.value.absent is absent


def test_nvml_init_failure_falls_through_to_the_next_provider() -> None:
    standin = StandInNvml([], [], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    found = discover(
        "auto", probes=[("nvml", lambda: NvmlProvider(standin)), ("fake", lambda: FakeGpuProvider("1x8Gi"))]
    )
    assert found.provider.name == "fake" and found.tried == [("nvml", "NVML init failed: Driver Not Loaded")]


def test_a_lost_gpu_reads_as_fallen_off_the_bus_and_the_others_keep_reading() -> None:
    standin = standin_from_xml(NVIDIA_FIXTURES / "smi-xml" / "8x-tesla-v100s-pcie-32gb-460.73.01.xml")
    provider = NvmlProvider(standin)
    provider.devices()
    standin.lost.add(3)
    readings = provider.metrics()
    assert readings[3].health == FELL_OFF_BUS and readings[3].memory_used_bytes is None
    assert all(r.health == "ok" and r.memory_used_bytes for i, r in enumerate(readings) if i != 3)


def test_xid_events_are_attributed_to_their_gpu_once() -> None:
    standin = standin_from_xml(NVIDIA_FIXTURES / "smi-xml" / "8x-tesla-v100s-pcie-32gb-460.73.01.xml")
    provider = NvmlProvider(standin)
    provider.devices()
    standin.pending_xids.extend([(2, 79), (2, 13), (5, 48)])
    first = provider.metrics()
    assert (first[2].xid_errors, first[5].xid_errors, first[0].xid_errors) == ((79, 13), (48,), ())
    assert all(r.xid_errors == () for r in provider.metrics())


def test_the_real_pynvml_without_a_driver_fails_cleanly() -> None:
    # On a host without libnvidia-ml this is the path `--gpus auto` takes first; with a GPU it just works.
    try:
        provider = NvmlProvider()
    except ProviderError as err:
        assert "NVML" in str(err) or "pynvml" in str(err)
    else:
        assert isinstance(provider.devices(), list)
