"""The order in which the database thread takes calls: worker calls first, then each tenant's in turn.

The controller's writes run on one thread that commits in groups (`api/service.py`): every caller in a group
hears back once the whole group is on disk. Taken in arrival order, a tenant flooding submissions fills the
groups, and a calm tenant's call, or the result of a task a worker just ran, waits behind them. `Lanes`
keeps one queue per tenant for submissions and one for everything else (the worker protocol: leases,
results, heartbeats; the sweep), and makes each group from them:

- the worker lane first, in arrival order: a worker's call never waits behind a tenant's submissions;
- then the tenants' lanes one call at a time in turn (round-robin), each in its own arrival order;
- at most `per_tenant` calls of one tenant in a group, so a tenant's backlog is spread over several groups
  (several commits) and a call of another tenant that arrives meanwhile goes in the next group, not after
  the whole backlog; at most `max_group` calls in all, of which the worker lane leaves one for each tenant
  with calls waiting (up to half the group), so no tenant waits for ever behind worker calls;
- tenants served in a group queue up behind those it left out, in the order they were served: when a group
  cannot hold one call of every waiting tenant, each still gets one within as many groups as tenants wait.

Pure: no threads, no clock. The service wraps it in a lock (`api/service.py`, `_JobQueue`).
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")
WORKER_LANE = None  # the lane of every call that is not a tenant's submission


class Lanes(Generic[T]):
    """Calls waiting for the database thread, by lane; `take()` makes the next group."""

    def __init__(self, max_group: int, per_tenant: int) -> None:
        if max_group < 2 or per_tenant < 1:
            raise ValueError("max_group must be >= 2 and per_tenant >= 1")
        self.max_group = max_group
        self.per_tenant = per_tenant
        self._worker: deque[T] = deque()
        self._tenants: dict[str, deque[T]] = {}  # only tenants with calls waiting; dict order = their turn

    def put(self, item: T, tenant: str | None = WORKER_LANE) -> None:
        """Queue a call: a submission of `tenant`, or (None) a worker's or the controller's own call."""
        if tenant is WORKER_LANE:
            self._worker.append(item)
        else:
            self._tenants.setdefault(tenant, deque()).append(item)

    def __len__(self) -> int:
        return len(self._worker) + sum(len(q) for q in self._tenants.values())

    def waiting(self, tenant: str | None = WORKER_LANE) -> int:
        """Calls of this lane waiting now."""
        if tenant is WORKER_LANE:
            return len(self._worker)
        return len(self._tenants.get(tenant, ()))

    def take(self) -> list[T]:
        """The next group, in the order its calls should run; empty when nothing waits."""
        reserve = min(len(self._tenants), self.max_group // 2)
        group: list[T] = []
        while self._worker and len(group) < self.max_group - reserve:
            group.append(self._worker.popleft())
        order = list(self._tenants)
        taken = dict.fromkeys(order, 0)
        served: list[str] = []
        progress = True
        while progress and len(group) < self.max_group:
            progress = False
            for tenant in order:
                lane = self._tenants[tenant]
                if not lane or taken[tenant] >= self.per_tenant or len(group) >= self.max_group:
                    continue
                group.append(lane.popleft())
                taken[tenant] += 1
                if taken[tenant] == 1:
                    served.append(tenant)
                progress = True
        for tenant in served:  # served tenants go to the back, in the order they were served
            lane = self._tenants.pop(tenant)
            if lane:
                self._tenants[tenant] = lane
        return group
