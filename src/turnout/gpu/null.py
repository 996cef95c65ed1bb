"""The provider of a host without usable GPUs: what discovery falls back to, so callers never special-case None."""

from __future__ import annotations

from turnout.gpu.devices import GpuDevice, GpuMetrics


class NullProvider:
    """No GPUs, no metrics, never fails."""

    name = "none"

    def devices(self) -> list[GpuDevice]:
        return []

    def metrics(self) -> list[GpuMetrics]:
        return []

    def canary(self, uuid: str) -> bool | None:
        return None
