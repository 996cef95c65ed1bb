"""Who may call a route: the dependencies every router declares, built once per app.

`need(action)` admits a token whose role allows the action (401/403 otherwise); `this_worker()` admits only
the worker named in the path (its registering token and its `X-Worker-Secret`); `visible_workers` is the set
of workers a caller sees (its tenant's own and the shared pool). Whose tasks a caller sees is
`Principal.scope`.
"""

from __future__ import annotations

from typing import Any

from fastapi import Depends, Header

from turnout.access import ANONYMOUS_OPERATOR, Action, Principal, allow, worker_serves
from turnout.api.service import Service
from turnout.auth import WorkerCredential
from turnout.auth import check as check_worker
from turnout.models import Worker


class Guards:
    def __init__(self, service: Service) -> None:
        self.service = service

    async def principal_of(self, authorization: str | None) -> Principal:
        service = self.service
        if not service.auth:
            return ANONYMOUS_OPERATOR
        cached = service.tokens.cached(authorization)  # the hot path: no database, no thread hop
        if cached is not None:
            return cached
        return await service.read(service.tokens.verify, authorization)

    def need(self, action: Action) -> Any:
        """Every route but /healthz, /metrics and the dashboard's HTML declares the one action it needs."""

        async def check(authorization: str | None = Header(None)) -> Principal:
            return allow(await self.principal_of(authorization), action)

        return Depends(check)

    def this_worker(self) -> Any:
        """Worker routes: the caller must be the worker in the URL (its token and its secret); else 403."""

        async def check(
            worker_id: str,
            authorization: str | None = Header(None),
            x_worker_secret: str | None = Header(
                None, description="the secret /v1/workers/register answered"
            ),
        ) -> WorkerCredential:
            return await self.worker_of(worker_id, authorization, x_worker_secret)

        return Depends(check)

    async def worker_of(
        self, worker_id: str, authorization: str | None, secret: str | None
    ) -> WorkerCredential:
        """The credential of the worker `worker_id` when the caller proves to be it; raises 401/403 otherwise."""
        p = allow(await self.principal_of(authorization), Action.WORKER)
        service = self.service
        cred = service.workers.cached(worker_id) or await service.read(service.workers.lookup, worker_id)
        return check_worker(cred, p, secret)

    async def visible_workers(self, p: Principal) -> list[Worker]:
        """The workers this caller sees: its tenant's and the shared pool's (the operator: all)."""
        ctrl = self.service.controller
        workers = await self.service.read(ctrl.workers)
        if p.scope is None:
            return workers
        tenants = await self.service.read(ctrl.worker_tenants)
        return [w for w in workers if w.id in tenants and worker_serves(tenants[w.id], p.scope)]
