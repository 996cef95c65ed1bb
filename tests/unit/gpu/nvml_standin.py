"""A stand-in for the `pynvml` module, built from real nvidia-smi captures, for tests and the bench.

It uses the real `pynvml` error classes and constants, and answers like NVML does: a reading the capture
shows as N/A raises `NVMLError_NotSupported`, a lost GPU raises `NVMLError_GPUIsLost`, an empty MIG slot
raises `NVMLError_NotFound`, and the Xid event set times out when nothing is pending.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml

from turnout.gpu.devices import GpuDevice, GpuMetrics
from turnout.gpu.smi import devices_from_xml, metrics_from_xml, number


@dataclass(frozen=True)
class Handle:
    gpu: int
    mig: int | None = None


class StandInNvml:
    NVMLError = pynvml.NVMLError

    def __init__(self, devices: list[GpuDevice], readings: list[GpuMetrics], *, init_error: int | None = None,
                 driver: str = "535.54.03", cuda: int = 12020, reserved: dict[str, int] | None = None,
                 memory_v2: bool = True) -> None:  # fmt: skip
        self._devices = devices
        self._reserved = reserved or {}  # what the driver keeps for itself, by GPU UUID
        self.memory_v2 = memory_v2  # False: a driver older than R510, which has no nvmlDeviceGetMemoryInfo_v2
        self._readings = {m.uuid: m for m in readings}
        self._init_error = init_error
        self._driver, self._cuda = driver, cuda
        self.lost: set[int] = set()
        self.pending_xids: deque[tuple[int, int]] = deque()
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("NVML_", "nvmlEventType", "nvmlMemory_v")):
            return getattr(pynvml, name)  # the real constants
        raise AttributeError(name)

    @staticmethod
    def _fail(code: int) -> Any:
        raise pynvml.NVMLError(code)

    def _answer(self, value: Any) -> Any:
        self.calls += 1
        return self._fail(pynvml.NVML_ERROR_NOT_SUPPORTED) if value is None else value

    def _gpu(self, handle: Handle) -> GpuDevice:
        if handle.gpu in self.lost:
            self._fail(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self._devices[handle.gpu]

    # -- system --
    def nvmlInit(self) -> None:
        if self._init_error is not None:
            self._fail(self._init_error)

    def nvmlShutdown(self) -> None: ...

    def nvmlSystemGetDriverVersion(self) -> str:
        return self._driver

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self._cuda

    def nvmlDeviceGetCount(self) -> int:
        return len(self._devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Handle:
        return (
            Handle(index)
            if 0 <= index < len(self._devices)
            else self._fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        )

    # -- static facts --
    def nvmlDeviceGetName(self, h: Handle) -> str:
        dev = self._gpu(h)
        return dev.name if h.mig is None else f"{dev.name} MIG {dev.mig_devices[h.mig].profile}"

    def nvmlDeviceGetUUID(self, h: Handle) -> str:
        dev = self._gpu(h)
        return dev.uuid if h.mig is None else dev.mig_devices[h.mig].uuid

    def nvmlDeviceGetMemoryInfo(self, h: Handle, version: int | None = None) -> SimpleNamespace:
        """As NVML answers: the first call counts the driver's reservation as used, v2 keeps it apart."""
        dev = self._gpu(h)
        if version is not None and not self.memory_v2:
            self._fail(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if h.mig is not None:
            total = dev.mig_devices[h.mig].memory_total_bytes
            return SimpleNamespace(total=total, free=total, used=0, reserved=0)
        used = self._readings[dev.uuid].memory_used_bytes or 0
        reserved = self._reserved.get(dev.uuid, 0)
        if version is None:
            used += reserved
        return self._answer(
            SimpleNamespace(
                total=dev.memory_total_bytes, free=dev.memory_free_bytes, used=used, reserved=reserved
            )
        )

    def nvmlDeviceGetCudaComputeCapability(self, h: Handle) -> tuple[int, int]:
        cc = self._gpu(h).compute_capability
        return self._answer(tuple(int(p) for p in cc.split(".")) if cc else None)

    def nvmlDeviceGetPciInfo(self, h: Handle) -> SimpleNamespace:
        bus = self._gpu(h).pci_bus_id
        return self._answer(SimpleNamespace(busId=bus.encode()) if bus else None)  # bytes, as older pynvml

    def nvmlDeviceGetMinorNumber(self, h: Handle) -> int:
        return self._answer(self._gpu(h).minor)

    def nvmlDeviceGetMigMode(self, h: Handle) -> tuple[int, int]:
        return (1, 1) if self._gpu(h).mig_mode else self._fail(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetMaxMigDeviceCount(self, h: Handle) -> int:
        return 7 if self._gpu(h).mig_mode else self._fail(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: Handle, index: int) -> Handle:
        migs = self._gpu(h).mig_devices
        return Handle(h.gpu, index) if index < len(migs) else self._fail(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetGpuInstanceId(self, h: Handle) -> int:
        return self._answer(self._gpu(h).mig_devices[h.mig or 0].gpu_instance_id)

    def nvmlDeviceGetComputeInstanceId(self, h: Handle) -> int:
        return self._answer(self._gpu(h).mig_devices[h.mig or 0].compute_instance_id)

    # -- readings --
    def _reading(self, h: Handle) -> GpuMetrics:
        return self._readings[self._gpu(h).uuid]

    def nvmlDeviceGetUtilizationRates(self, h: Handle) -> SimpleNamespace:
        util = self._reading(h).utilization_pct
        return self._answer(None if util is None else SimpleNamespace(gpu=int(util), memory=0))

    def nvmlDeviceGetTemperature(self, h: Handle, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        temp = self._reading(h).temperature_c
        return self._answer(None if temp is None else int(temp))

    def nvmlDeviceGetPowerUsage(self, h: Handle) -> int:
        power = self._reading(h).power_w
        return self._answer(None if power is None else int(power * 1000))

    def nvmlDeviceGetTotalEccErrors(self, h: Handle, error_type: int, counter_type: int) -> int:
        assert (error_type, counter_type) == (
            pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            pynvml.NVML_VOLATILE_ECC,
        )
        return self._answer(self._reading(h).ecc_uncorrected)

    def nvmlDeviceGetComputeRunningProcesses(self, h: Handle) -> list[SimpleNamespace]:
        procs = self._reading(h).processes
        return self._answer([SimpleNamespace(pid=p.pid, usedGpuMemory=p.used_memory_bytes) for p in procs])

    # -- Xid events --
    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlDeviceRegisterEvents(self, h: Handle, types: int, event_set: object) -> None:
        assert types & pynvml.nvmlEventTypeXidCriticalError

    def nvmlEventSetWait_v2(self, event_set: object, timeout_ms: int) -> SimpleNamespace:
        if not self.pending_xids:
            self._fail(pynvml.NVML_ERROR_TIMEOUT)
        gpu, code = self.pending_xids.popleft()
        return SimpleNamespace(
            device=Handle(gpu), eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=code
        )

    def nvmlEventSetFree(self, event_set: object) -> None: ...


def standin_from_xml(path: Path, caps: dict[str, str] | None = None, **options: Any) -> StandInNvml:
    """A stand-in answering what the `nvidia-smi -q -x` capture at `path` shows (`caps`: compute capability
    by UUID, which that capture does not carry)."""
    text = path.read_text()
    devices = devices_from_xml(text, caps=caps)
    reserved = {}
    for dev, gpu in zip(devices, ET.fromstring(text).iter("gpu"), strict=True):
        if (mib := number(gpu.findtext("fb_memory_usage/reserved"))) is not None:
            reserved[dev.uuid] = int(mib) * 1024**2
    return StandInNvml(devices, metrics_from_xml(text), reserved=reserved, **options)
