"""/proc/driver/nvidia parsers on every real sample, and the provider over a fixture tree."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from nvidia_paths import NVIDIA_FIXTURES, cut_mid_line, nvidia_samples

from turnout.gpu.health import NOT_ANSWERING
from turnout.gpu.procfs import ProcfsProvider, memory_from_name, parse_information, parse_version
from turnout.gpu.provider import ProviderError, discover

GIB = 1024**3
INFORMATION = nvidia_samples("proc", "*information*")
VERSIONS = nvidia_samples("proc", "version-*")
pytestmark = pytest.mark.usefixtures("nvidia_fixtures")

INFO_FACTS = {
    "gpus-0000-01-00.0-information-rtx-3090-590.48.01.txt": (
        "NVIDIA GeForce RTX 3090", "GPU-eaf23aa1-4d3d-596c-da66-b86b0e5db584", "0000:01:00.0", "0"),
    "gpus-0000-00-1e.0-information-a10g.txt": (
        "NVIDIA A10G", "GPU-82523fd8-3897-f599-d088-ccd04ae45ec1", "0000:00:1e.0", "3"),
    "gpus-0000-06-00.0-information-tesla-v100-sxm2-16gb-tabs-expanded.txt": (
        "Tesla V100-SXM2-16GB", "GPU-edfee158-11c1-52b8-0517-92f30e7fac88", "0000:06:00.0", "0"),
}  # fmt: skip
VERSION_FACTS = {
    "version-proprietary-525.105.17.txt": "525.105.17",
    "version-open-kernel-module-515.43.04.txt": "515.43.04",
}


@pytest.mark.parametrize("sample", INFORMATION, ids=lambda p: p.name)
def test_every_information_file_parses_tabs_or_spaces(sample: Path) -> None:
    fields = parse_information(sample.read_text())
    assert fields["GPU UUID"].startswith("GPU-") and fields["GPU Excluded"] == "No"
    if sample.name in INFO_FACTS:
        assert (
            fields["Model"],
            fields["GPU UUID"],
            fields["Bus Location"],
            fields["Device Minor"],
        ) == INFO_FACTS[sample.name]


@pytest.mark.parametrize("sample", VERSIONS, ids=lambda p: p.name)
def test_every_version_file_gives_the_driver_version(sample: Path) -> None:
    version = parse_version(sample.read_text())
    assert version.count(".") >= 1
    if sample.name in VERSION_FACTS:
        assert version == VERSION_FACTS[sample.name]


@pytest.mark.parametrize("sample", INFORMATION + VERSIONS, ids=lambda p: p.name)
def test_truncated_proc_files_are_provider_errors(sample: Path) -> None:
    parse = parse_version if sample.name.startswith("version") else parse_information
    with pytest.raises(ProviderError):
        parse(cut_mid_line(sample.read_text()))


def test_memory_comes_from_the_name_or_a_known_model() -> None:
    assert memory_from_name("Tesla V100-SXM2-16GB") == 16 * GIB
    assert memory_from_name("NVIDIA A10G") == 24 * GIB
    assert memory_from_name("NVIDIA L40S") == 48 * GIB and memory_from_name("NVIDIA L4") == 24 * GIB
    assert memory_from_name("NVIDIA Future 9000") == 0


def _tree(root: Path, samples: dict[str, str], version: str | None) -> Path:
    gpus = root / "proc" / "driver" / "nvidia" / "gpus"
    for bus, sample in samples.items():
        (gpus / bus).mkdir(parents=True)
        shutil.copy(NVIDIA_FIXTURES / "proc" / sample, gpus / bus / "information")
    if version:
        shutil.copy(NVIDIA_FIXTURES / "proc" / version, root / "proc" / "driver" / "nvidia" / "version")
    return root


def test_provider_numbers_gpus_in_bus_order_and_notices_a_vanished_one(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "0000:06:00.0": "gpus-0000-06-00.0-information-tesla-v100-sxm2-16gb-tabs-expanded.txt",
        "0000:00:1e.0": "gpus-0000-00-1e.0-information-a10g.txt",
    }, "version-proprietary-525.105.17.txt")  # fmt: skip
    provider = ProcfsProvider(root)
    devices = provider.devices()
    assert [(d.index, d.name, d.pci_bus_id, d.minor) for d in devices] == [
        (0, "NVIDIA A10G", "00000000:00:1E.0", 3),
        (1, "Tesla V100-SXM2-16GB", "00000000:06:00.0", 0),
    ]
    assert {d.driver_version for d in devices} == {"525.105.17"} and devices[1].memory_total_bytes == 16 * GIB
    assert [m.health for m in provider.metrics()] == ["ok", "ok"]
    shutil.rmtree(root / "proc" / "driver" / "nvidia" / "gpus" / "0000:06:00.0")
    assert [m.health for m in provider.metrics()] == ["ok", NOT_ANSWERING]


def test_excluded_gpus_are_skipped(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"0000:00:1e.0": "gpus-0000-00-1e.0-information-a10g.txt"}, None)
    info = root / "proc" / "driver" / "nvidia" / "gpus" / "0000:00:1e.0" / "information"
    info.write_text(info.read_text().replace("No", "Yes"))
    assert ProcfsProvider(root).devices() == []


def test_no_driver_means_absent_and_discovery_moves_on(tmp_path: Path) -> None:
    with pytest.raises(ProviderError) as err:
        ProcfsProvider(tmp_path).devices()
    assert err.value.absent
    found = discover("auto", probes=[("procfs", lambda: ProcfsProvider(tmp_path))])
    assert found.provider.name == "none" and found.tried[0][0] == "procfs"
