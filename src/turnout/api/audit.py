"""`GET /v1/audit?since=&tenant=&kind=&limit=&cursor=` (admin): the append-only audit log, oldest first,
paged by `cursor` (the last record's id). A tenant's admin reads its own tenant's records."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

from fastapi import APIRouter, Query

from turnout.access import Action, Principal, check_tenant_name, sees
from turnout.api.guards import Guards
from turnout.api.schemas import audit_out
from turnout.api.service import Service
from turnout.api.strictjson import StrictJsonRoute
from turnout.controller import AUDIT_KINDS
from turnout.errors import InvalidInput, NotFound


def router(service: Service, guards: Guards) -> APIRouter:
    api = APIRouter(route_class=StrictJsonRoute)
    ctrl = service.controller

    @api.get("/v1/audit")
    async def audit(
        since: str | None = None,
        tenant: str | None = None,
        kind: str | None = None,
        limit: int = Query(1000, ge=1, le=10_000),
        cursor: int | None = Query(None, ge=0, le=2**63 - 1),  # a record id: what a store's integer holds
        p: Principal = guards.need(Action.ADMIN),
    ) -> dict[str, Any]:
        if tenant is not None:
            check_tenant_name(tenant)
            if not sees(p, tenant):
                raise NotFound(f"tenant {tenant} not found", field="tenant")
        if kind is not None and kind not in AUDIT_KINDS:
            raise InvalidInput(f"kind: {kind!r} is not one of {', '.join(sorted(AUDIT_KINDS))}", field="kind")
        records = await service.read(ctrl.list_audit, parse_since(since), limit, tenant=tenant or p.scope,
                                     kind=kind, after_id=cursor)  # fmt: skip
        return {"audit": [audit_out(r) for r in records],
                "next_cursor": records[-1]["id"] if len(records) == limit else None}  # fmt: skip

    return api


def parse_since(since: str | None) -> float | None:
    """`since` as epoch seconds: given so (a finite number: NaN would leave every record out, -inf take
    all), or as an ISO 8601 time; anything else is a 422 naming it."""
    if since is None:
        return None
    try:
        seconds = float(since)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):
            raise InvalidInput(f"since: {since!r} is not a finite number of epoch seconds", field="since")
        return seconds
    try:
        when = datetime.fromisoformat(since.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidInput(
            f"since: {since!r} is not an ISO 8601 time or epoch seconds", field="since"
        ) from None
    try:
        # times go out rounded to the microsecond: a record's own `ts`, sent back as `since`, must include it
        return when.timestamp() - 1e-6
    except (ValueError, OverflowError):  # a valid time the platform's clock cannot count to (year 1 here)
        raise InvalidInput(f"since: {since!r} is out of the range of epoch seconds", field="since") from None
