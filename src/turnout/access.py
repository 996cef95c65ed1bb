"""Who may do what: roles, tenants and the operator, as pure decisions over a `Principal`.

Every token has a role (`admin`, `submit`, `worker`, `read`) and a tenant. The tenant `"*"` means every
tenant: an `admin` of `"*"` is the cluster **operator** (the token `turnout up` makes), a `worker` of `"*"`
is a shared pool serving every tenant, a `read` of `"*"` a cluster-wide monitor. Only the operator makes
`"*"` tokens; a tenant's admin makes tokens for its own tenant only. Nothing here touches I/O, so the rules
are tested as properties (tests/unit/test_access.py); `auth.py` stores tokens, the API calls these checks.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

from turnout.errors import Forbidden, InvalidInput, NotFound
from turnout.models import Role

ALL_TENANTS = "*"
WORKER_SECRET_HEADER = "X-Worker-Secret"  # a worker's proof of identity, answered by its registration
DEFAULT_TENANT = "default"  # where the operator's own submissions live
TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


class Action(str, enum.Enum):
    """What a route needs; each route declares exactly one."""

    SUBMIT = "submit"  # make or cancel tasks
    READ = "read"  # see tasks, capabilities, workers
    WORKER = "worker"  # the worker protocol: register, heartbeat, lease, report
    ADMIN = "admin"  # tokens, audit, draining workers
    ANY = "any"  # any valid token (the API docs)


ALLOWED: dict[Action, frozenset[Role]] = {
    Action.SUBMIT: frozenset({Role.ADMIN, Role.SUBMIT}),
    Action.READ: frozenset({Role.ADMIN, Role.SUBMIT, Role.READ}),
    Action.WORKER: frozenset({Role.ADMIN, Role.WORKER}),
    Action.ADMIN: frozenset({Role.ADMIN}),
    Action.ANY: frozenset(Role),
}


@dataclass(frozen=True)
class Principal:
    """The caller, as its token says: which token, which role, which tenant (or `"*"`, every tenant)."""

    token_id: str
    role: Role
    tenant: str

    @property
    def is_operator(self) -> bool:
        return self.role is Role.ADMIN and self.tenant == ALL_TENANTS

    @property
    def scope(self) -> str | None:
        """The one tenant whose tasks, tokens and audit this caller sees; None for every tenant."""
        return None if self.tenant == ALL_TENANTS else self.tenant

    @property
    def home_tenant(self) -> str:
        """The tenant that owns what this caller creates: its own, or `default` for a cluster-wide token."""
        return DEFAULT_TENANT if self.tenant == ALL_TENANTS else self.tenant


ANONYMOUS_OPERATOR = Principal("anonymous", Role.ADMIN, ALL_TENANTS)  # --no-auth, loopback only


def allow(principal: Principal, action: Action) -> Principal:
    """The principal if its role may do `action`; Forbidden (403) otherwise."""
    if principal.role not in ALLOWED[action]:
        raise Forbidden(f"a {principal.role.value} token cannot do this (needs {action.value})")
    return principal


def sees(principal: Principal, tenant: str | None) -> bool:
    """May this caller see an object (task, token, audit record) of `tenant`? None = cluster-wide records."""
    return principal.scope is None or (tenant is not None and tenant == principal.scope)


def visible(principal: Principal, tenant: str | None, what: str, field: str = "id") -> None:
    """404 for an object of another tenant: the caller learns nothing about whether it exists."""
    if not sees(principal, tenant):
        raise NotFound(f"{what} not found", field=field)


def parse_role(value: Any, field: str = "role") -> Role:
    try:
        return Role(value)
    except ValueError:
        raise InvalidInput(
            f"{field}: {value!r} is not one of admin, submit, worker, read", field=field
        ) from None


def check_tenant_name(value: Any, field: str = "tenant", *, allow_all: bool = False) -> str:
    """A tenant name (1-64 letters, digits, - or _; a letter or digit first), or `"*"` where allowed."""
    if allow_all and value == ALL_TENANTS:
        return ALL_TENANTS
    if not isinstance(value, str) or not TENANT_NAME.match(value):
        also = ' or "*" (every tenant)' if allow_all else ""
        raise InvalidInput(
            f"{field}: {value!r} must be 1-64 letters, digits, - or _, starting with a letter or digit{also}",
            field=field,
        )
    return value


def check_grant(principal: Principal, role: Any, tenant: Any) -> tuple[Role, str]:
    """May `principal` make a token of (role, tenant)? Returns them parsed; 422 or 403 says why not.

    The operator grants anything; a tenant's admin grants any role within its own tenant and nothing wider,
    so no token ever sees more than the token that made it.
    """
    allow(principal, Action.ADMIN)
    parsed = parse_role(role)
    name = check_tenant_name(tenant, allow_all=True)
    if name == ALL_TENANTS and parsed is Role.SUBMIT:
        raise InvalidInput('tenant: a submit token acts for one tenant, not "*"', field="tenant")
    if not principal.is_operator and name != principal.tenant:
        raise Forbidden(
            f"an admin of tenant {principal.tenant!r} makes tokens for tenant {principal.tenant!r} only"
        )
    return parsed, name


def worker_serves(scope: str, task_tenant: str) -> bool:
    """May a worker registered with a token of tenant `scope` run a task of `task_tenant`?"""
    return scope in (ALL_TENANTS, task_tenant)
