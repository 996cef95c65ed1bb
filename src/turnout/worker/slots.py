"""The worker's own count of its cores: a job starts when the CPU it holds fits what is free here.

The controller leases within the room it computes, and with `--prefetch N` up to N tasks beyond it, marked
`ahead`, which wait here for a free slot: a slot that ends starts the next at once, and the report of what
ended travels while it runs. What the controller leased for its room starts first (it may hold a GPU that must
not idle behind a waiting task); tasks leased ahead start in the order they came. A job bigger than the
worker starts when nothing else runs here, so nothing waits for ever.

A GPU task leased ahead names the running task it follows (`after`: the controller placed it on that task's GPU
share, `placement.Followers`): it waits for that task's job to end here and takes its room at once (`follow`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

EPSILON = 1e-9


@dataclass(order=True)
class _Waiter:
    ahead: bool  # leased ahead of a free slot: after every job leased for the room
    seq: int
    cpu: float = field(compare=False)
    granted: asyncio.Future[None] = field(compare=False)
    tasks: tuple[str, ...] = field(
        default=(), compare=False
    )  # a follower's own tasks (a job may follow them)


class Slots:
    """CPU held by the jobs running here, out of `cpu`; jobs wait in `hold` until theirs fits."""

    def __init__(self, cpu: float) -> None:
        self.cpu = cpu
        self.used = 0.0
        self._waiters: list[_Waiter] = []
        self._followers: dict[str, _Waiter] = {}  # a task whose job runs here -> the job that follows it
        self._seq = itertools.count()

    def waiting(self) -> int:
        """How many jobs wait here for room (or for the job they follow to end)."""
        return len(self._waiters) + len(self._followers)

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

    async def follow(self, leader: str, cpu: float, tasks: Iterable[str] = ()) -> None:
        """Wait until the job of task `leader` here ends, then hold `cpu` of the room it held (`release` with
        its tasks); `tasks`: this job's own, which a job may follow in turn. The leader's job must be here
        (running, or following another): one that ends without room to hand on is `forsake`n."""
        waiter = _Waiter(True, next(self._seq), cpu, asyncio.get_running_loop().create_future(), tuple(tasks))
        self._followers[leader] = waiter
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self.release(cpu, waiter.tasks)  # handed the room, then stopped before it could run
            else:
                if self._followers.get(leader) is waiter:
                    del self._followers[leader]
                    # the job that followed this one follows its leader now: it may not start before it ends
                    for task_id in waiter.tasks:
                        after_it = self._followers.pop(task_id, None)
                        if after_it is not None:
                            self._followers[leader] = after_it
                            break
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                    self._grant()
            raise

    def forsake(self, tasks: Iterable[str]) -> None:
        """These tasks' job ends without room to hand on (it never held any, or a chained stage took it): a job
        that follows one of them waits for room as any job leased ahead does."""
        for task_id in tasks:
            follower = self._followers.pop(task_id, None)
            if follower is not None and not follower.granted.done():
                self._waiters.append(follower)
                self._waiters.sort()
        self._grant()

    def hand_over(self, held: float, cpu: float) -> None:
        """A job holding `held` passes its room on to one that needs `cpu` (a pipeline's next stage, chained
        after it here), without a gap for a waiting job to take."""
        self.used = max(0.0, self.used - held) + cpu
        self._grant()

    def release(self, cpu: float, tasks: Iterable[str] = ()) -> None:
        """A job that held `cpu` ended (running `tasks`): a job that follows one of them takes its room at once;
        else the waiting jobs that now fit start, in order."""
        for task_id in tasks:
            follower = self._followers.pop(task_id, None)
            if follower is not None and not follower.granted.done():
                self.hand_over(cpu, follower.cpu)
                follower.granted.set_result(None)
                return
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
