"""Batches as the controller leases them: tasks of one batched variant that ride on their leader's grant.

A variant with `max_batch_size` > 1 has its queued tasks leased together: the first one routed to it (the
leader) takes the variant's resources and GPUs as any task would; up to `max_batch_size - 1` more of the same
capability and the same tenant, routed to the same device class, ride on the leader's grant and take nothing
more (the worker runs them in one process, as one call). A batch never mixes tenants: one handler call sees
every input of its batch, and one warm process serves one tenant. A batch that is not full waits at most
`max_batch_wait_ms` from its leader's queueing before it is leased part full. Pure bookkeeping for one lease
request; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from turnout.gpu.allocation import GpuGrant
from turnout.models import Allocation, Device, Task, Variant


@dataclass
class OpenBatch:
    leader: Task
    device: Device
    variant: Variant
    grant: GpuGrant | None  # the leader's GPUs, which every rider uses
    gpu_share: float | None
    members: list[str] = field(default_factory=list)  # task ids, the leader first
    unit_memory_bytes: int | None = None  # the smallest granted unit's memory, as the leader was told

    @property
    def full(self) -> bool:
        return len(self.members) >= self.variant.max_batch_size

    def wait_left_s(self, now: float) -> float:
        """How much longer this batch may wait to fill; <= 0: lease it as it is."""
        if self.full:
            return 0.0
        waited = now - (self.leader.queued_at or self.leader.created_at)
        return self.variant.max_batch_wait_ms / 1000.0 - waited


class BatchBook:
    """The batches being filled during one lease request, by (tenant, capability)."""

    def __init__(self) -> None:
        self.open: dict[tuple[str, str], OpenBatch] = {}

    def has_room(self) -> bool:
        return any(not b.full for b in self.open.values())

    def joinable(self, task: Task) -> OpenBatch | None:
        """The batch this task may ride in: same tenant and capability, room left, and nothing of its own
        (resources or routing history) that would make it differ from its leader."""
        batch = self.open.get((task.tenant, task.spec.capability))
        if batch is None or batch.full or task.spec.resources is not None or task.routing:
            return None
        return batch if batch.leader.tenant == task.tenant else None

    def start(self, task: Task, device: Device, variant: Variant | None, grant: GpuGrant | None,
              gpu_share: float | None, unit_memory_bytes: int | None = None) -> OpenBatch | None:  # fmt: skip
        """Open a batch led by `task`, unless its variant does not batch or the task has resources of its own."""
        if variant is None or not leads_batch(task, variant):
            return None
        batch = OpenBatch(task, device, variant, grant, gpu_share, [task.id], unit_memory_bytes)
        self.open[(task.tenant, task.spec.capability)] = batch
        return batch

    def rider_alloc(self, batch: OpenBatch) -> Allocation:
        """A rider holds nothing of its own; it pays its leader's GPU share for its own seconds. The leader's
        attempt (once leased) names the batch's one GPU allocation in the audit log."""
        return Allocation(
            gpu_share=batch.gpu_share, batch=batch.leader.id, batch_attempt=batch.leader.attempts + 1
        )

    def waiting(self, now: float) -> list[OpenBatch]:
        """Batches still short of full whose wait is not over: not leased this time."""
        return [b for b in self.open.values() if b.wait_left_s(now) > 0]


def leads_batch(task: Task, variant: Variant) -> bool:
    """Whether `task`, placed on `variant`, opens a batch: the variant batches and the task asks nothing of its own."""
    return variant.max_batch_size > 1 and task.spec.resources is None
