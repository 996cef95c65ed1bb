"""What a real H100 showed `python -m bench.gpu_check` (2026-11-26), pinned so the parsers keep agreeing with it.

NVML reported, for the GPU whose `nvidia-smi` outputs are in tests/fixtures/nvidia/: the values of `H100`
below, identical field by field to what `SmiProvider` parsed from those outputs; and 503,316,480 bytes used on
the idle GPU from NVML's first memory call, where nvidia-smi says 0 used and 480 MiB reserved. The provider now
asks the v2 call, so both providers read the same GPU the same way.
"""

from __future__ import annotations

from dataclasses import replace

from nvidia_paths import OWN_FIXTURES
from nvml_standin import standin_from_xml

from turnout.gpu.devices import GpuDevice
from turnout.gpu.nvml import NvmlProvider
from turnout.gpu.smi import SmiProvider, metrics_from_csv, parse_query_csv

XML = OWN_FIXTURES / "smi-xml" / "h100-80gb-hbm3-firecracker-580.159.04.xml"
CSV = OWN_FIXTURES / "smi-csv" / "h100-80gb-hbm3-firecracker-580.159.04-nounits.csv"
UUID = "GPU-856a50d2-d5da-c989-2093-31943db23eaf"
RESERVED = 480 * 1024**2
H100 = GpuDevice(index=0, uuid=UUID, name="NVIDIA H100 80GB HBM3", memory_total_bytes=85_520_809_984,
                 memory_free_bytes=85_017_493_504, compute_capability="9.0", pci_bus_id="00000000:00:06.0", minor=0,
                 driver_version="580.159.04", cuda_version="13.0", mig_mode=False, provider="nvml")  # fmt: skip


def _smi(argv: list[str], timeout_s: float = 15.0) -> str:
    """nvidia-smi as it answered on that host (compute_cap comes from its own query there)."""
    if argv[1:] == ["-q", "-x"]:
        return XML.read_text()
    if argv[1].startswith("--query-gpu=uuid,compute_cap"):
        return f"uuid, compute_cap\n{UUID}, 9.0\n"
    if argv[1].startswith("--query-compute-apps"):
        return "gpu_uuid, pid, used_gpu_memory [MiB]\n"
    return CSV.read_text()


def test_nvidia_smi_outputs_parse_to_what_nvml_reported_there() -> None:
    smi = SmiProvider(run=_smi)
    assert smi.devices() == [replace(H100, provider="smi")]
    [reading] = smi.metrics()
    assert (reading.uuid, reading.memory_used_bytes, reading.temperature_c, reading.ecc_uncorrected) == (
        UUID, 0, 42.0, 0
    )  # fmt: skip
    assert metrics_from_csv(parse_query_csv(CSV.read_text())) == [reading]


def test_nvml_keeps_the_drivers_reservation_out_of_used_memory_as_nvidia_smi_does() -> None:
    nvml = NvmlProvider(standin_from_xml(XML, {UUID: "9.0"}, driver="580.159.04", cuda=13000))
    assert nvml.devices() == [H100]
    [reading] = nvml.metrics()
    assert reading.memory_used_bytes == 0  # the v2 call: reserved apart
    old = NvmlProvider(standin_from_xml(XML, {UUID: "9.0"}, driver="580.159.04", cuda=13000, memory_v2=False))
    assert old.devices() == [H100]  # a driver without the v2 call still answers, with the first
    assert old.metrics()[0].memory_used_bytes == RESERVED  # what the real first call said: 503,316,480 bytes
