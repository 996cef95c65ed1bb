"""The fleet as users see it: `GET /v1/workers` (read) and `POST /v1/workers/{id}/drain` (admin).

A tenant sees its own workers and the shared pool, and on a shared worker only its own tasks' load. A
tenant's admin drains its own workers; a shared worker (serving every tenant) is drained by the operator.
The worker protocol itself (register, heartbeat, lease, ...) is in api/protocol.py.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from turnout.access import ALL_TENANTS, Action, Principal, sees
from turnout.api.guards import Guards
from turnout.api.schemas import worker_out
from turnout.api.service import Service
from turnout.api.strictjson import StrictJsonRoute
from turnout.errors import Forbidden, NotFound


def router(service: Service, guards: Guards) -> APIRouter:
    api = APIRouter(route_class=StrictJsonRoute)
    ctrl = service.controller

    @api.get("/v1/workers")
    async def workers(p: Principal = guards.need(Action.READ)) -> dict[str, Any]:
        ws = await guards.visible_workers(p)
        active = await service.read(ctrl.active_tasks)
        counts: dict[str, int] = {}
        for t in active:
            if sees(p, t.tenant):  # a shared worker's load from other tenants is theirs to know
                counts[t.worker_id or ""] = counts.get(t.worker_id or "", 0) + 1
        return {"workers": [worker_out(w, counts.get(w.id, 0)) for w in ws]}

    @api.post("/v1/workers/{worker_id}/drain")
    async def drain(worker_id: str, p: Principal = guards.need(Action.ADMIN)) -> dict[str, Any]:
        if not p.is_operator:
            cred = await service.read(service.workers.lookup, worker_id)
            if cred is None or cred.tenant not in (ALL_TENANTS, p.tenant):
                raise NotFound(f"worker {worker_id} not found", field="worker")
            if cred.tenant == ALL_TENANTS:
                raise Forbidden("a shared worker (serving every tenant) is drained by the operator only")
        return worker_out(await service.call(ctrl.drain, worker_id, by=p.token_id))

    return api
