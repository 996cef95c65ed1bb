"""Where a task goes: pure decisions on the `gpu` field, with the reason recorded on the task.

The controller asks two questions, both answered here without I/O:
- `route`: may this worker, which is asking for work now, take this task, and on which device class?
- `servable`: could any live worker ever serve this task? (if not for `placement_timeout_s`: no_capacity)

Facts about the worker and the cluster come in as small frozen records, so the rules read as a table
and are tested as one.
"""

from __future__ import annotations

from dataclasses import dataclass

from turnout.models import Device, GpuMode


@dataclass(frozen=True)
class WorkerOffer:
    """What the asking worker can do for one task right now."""

    cpu_variant: bool = False  # it serves the capability's CPU variant
    gpu_variant: bool = False  # it serves the GPU variant
    cpu_fits: bool = False  # ... and has the CPU and memory free for the CPU variant now
    gpu_fits: bool = False  # ... and the allocator found GPUs for the GPU variant now


@dataclass(frozen=True)
class ClusterView:
    """What the live, non-draining workers could serve for one task's capability, if they were idle."""

    gpu_possible: bool = False  # some healthy worker offers a GPU variant that fits its GPUs
    cpu_possible: bool = False  # some healthy worker offers a CPU variant that fits its CPU and memory


@dataclass(frozen=True)
class Route:
    device: Device
    reason: str


def _allows(mode: GpuMode, device: Device) -> bool:
    if mode is GpuMode.NEVER:
        return device is Device.CPU
    if mode is GpuMode.REQUIRE:
        return device is Device.GPU
    return True


def route(
    mode: GpuMode, waited_s: float, gpu_wait_s: float, offer: WorkerOffer, cluster: ClusterView
) -> Route | None:
    """The device this worker should run the task on now, or None to leave it for another worker or later.

    `prefer` (and `auto`, until run-time estimates exist) takes a GPU when one is free here; otherwise it
    falls back to the CPU variant only when no healthy GPU worker could ever take it, or when it has waited
    `gpu_wait_s` for one.
    """
    if mode is GpuMode.NEVER:
        return Route(Device.CPU, "gpu: never") if offer.cpu_fits else None
    if mode is GpuMode.REQUIRE:
        return Route(Device.GPU, "gpu: require") if offer.gpu_fits else None
    if offer.gpu_fits:
        return Route(Device.GPU, "gpu available")
    if not offer.cpu_fits:
        return None
    if not cluster.gpu_possible:
        return Route(Device.CPU, "no healthy gpu worker")
    if waited_s >= gpu_wait_s:
        return Route(Device.CPU, f"gpu queue wait {waited_s:.0f} s > gpu_wait_s {gpu_wait_s:g} s")
    return None


def servable(mode: GpuMode, cluster: ClusterView) -> bool:
    """Could a live worker ever run this task with a variant its `gpu` value allows?"""
    return (cluster.gpu_possible and _allows(mode, Device.GPU)) or (
        cluster.cpu_possible and _allows(mode, Device.CPU)
    )
