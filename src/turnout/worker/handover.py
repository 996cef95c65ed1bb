"""Handing a GPU from one tenant to another: what the last tenant left on it goes before the next one's task starts.

A warm process started on the GPU holds its tenant's memory, so it is closed; with a scrub command the GPU's
memory is wiped too, and each scrub is recorded (the audit of the hand-over) before the task starts. A GPU
whose scrub fails is quarantined and the task fails `gpu_scrub_failed`, so the controller sends it elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from turnout.worker.scrub import TenantLedger, run_scrub


class UnfitGpu(Exception):
    """A GPU of the task's grant is not fit for it (quarantined, or its scrub failed): the task must not start
    there, and goes to another GPU."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error["message"])
        self.error = error


class HandOver:
    """Makes a grant's GPUs fit for a tenant; one hand-over (and scrub) at a time per GPU unit."""

    def __init__(
        self,
        scrub_command: str | None,
        *,
        close_idle: Callable[[set[str]], Awaitable[None]],
        record: Callable[[dict[str, Any]], Awaitable[None]],
        quarantine: Callable[[str, str], None],
        quarantined: Callable[[], Mapping[str, str]] = dict,
    ) -> None:
        self.scrub_command = scrub_command  # None: only the idle processes are closed
        self.close_idle = close_idle  # closes warm idle processes started on any of these GPUs
        self.record = record  # delivers one scrub's record to the controller, returning once it is settled
        self.quarantine = quarantine  # (uuid, reason): the GPU takes no task until its canary passes
        self.quarantined = quarantined  # uuid -> why, of the GPUs quarantined now
        self.ledger = TenantLedger()  # which tenant last held each GPU unit here
        self._unit_locks: dict[str, asyncio.Lock] = {}

    async def __call__(self, task_id: str, grant: dict[str, Any], tenant: str) -> None:
        """Close other tenants' idle processes on the grant's GPUs, then scrub them; raises UnfitGpu (after
        quarantining the GPU) when a scrub fails, and at once when a GPU of the grant is quarantined (since the
        controller placed it: a task held waiting for its share, `slots.Slots.follow`)."""
        uuids = sorted(grant.get("uuids", []))
        if not uuids:
            return
        bad = self.quarantined()
        for uuid in uuids:
            if uuid in bad:
                raise UnfitGpu({"type": "gpu_quarantined",
                                "message": f"GPU {uuid} was quarantined before this task started there "
                                           f"({bad[uuid]}); the task goes to another GPU"})  # fmt: skip
        async with contextlib.AsyncExitStack() as held:
            for uuid in uuids:  # sorted: two tasks never wait on each other's locks
                await held.enter_async_context(self._unit_locks.setdefault(uuid, asyncio.Lock()))
            dirty = self.ledger.to_scrub(uuids, tenant)
            if not dirty:
                return
            await self.close_idle({uuid for uuid, _ in dirty})
            for uuid, previous in dirty:
                if self.scrub_command:
                    result = await run_scrub(self.scrub_command, uuid)
                    await self.record({"gpu": uuid, "task_id": task_id, "tenant": tenant,
                                       "previous_tenant": previous, "ok": result.ok,
                                       "seconds": round(result.seconds, 3), "message": result.message})  # fmt: skip
                    if not result.ok:
                        self.quarantine(uuid, f"GPU scrub failed: {result.message}")
                        raise UnfitGpu({"type": "gpu_scrub_failed",
                                        "message": f"GPU {uuid} could not be scrubbed before this task "
                                                   f"({result.message}); it is quarantined, and the task "
                                                   "goes to another GPU"})  # fmt: skip
                self.ledger.hand_over([uuid], tenant)
