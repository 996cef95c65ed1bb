"""The worker's own count of its cores: a job starts when the CPU it holds fits what is free here.

The controller leases within the room it computes, and with `--prefetch N` up to N tasks beyond it, marked
`ahead`, which wait here for a free slot: a slot that ends starts the next at once, and the report of what
ended travels while it runs. What the controller leased for its room starts first (it may hold a GPU that must
not idle behind a waiting task); tasks leased ahead start in the order they came. A job bigger than the
worker starts when nothing else runs here, so nothing waits for ever.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

EPSILON = 1e-9


@dataclass(order=True)
class _Waiter:
    ahead: bool  # leased ahead of a free slot: after every job leased for the room
    seq: int
    cpu: float = field(compare=False)
    granted: asyncio.Future[None] = field(compare=False)


class Slots:
    """CPU held by the jobs running here, out of `cpu`; jobs wait in `hold` until theirs fits."""

    def __init__(self, cpu: float) -> None:
        self.cpu = cpu
        self.used = 0.0
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()

    def waiting(self) -> int:
        """How many jobs wait here for room."""
        return len(self._waiters)

    def _fits(self, cpu: float) -> bool:
        return self.used <= EPSILON or self.used + cpu <= self.cpu + EPSILON

    async def hold(self, cpu: float, *, ahead: bool) -> None:
        """Wait until `cpu` fits beside what runs, behind the jobs that came before it (a job leased ahead:
        behind every job leased for the room), then hold it until `release`."""
        if not self._waiters and self._fits(cpu):
            self.used += cpu
            return
        waiter = _Waiter(ahead, next(self._seq), cpu, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._waiters.sort()
        self._grant()  # it may go before waiters that do not fit (leased for the room, behind ones leased ahead)
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self.release(cpu)  # granted, then cancelled before it could run: the room goes to the next
            else:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                self._grant()  # a big job ahead of smaller ones left: they may fit now
            raise

    def hand_over(self, held: float, cpu: float) -> None:
        """A job holding `held` passes its room on to one that needs `cpu` (a pipeline's next stage, chained
        after it here), without a gap for a waiting job to take."""
        self.used = max(0.0, self.used - held) + cpu

    def release(self, cpu: float) -> None:
        """A job that held `cpu` ended: start the waiting jobs that now fit, in order."""
        self.used = max(0.0, self.used - cpu)
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            waiter = self._waiters[0]
            if waiter.granted.done():  # its job was stopped while it waited, and has not woken yet
                self._waiters.pop(0)
                continue
            if not self._fits(waiter.cpu):
                return
            self._waiters.pop(0)
            self.used += waiter.cpu
            waiter.granted.set_result(None)
