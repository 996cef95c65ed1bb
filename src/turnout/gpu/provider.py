"""GPU discovery behind one Protocol, and the `--gpus` spec that picks a provider.

A provider answers two questions: which GPUs are here (`devices`, asked once) and how they are doing now
(`metrics`, asked on each heartbeat). Providers, first that works wins, for `--gpus auto`:

    nvml    libnvidia-ml through `nvidia-ml-py`          (gpu/nvml.py)
    smi     `nvidia-smi -q -x`                           (gpu/smi.py)
    procfs  /proc/driver/nvidia/gpus/*/information       (gpu/procfs.py; static facts only, no metrics)
    none    no GPUs                                      (gpu/null.py)

`fake:SPEC` (gpu/fake.py) stands in for GPUs on hosts without them. Discovery never raises for a broken
driver or tool: each failure is logged once with its reason and recorded in `Discovery.tried`, and the host
ends up, at worst, with no GPUs. Only a spec the user got wrong raises (`InvalidInput`, field `gpus`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol, runtime_checkable

from turnout.errors import InvalidInput
from turnout.gpu.devices import GpuDevice, GpuMetrics

_LOG = logging.getLogger("turnout.gpu")
_INDICES = re.compile(r"^\s*\d+\s*(,\s*\d+\s*)*$")


class ProviderError(Exception):
    """A provider cannot answer: library or tool missing, init failed, output truncated or malformed.

    `absent` is True when the provider simply is not there (no binary, no library, no /proc entry), which is
    normal on a CPU-only host and logged quietly; anything else is a real fault worth a warning.
    """

    def __init__(self, message: str, *, absent: bool = False) -> None:
        super().__init__(message)
        self.absent = absent


@runtime_checkable
class GpuProvider(Protocol):
    """Where GPU facts come from. `devices()` may be slow (called once); `metrics()` must be cheap."""

    name: str

    def devices(self) -> list[GpuDevice]: ...

    def metrics(self) -> list[GpuMetrics]: ...

    def canary(self, uuid: str) -> bool | None:
        """Whether a quarantined device works again, as only this provider can tell (a fake knows its injected
        faults); None: it cannot tell, and the canary runs a real step on the device (`health.run_canary`)."""
        ...


@dataclass(frozen=True)
class Discovery:
    """The provider that won, what it found, and (provider name, reason) for each one that did not work."""

    provider: GpuProvider
    devices: list[GpuDevice]
    tried: list[tuple[str, str]]


ProviderFactory = Callable[[], GpuProvider]


def default_probes() -> list[tuple[str, ProviderFactory]]:
    """The `auto` chain. Imports are deferred so a missing optional dependency is just a failed probe."""

    def nvml() -> GpuProvider:
        from turnout.gpu.nvml import NvmlProvider

        return NvmlProvider()

    def smi() -> GpuProvider:
        from turnout.gpu.smi import SmiProvider

        return SmiProvider()

    def procfs() -> GpuProvider:
        from turnout.gpu.procfs import ProcfsProvider

        return ProcfsProvider()

    return [("nvml", nvml), ("smi", smi), ("procfs", procfs)]


def discover(
    spec: str = "auto",
    *,
    log: logging.Logger = _LOG,
    probes: Sequence[tuple[str, ProviderFactory]] | None = None,
    fake_state_file: Path | None = None,
) -> Discovery:
    """Resolve a `--gpus` spec to a working provider and its devices.

    `spec`: `auto`, `none`, `0,2` (auto, then only these indices) or `fake:SPEC` (optionally
    `fake:SPEC@/path/state.json`, so a worker started from the command line can be driven by a test).
    `probes` replaces the auto chain (tests); `fake_state_file` is the fake provider's state file.
    """
    from turnout.gpu.null import NullProvider

    text = spec.strip() if isinstance(spec, str) else ""
    if not text:
        raise InvalidInput(
            "gpus: empty spec; use 'auto', 'none', indices like '0,2', or 'fake:2x80Gi'", field="gpus"
        )
    lowered = text.lower()
    if lowered == "none":
        return Discovery(NullProvider(), [], [])
    if lowered.startswith("fake:"):
        from turnout.gpu.fake import FakeGpuProvider

        body, _, state = text[len("fake:") :].partition("@")
        fake = FakeGpuProvider(body, state_file=Path(state) if state else fake_state_file)
        return Discovery(fake, fake.devices(), [])
    if lowered == "auto":
        return _auto(probes if probes is not None else default_probes(), log)
    if _INDICES.match(text):
        wanted = list(dict.fromkeys(int(part) for part in text.split(",")))
        return _subset(_auto(probes if probes is not None else default_probes(), log), wanted)
    raise InvalidInput(
        f"gpus: {spec!r} is not a GPU spec; use 'auto', 'none', indices like '0,2', or 'fake:2x80Gi'",
        field="gpus",
    )


def _auto(probes: Sequence[tuple[str, ProviderFactory]], log: logging.Logger) -> Discovery:
    """Try each probe in order; the first that builds and reports at least one GPU wins."""
    from turnout.gpu.null import NullProvider

    tried: list[tuple[str, str]] = []
    for name, factory in probes:
        try:
            provider = factory()
            devices = provider.devices()
        except ProviderError as exc:
            reason, quiet = str(exc) or type(exc).__name__, exc.absent
        except Exception as exc:  # a probe must never take the worker down: record it and move on
            reason, quiet = f"{type(exc).__name__}: {exc}", False
        else:
            if devices:
                return Discovery(provider, devices, tried)
            reason, quiet = "no GPUs found", True
        tried.append((name, reason))
        log.log(logging.INFO if quiet else logging.WARNING, "GPU discovery: %s unavailable: %s", name, reason)
    return Discovery(NullProvider(), [], tried)


def _subset(found: Discovery, wanted: list[int]) -> Discovery:
    """Keep only the GPUs with these indices; naming one that does not exist is the user's error."""
    by_index = {dev.index: dev for dev in found.devices}
    missing = [i for i in wanted if i not in by_index]
    if missing:
        have = ", ".join(str(i) for i in sorted(by_index)) or "none"
        raise InvalidInput(
            f"gpus: no GPU with index {', '.join(map(str, missing))} on this host (GPUs found: {have})",
            field="gpus",
        )
    devices = [by_index[i] for i in wanted]
    return replace(found, provider=SubsetProvider(found.provider, devices), devices=devices)


class SubsetProvider:
    """A provider restricted to some of its devices (for `--gpus 0,2`); indices stay the physical ones."""

    def __init__(self, inner: GpuProvider, devices: list[GpuDevice]) -> None:
        self.name = inner.name
        self.inner = inner  # the whole provider (tests reach a fake's fault API through it)
        self._uuids = {dev.uuid for dev in devices}

    def devices(self) -> list[GpuDevice]:
        return [dev for dev in self.inner.devices() if dev.uuid in self._uuids]

    def metrics(self) -> list[GpuMetrics]:
        return [m for m in self.inner.metrics() if m.uuid in self._uuids]

    def canary(self, uuid: str) -> bool | None:
        return self.inner.canary(uuid) if uuid in self._uuids else None
