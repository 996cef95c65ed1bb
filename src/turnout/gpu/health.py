"""GPU health: which faults take a device out of service, and when it may come back.

A device is quarantined when a sample shows a device fault: an Xid that means broken hardware or firmware
(not a faulty application), uncorrected ECC errors going up, the device lost from the bus, or the provider not
answering for it. It is re-admitted only after a canary check passes; failed canaries back off exponentially.
Everything here except `run_canary` is pure: time comes in as `now_s`, so tests advance a number, not a clock.

Feeding the tracker: call `update(provider.metrics(), now_s)` each heartbeat; if `metrics()` itself raises,
call `update([], now_s)`, which counts a missed sample for every known device.
"""

from __future__ import annotations

import enum
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from turnout.gpu.devices import GpuMetrics
from turnout.gpu.provider import GpuProvider

HEALTH_OK = "ok"
FELL_OFF_BUS = "fell off the bus"
NOT_ANSWERING = "not answering"


class XidKind(enum.Enum):
    DEVICE = "device"  # hardware, firmware or driver state: quarantine
    APPLICATION = "application"  # the application's own bug: the device is fine
    UNKNOWN = "unknown"


# NVIDIA's Xid catalogue (docs.nvidia.com/deploy/xid-errors): codes pointing at the device itself.
DEVICE_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement / row remapping event",
    64: "ECC page retirement / row remapper failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}
# Codes raised by a faulty program; the same set NVIDIA's k8s device plugin skips.
APPLICATION_XIDS: dict[int, str] = {
    13: "graphics engine exception",
    31: "GPU memory page fault (illegal address)",
    43: "GPU stopped processing (application stopped)",
    45: "preemptive cleanup after application stop",
    68: "video processor exception",
    109: "context switch timeout",
}


def classify_xid(code: int) -> XidKind:
    if code in DEVICE_XIDS:
        return XidKind.DEVICE
    if code in APPLICATION_XIDS:
        return XidKind.APPLICATION
    return XidKind.UNKNOWN


def is_device_fault(code: int, *, unknown_is_fault: bool = True) -> bool:
    """Whether an Xid should quarantine. Unknown codes do by default, as in NVIDIA's device plugin:
    a canary re-admits a device that is in fact fine, while a missed fault keeps failing tasks."""
    kind = classify_xid(code)
    return kind is XidKind.DEVICE or (unknown_is_fault and kind is XidKind.UNKNOWN)


def fault_reason(sample: GpuMetrics, ecc_baseline: int, *, unknown_is_fault: bool = True) -> str | None:
    """Why this sample should quarantine its device, or None. `ecc_baseline`: uncorrected ECC count already seen."""
    if sample.health != HEALTH_OK:
        return sample.health
    for code in sample.xid_errors:
        if is_device_fault(code, unknown_is_fault=unknown_is_fault):
            return f"xid {code}: {DEVICE_XIDS.get(code, 'unknown Xid')}"
    if sample.ecc_uncorrected is not None and sample.ecc_uncorrected > ecc_baseline:
        return f"uncorrected ECC errors rose to {sample.ecc_uncorrected}"
    return None


@dataclass(frozen=True)
class HealthChange:
    """A device left (`healthy=False`) or re-entered service, and why."""

    uuid: str
    healthy: bool
    reason: str
    at_s: float


@dataclass
class _Device:
    ecc_baseline: int = 0  # volatile uncorrected ECC count; a rise above it is a fault
    misses: int = 0
    reason: str | None = None  # set while quarantined
    canary_at_s: float = 0.0
    failed_canaries: int = 0
    strikes: int = 0  # quarantines since the device last stayed healthy for `stable_s`
    healthy_since_s: float = 0.0


class HealthTracker:
    """Per-UUID health across samples: quarantine on device faults, re-admit after a canary passes."""

    def __init__(
        self,
        uuids: Iterable[str] = (),
        *,
        missed_samples: int = 2,
        canary_backoff_s: float = 30.0,
        canary_backoff_max_s: float = 600.0,
        canary_timeout_s: float = 120.0,
        stable_s: float = 600.0,
        unknown_xid_is_fault: bool = True,
    ) -> None:
        self._devices: dict[str, _Device] = {uuid: _Device() for uuid in uuids}
        self.missed_samples = missed_samples
        self.canary_backoff_s = canary_backoff_s
        self.canary_backoff_max_s = canary_backoff_max_s
        self.canary_timeout_s = canary_timeout_s
        self.stable_s = stable_s
        self.unknown_xid_is_fault = unknown_xid_is_fault

    def update(self, metrics: Sequence[GpuMetrics], now_s: float) -> list[HealthChange]:
        """Take one sample of every device; devices absent from it count a miss."""
        changes: list[HealthChange] = []
        seen = set()
        for sample in metrics:
            seen.add(sample.uuid)
            dev = self._devices.setdefault(sample.uuid, _Device(healthy_since_s=now_s))
            dev.misses = 0
            reason = fault_reason(sample, dev.ecc_baseline, unknown_is_fault=self.unknown_xid_is_fault)
            if sample.ecc_uncorrected is not None:
                # Volatile counters reset on driver reload: follow them down as well as up.
                dev.ecc_baseline = sample.ecc_uncorrected
            if reason is not None:
                changes += self._quarantine(sample.uuid, dev, reason, now_s)
            elif dev.reason is None and now_s - dev.healthy_since_s >= self.stable_s:
                dev.strikes = 0
        for uuid, dev in self._devices.items():
            if uuid not in seen:
                dev.misses += 1
                if dev.misses >= self.missed_samples:
                    changes += self._quarantine(
                        uuid, dev, f"{NOT_ANSWERING} ({dev.misses} samples missed)", now_s
                    )
        return changes

    def quarantine(self, uuid: str, reason: str, now_s: float) -> list[HealthChange]:
        """Take a device out of service for a reason found outside the samples (a failed scrub)."""
        return self._quarantine(
            uuid, self._devices.setdefault(uuid, _Device(healthy_since_s=now_s)), reason, now_s
        )

    def quarantined(self) -> dict[str, str]:
        """UUID -> reason, for every device out of service."""
        return {uuid: dev.reason for uuid, dev in self._devices.items() if dev.reason is not None}

    def unhealthy(self) -> frozenset[str]:
        """The quarantined UUIDs, in the shape `units_of(devices, unhealthy=...)` takes."""
        return frozenset(self.quarantined())

    def canary_due(self, now_s: float) -> list[str]:
        """Claim the quarantined devices whose canary is due. A claimed canary that is never recorded
        becomes due again after `canary_timeout_s`, so calling this each heartbeat does not pile them up."""
        due = [u for u, d in self._devices.items() if d.reason is not None and d.canary_at_s <= now_s]
        for uuid in due:
            self._devices[uuid].canary_at_s = now_s + self.canary_timeout_s
        return due

    def record_canary(self, uuid: str, ok: bool, now_s: float) -> list[HealthChange]:
        """A passed canary re-admits the device; a failed one schedules the next with a longer wait."""
        dev = self._devices.get(uuid)
        if dev is None or dev.reason is None:
            return []
        if not ok:
            dev.failed_canaries += 1
            dev.canary_at_s = now_s + self._backoff_s(dev)
            return []
        dev.reason, dev.failed_canaries, dev.misses, dev.healthy_since_s = None, 0, 0, now_s
        return [HealthChange(uuid, True, "canary passed", now_s)]

    def _quarantine(self, uuid: str, dev: _Device, reason: str, now_s: float) -> list[HealthChange]:
        if dev.reason is not None:
            return []  # already out; the first reason stands
        dev.reason = reason
        dev.strikes += 1
        dev.canary_at_s = now_s + self._backoff_s(dev)
        return [HealthChange(uuid, False, reason, now_s)]

    def _backoff_s(self, dev: _Device) -> float:
        """Doubles with each failed canary and with each quarantine of a flapping device, up to the cap."""
        exponent = max(dev.strikes - 1, 0) + dev.failed_canaries
        return min(self.canary_backoff_s * 2.0 ** min(exponent, 30), self.canary_backoff_max_s)


_TORCH_CANARY = (
    "import torch\n"
    "a = torch.randn(256, 256, device='cuda')\n"
    "s = float((a @ a.T).sum())\n"
    "torch.cuda.synchronize()\n"
    "raise SystemExit(0 if s == s else 1)\n"
)


def run_canary(
    uuid: str,
    command: Sequence[str] | None = None,
    *,
    provider: GpuProvider | None = None,
    timeout_s: float = 60.0,
) -> bool:
    """Check whether a quarantined device works again. First that applies:

    a user `command` (exit 0 = pass) run with `CUDA_VISIBLE_DEVICES` set to the device; the provider's own
    answer (`GpuProvider.canary`: a fake knows its injected faults); a small torch matmul on the device, in a child process so this process never
    holds a CUDA context; else the provider's own reading of the device (answers, health ok, no device Xid).
    """
    if command:
        return _passes([*command], uuid, timeout_s)
    answer = provider.canary(uuid) if provider is not None else None
    if answer is not None:
        return answer
    if importlib.util.find_spec("torch") is not None:
        return _passes([sys.executable, "-c", _TORCH_CANARY], uuid, timeout_s)
    if provider is None:
        return False
    try:
        sample = next((m for m in provider.metrics() if m.uuid == uuid), None)
    except Exception:  # a provider that cannot answer has not recovered
        return False
    return sample is not None and fault_reason(sample, sample.ecc_uncorrected or 0) is None


def _passes(argv: list[str], uuid: str, timeout_s: float) -> bool:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": uuid, "NVIDIA_VISIBLE_DEVICES": uuid}
    try:
        done = subprocess.run(argv, env=env, timeout=timeout_s, capture_output=True, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0
