"""Last-resort discovery from the kernel driver's /proc files, when neither NVML nor nvidia-smi works.

`/proc/driver/nvidia/gpus/<bus>/information` gives model, UUID, bus location and device minor;
`/proc/driver/nvidia/version` gives the driver version. Keys and values are separated by tabs in real
kernel output and by spaces where someone copied from a terminal; both parse. There is no memory size and no
live reading here: memory comes from the model name ("...-16GB") or a short table of common models, else 0,
and metrics only tell whether each device is still present. Excluded GPUs (`GPU Excluded: Yes`) are skipped.
"""

from __future__ import annotations

import re
from pathlib import Path

from turnout.gpu.devices import GpuDevice, GpuMetrics
from turnout.gpu.health import HEALTH_OK, NOT_ANSWERING
from turnout.gpu.provider import ProviderError

_GIB = 1024**3
_LINE = re.compile(r"^([A-Za-z][A-Za-z ]*?):\s*(.*?)\s*$")
_UUID = re.compile(r"^GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
_BUS = re.compile(r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
_VERSION = re.compile(r"^NVRM version:.*?\s(\d+\.\d+(?:\.\d+)?)\s", re.MULTILINE)
_NAME_GB = re.compile(r"(\d+)\s*GB", re.IGNORECASE)
# Memory of models whose name does not say it (the most common in servers and workstations).
_MODEL_GIB = {"A10G": 24, "A10": 24, "L4": 24, "L40S": 48, "L40": 48, "T4": 16, "A30": 24, "A40": 48,
              "RTX 4090": 24, "RTX 3090": 24, "RTX 3080": 10, "RTX 3060": 12, "RTX A6000": 48, "H200": 141}  # fmt: skip
REQUIRED = ("Model", "GPU UUID", "Bus Location", "Device Minor")


def parse_information(text: str) -> dict[str, str]:
    """`Key: <tabs or spaces> value` lines -> dict; raises ProviderError when a required key is missing."""
    fields = {
        m.group(1).strip(): m.group(2) for line in text.splitlines() if (m := _LINE.match(line.strip()))
    }
    missing = [key for key in REQUIRED if not fields.get(key)]
    if missing:
        raise ProviderError(f"/proc GPU information lacks {', '.join(missing)} (truncated or unknown format)")
    if not _UUID.match(fields["GPU UUID"]) or not _BUS.match(fields["Bus Location"]):
        raise ProviderError(f"/proc GPU information: bad UUID or bus location {fields['GPU UUID']!r}")
    if not fields["Device Minor"].isdigit():
        raise ProviderError(f"/proc GPU information: bad device minor {fields['Device Minor']!r}")
    return fields


def parse_version(text: str) -> str:
    """The driver version from /proc/driver/nvidia/version (proprietary or open kernel module wording)."""
    match = _VERSION.search(text)
    if not match:
        raise ProviderError("/proc/driver/nvidia/version: no NVRM version line (truncated or unknown format)")
    return match.group(1)


def memory_from_name(name: str) -> int:
    """Best guess of a GPU's memory from its name; 0 when unknown."""
    match = _NAME_GB.search(name)
    if match:
        return int(match.group(1)) * _GIB
    upper = name.upper()
    # Longest key first, so "L40S" wins over "L4" and "RTX 3090" over nothing shorter.
    for key in sorted(_MODEL_GIB, key=len, reverse=True):
        if re.search(rf"(?<![A-Z0-9]){re.escape(key)}(?![A-Z0-9])", upper):
            return _MODEL_GIB[key] * _GIB
    return 0


def device_from_information(index: int, fields: dict[str, str], driver_version: str | None) -> GpuDevice:
    return GpuDevice(
        index=index, uuid=fields["GPU UUID"], name=fields["Model"], memory_total_bytes=memory_from_name(fields["Model"]),
        pci_bus_id=_nvml_bus_id(fields["Bus Location"]), minor=int(fields["Device Minor"]),
        driver_version=driver_version, provider="procfs",
    )  # fmt: skip


def _nvml_bus_id(location: str) -> str:
    """`0000:01:00.0` -> `00000000:01:00.0`, the form NVML and nvidia-smi print, so ids compare across providers."""
    domain, rest = location.split(":", 1)
    return f"{int(domain, 16):08X}:{rest.upper()}"


class ProcfsProvider:
    """GpuProvider over /proc/driver/nvidia; `root` is injectable so tests point it at a fixture tree."""

    name = "procfs"

    def __init__(self, root: Path = Path("/")) -> None:
        self._base = Path(root) / "proc" / "driver" / "nvidia"
        self._files: dict[str, Path] = {}

    def devices(self) -> list[GpuDevice]:
        gpus_dir = self._base / "gpus"
        if not gpus_dir.is_dir():
            raise ProviderError(f"{gpus_dir} not found (no NVIDIA kernel driver)", absent=True)
        version_file = self._base / "version"
        driver = parse_version(_read(version_file)) if version_file.exists() else None
        found = []
        for info in sorted(gpus_dir.glob("*/information")):
            fields = parse_information(_read(info))
            if fields.get("GPU Excluded", "No").lower() != "yes":
                found.append((_nvml_bus_id(fields["Bus Location"]), fields, info))
        found.sort(key=lambda item: item[0])  # NVML numbers GPUs in PCI bus order
        devices = [device_from_information(i, fields, driver) for i, (_, fields, _) in enumerate(found)]
        self._files = {dev.uuid: info for dev, (_, _, info) in zip(devices, found, strict=True)}
        return devices

    def canary(self, uuid: str) -> bool | None:
        return None  # a real device answers for itself: the canary runs a step on it

    def metrics(self) -> list[GpuMetrics]:
        """No readings in /proc: only whether each device's entry is still there."""
        return [
            GpuMetrics(uuid, health=HEALTH_OK if path.exists() else NOT_ANSWERING)
            for uuid, path in self._files.items()
        ]


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError as exc:
        raise ProviderError(f"cannot read {path}: {exc}") from None
