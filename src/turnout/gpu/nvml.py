"""Discovery through NVML (`pynvml` from the `nvidia-ml-py` package): the first and cheapest provider.

The NVML module is injectable (`NvmlProvider(nvml=stand_in)`), so every path here is tested without a GPU;
by default `pynvml` is imported on construction, never at module import. Queries a device cannot answer
(`NVMLError_NotSupported` on consumer cards, Windows WDDM, MIG children) become None; a device that answers
`NVMLError_GPUIsLost` has fallen off the bus, and any other error on it means it is not answering. Xid errors
come from an NVML event set registered for critical Xids and drained without waiting on each sample.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any, TypeVar

from turnout.gpu.devices import GpuDevice, GpuMetrics, GpuProcess, MigDevice
from turnout.gpu.health import FELL_OFF_BUS, NOT_ANSWERING
from turnout.gpu.provider import ProviderError

T = TypeVar("T")
_MIG_PROFILE = re.compile(r"MIG\s+(\S+)\s*$")
_MAX_EVENTS_PER_SAMPLE = 64
# what a driver without nvmlDeviceGetMemoryInfo_v2 answers it: the first call is asked instead
_NO_MEMORY_V2 = (
    "NVML_ERROR_NOT_SUPPORTED",
    "NVML_ERROR_FUNCTION_NOT_FOUND",
    "NVML_ERROR_ARGUMENT_VERSION_MISMATCH",
)


def _text(raw: Any) -> str:
    """pynvml returns bytes in older releases and str in newer ones."""
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)


class NvmlProvider:
    """GpuProvider over NVML. Construction initialises NVML and raises ProviderError if it cannot."""

    name = "nvml"

    def __init__(self, nvml: Any = None) -> None:
        if nvml is None:
            try:
                nvml = importlib.import_module("pynvml")
            except ImportError:
                raise ProviderError("nvidia-ml-py (pynvml) is not installed", absent=True) from None
        self._nvml = nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            absent = getattr(exc, "value", None) in (
                nvml.NVML_ERROR_LIBRARY_NOT_FOUND, nvml.NVML_ERROR_DRIVER_NOT_LOADED,
            )  # fmt: skip
            raise ProviderError(f"NVML init failed: {exc}", absent=absent) from None
        self._handles: dict[str, Any] = {}
        self._events: Any = None

    def _maybe(self, call: Callable[..., T], *args: Any) -> T | None:
        """A query the device may not support: None instead of NVMLError."""
        try:
            return call(*args)
        except self._nvml.NVMLError:
            return None

    # -- devices ------------------------------------------------------------------------------------------------

    def devices(self) -> list[GpuDevice]:
        nv = self._nvml
        try:
            count = nv.nvmlDeviceGetCount()
            driver = self._maybe(nv.nvmlSystemGetDriverVersion)
            cuda_int = self._maybe(nv.nvmlSystemGetCudaDriverVersion)
            cuda = f"{cuda_int // 1000}.{cuda_int % 1000 // 10}" if cuda_int else None
            handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            devices = [self._device(i, handle, driver, cuda) for i, handle in enumerate(handles)]
        except nv.NVMLError as exc:
            raise ProviderError(f"NVML device query failed: {exc}") from None
        self._handles = {dev.uuid: handle for dev, handle in zip(devices, handles, strict=True)}
        self._events = self._register_xid_events()
        return devices

    def _memory(self, handle: Any) -> Any:
        """The device's memory, `used` without what the driver reserves (as nvidia-smi counts it).

        NVML's first memory call counts the driver's reservation as used: an idle H100 80GB reads 480 MiB used
        there and 0 in nvidia-smi, so the same GPU read differently with each provider. The v2 call (R510+)
        keeps the reservation apart; drivers and pynvml releases without it answer with the first.
        """
        nv = self._nvml
        version = getattr(nv, "nvmlMemory_v2", None)
        if version is not None:
            try:
                return nv.nvmlDeviceGetMemoryInfo(handle, version=version)
            except TypeError:  # a pynvml whose call takes no version
                pass
            except nv.NVMLError as exc:
                if getattr(exc, "value", None) not in {getattr(nv, name, None) for name in _NO_MEMORY_V2}:
                    raise
        return nv.nvmlDeviceGetMemoryInfo(handle)

    def _device(self, index: int, handle: Any, driver: str | None, cuda: str | None) -> GpuDevice:
        nv = self._nvml
        memory = self._memory(handle)
        cc = self._maybe(nv.nvmlDeviceGetCudaComputeCapability, handle)
        pci = self._maybe(nv.nvmlDeviceGetPciInfo, handle)
        mode = self._maybe(nv.nvmlDeviceGetMigMode, handle)
        mig_mode = mode is not None and mode[0] == nv.NVML_DEVICE_MIG_ENABLE
        return GpuDevice(
            index=index, uuid=_text(nv.nvmlDeviceGetUUID(handle)), name=_text(nv.nvmlDeviceGetName(handle)),
            memory_total_bytes=int(memory.total), memory_free_bytes=int(memory.free),
            compute_capability=f"{cc[0]}.{cc[1]}" if cc else None,
            pci_bus_id=_text(pci.busId) if pci is not None else None,
            minor=self._maybe(nv.nvmlDeviceGetMinorNumber, handle), driver_version=_text(driver) if driver else None,
            cuda_version=cuda, mig_mode=mig_mode, mig_devices=self._migs(handle) if mig_mode else (), provider="nvml",
        )  # fmt: skip

    def _migs(self, handle: Any) -> tuple[MigDevice, ...]:
        nv = self._nvml
        migs: list[MigDevice] = []
        for slot in range(self._maybe(nv.nvmlDeviceGetMaxMigDeviceCount, handle) or 0):
            mig = self._maybe(nv.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot)
            if mig is None:
                continue  # an empty slot answers NVMLError_NotFound
            total = int(nv.nvmlDeviceGetMemoryInfo(mig).total)
            profile = _MIG_PROFILE.search(_text(self._maybe(nv.nvmlDeviceGetName, mig) or ""))
            migs.append(MigDevice(
                uuid=_text(nv.nvmlDeviceGetUUID(mig)),
                profile=profile.group(1) if profile else f"{round(total / 1024**3)}gb",
                memory_total_bytes=total, gpu_instance_id=self._maybe(nv.nvmlDeviceGetGpuInstanceId, mig),
                compute_instance_id=self._maybe(nv.nvmlDeviceGetComputeInstanceId, mig), index=len(migs),
            ))  # fmt: skip
        return tuple(migs)

    # -- metrics ------------------------------------------------------------------------------------------------

    def canary(self, uuid: str) -> bool | None:
        return None  # a real device answers for itself: the canary runs a step on it

    def metrics(self) -> list[GpuMetrics]:
        if not self._handles:
            self.devices()
        xids = self._drain_xids()
        return [
            self._reading(uuid, handle, tuple(xids.get(uuid, ()))) for uuid, handle in self._handles.items()
        ]

    def _reading(self, uuid: str, handle: Any, xids: tuple[int, ...]) -> GpuMetrics:
        nv = self._nvml
        try:
            memory = self._memory(handle)
        except nv.NVMLError as exc:
            lost = getattr(exc, "value", None) == nv.NVML_ERROR_GPU_IS_LOST
            return GpuMetrics(
                uuid, health=FELL_OFF_BUS if lost else f"{NOT_ANSWERING}: {exc}", xid_errors=xids
            )
        util = self._maybe(nv.nvmlDeviceGetUtilizationRates, handle)
        power_mw = self._maybe(nv.nvmlDeviceGetPowerUsage, handle)
        temp = self._maybe(nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU)
        ecc = self._maybe(
            nv.nvmlDeviceGetTotalEccErrors,
            handle,
            nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            nv.NVML_VOLATILE_ECC,
        )
        procs = self._maybe(nv.nvmlDeviceGetComputeRunningProcesses, handle) or []
        return GpuMetrics(
            uuid,
            utilization_pct=float(util.gpu) if util is not None else None,
            memory_used_bytes=int(memory.used),
            temperature_c=float(temp) if temp is not None else None,
            power_w=power_mw / 1000.0 if power_mw is not None else None,
            ecc_uncorrected=int(ecc) if ecc is not None else None,
            # usedGpuMemory is None where the driver cannot attribute memory (WDDM, some MIG setups).
            processes=tuple(GpuProcess(int(p.pid), int(p.usedGpuMemory or 0)) for p in procs),
            xid_errors=xids,
        )

    # -- Xid events ----------------------------------------------------------------------------------------------

    def _register_xid_events(self) -> Any:
        """An event set for critical Xids on every device, or None where NVML offers none (MIG, Windows)."""
        nv = self._nvml
        events = self._maybe(nv.nvmlEventSetCreate)
        if events is None:
            return None
        for handle in self._handles.values():
            self._maybe(nv.nvmlDeviceRegisterEvents, handle, nv.nvmlEventTypeXidCriticalError, events)
        return events

    def _drain_xids(self) -> dict[str, list[int]]:
        """Xid events since the last sample, by device UUID; never blocks (timeout 0)."""
        nv = self._nvml
        found: dict[str, list[int]] = {}
        if self._events is None:
            return found
        for _ in range(_MAX_EVENTS_PER_SAMPLE):
            try:
                event = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError:
                break  # NVMLError_Timeout: nothing pending
            if event.eventType == nv.nvmlEventTypeXidCriticalError:
                uuid = _text(self._maybe(nv.nvmlDeviceGetUUID, event.device) or "")
                found.setdefault(uuid, []).append(int(event.eventData))
        return found

    def close(self) -> None:
        """Release NVML (and its event set); the provider cannot be used afterwards."""
        if self._events is not None:
            self._maybe(self._nvml.nvmlEventSetFree, self._events)
            self._events = None
        self._maybe(self._nvml.nvmlShutdown)
