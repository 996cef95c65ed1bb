"""Tokens (admin): make one (`POST /v1/tokens`, shown once), list them, revoke one. A tenant's admin works
within its own tenant; `"*"` (every tenant) is the operator's alone. Each change is audited in the same
commit as the change itself."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from turnout.access import ALL_TENANTS, Action, Principal, check_tenant_name
from turnout.api.guards import Guards
from turnout.api.schemas import TokenIn, token_out
from turnout.api.service import Service
from turnout.api.strictjson import StrictJsonRoute


def router(service: Service, guards: Guards) -> APIRouter:
    api = APIRouter(route_class=StrictJsonRoute)
    ctrl = service.controller
    admin = guards.need(Action.ADMIN)

    @api.post("/v1/tokens", status_code=201)
    async def create_token(body: TokenIn, p: Principal = admin) -> dict[str, Any]:
        tenant = body.tenant if body.tenant is not None else p.home_tenant

        def run() -> dict[str, Any]:  # the token and its audit record commit together
            made = service.tokens.grant(p, body.role, tenant)
            ctrl.audit("token_created", _audit_tenant(made["tenant"]),
                       {"token": made["id"], "role": made["role"], "token_tenant": made["tenant"], "by": p.token_id})  # fmt: skip
            return made

        return await service.call(run)

    @api.get("/v1/tokens")
    async def list_tokens(tenant: str | None = None, p: Principal = admin) -> dict[str, Any]:
        if tenant is not None:
            check_tenant_name(tenant, allow_all=True)
        rows = await service.read(service.tokens.listed, p, tenant)
        return {"tokens": [token_out(r) for r in rows]}

    @api.delete("/v1/tokens/{token_id}")
    async def revoke_token(token_id: str, p: Principal = admin) -> dict[str, Any]:
        def run() -> dict[str, Any]:
            row, revoked = service.tokens.revoke(p, token_id)
            # revoking it again changes nothing and records nothing: the record names who revoked it
            if revoked:
                ctrl.audit("token_revoked", _audit_tenant(row["tenant"]),
                           {"token": token_id, "role": row["role"], "token_tenant": row["tenant"], "by": p.token_id})  # fmt: skip
            return row

        row = await service.call(run)
        service.tokens_revoked()  # committed: no cache here or on another replica may still admit it
        return {"id": token_id, "role": row["role"], "tenant": row["tenant"], "revoked": True}

    return api


def _audit_tenant(tenant: str) -> str | None:
    """The audit record's tenant for a token of `tenant`: none for the operator's every-tenant tokens."""
    return None if tenant == ALL_TENANTS else tenant
