"""What Turnout knows about GPUs: static facts from discovery, live metrics, and allocatable units.

Discovery fills `GpuDevice` (once) and `GpuMetrics` (each heartbeat). Allocation never looks at devices
directly: it works on `GpuUnit`s, the things that can be handed out: a whole GPU, or one MIG device of a
GPU in MIG mode (whose parent is then never a unit itself).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class MigDevice:
    """One MIG device (a GPU instance + compute instance) inside a GPU in MIG mode."""

    uuid: str
    profile: str  # e.g. "3g.20gb"
    memory_total_bytes: int
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    index: int = 0  # position among its parent's MIG devices


@dataclass(frozen=True)
class GpuDevice:
    """Static facts about one physical GPU, as discovery reports them (None where a provider cannot tell)."""

    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    memory_free_bytes: int | None = None
    compute_capability: str | None = None  # "8.0"
    pci_bus_id: str | None = None
    minor: int | None = None
    driver_version: str | None = None
    cuda_version: str | None = None
    mig_mode: bool = False
    mig_devices: tuple[MigDevice, ...] = ()
    provider: str = ""  # which provider found it: nvml, smi, procfs, fake

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_memory_bytes: int


@dataclass(frozen=True)
class GpuMetrics:
    """Live readings for one GPU, sampled on each heartbeat."""

    uuid: str
    utilization_pct: float | None = None
    memory_used_bytes: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    ecc_uncorrected: int | None = None
    processes: tuple[GpuProcess, ...] = ()
    health: str = "ok"  # "ok", or a short reason the device is unhealthy
    xid_errors: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GpuUnit:
    """One allocatable unit: a whole GPU, or a MIG device (`parent_uuid` set)."""

    uuid: str
    index: int  # the physical GPU's index
    model: str
    memory_bytes: int
    compute_capability: str | None = None
    parent_uuid: str | None = None
    mig_profile: str | None = None
    healthy: bool = True
    temperature_c: float | None = None

    @property
    def is_mig(self) -> bool:
        return self.parent_uuid is not None


@dataclass(frozen=True)
class UnitUsage:
    """What is allocated on one unit right now."""

    memory_bytes: int = 0
    exclusive: bool = False
    tasks: int = 0
    workloads: frozenset[str] = field(default_factory=frozenset)
    tenants: frozenset[str] = field(default_factory=frozenset)  # whose tasks hold it


def units_of(devices: list[GpuDevice], unhealthy: frozenset[str] = frozenset()) -> list[GpuUnit]:
    """The allocatable units of a host: each non-MIG GPU whole, and each MIG device of a MIG-mode GPU."""
    units: list[GpuUnit] = []
    for dev in devices:
        healthy = dev.uuid not in unhealthy
        if dev.mig_mode:
            for mig in dev.mig_devices:
                units.append(
                    GpuUnit(mig.uuid, dev.index, dev.name, mig.memory_total_bytes, dev.compute_capability,
                            parent_uuid=dev.uuid, mig_profile=mig.profile, healthy=healthy and mig.uuid not in unhealthy)
                )  # fmt: skip
        else:
            units.append(GpuUnit(dev.uuid, dev.index, dev.name, dev.memory_total_bytes, dev.compute_capability,
                                 healthy=healthy))  # fmt: skip
    return units
