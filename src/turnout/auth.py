"""Tokens: made once, shown once, stored as SHA-256 hashes, each bound to a role and a tenant."""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from turnout.errors import Forbidden, InvalidInput, NotFound, Unauthorized
from turnout.models import Role
from turnout.store import SqlStore

TOKEN_PREFIX = "tnt_"
# who may do what: an admin may do everything; the others only their own kind of request
ALLOWED: dict[str, frozenset[Role]] = {
    "submit": frozenset({Role.ADMIN, Role.SUBMIT}),
    "read": frozenset({Role.ADMIN, Role.SUBMIT, Role.READ}),
    "worker": frozenset({Role.ADMIN, Role.WORKER}),
    "admin": frozenset({Role.ADMIN}),
}


@dataclass(frozen=True)
class Principal:
    token_id: str
    role: Role
    tenant: str

    @property
    def sees_all_tenants(self) -> bool:
        return self.role is Role.ADMIN and self.tenant == "default"


ANONYMOUS_ADMIN = Principal("anonymous", Role.ADMIN, "default")


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class TokenBook:
    """Verifies bearer tokens with a short cache, so a hot path does not hit the database per request."""

    CACHE_S = 5.0

    def __init__(self, store: SqlStore) -> None:
        self.store = store
        self._cache: dict[str, tuple[float, Principal | None]] = {}

    def create(self, role: str, tenant: str = "default") -> tuple[str, str]:
        """Returns (token id, token). The token itself is never stored."""
        try:
            parsed = Role(role)
        except ValueError:
            raise InvalidInput(
                f"role: {role!r} is not one of admin, submit, worker, read", field="role"
            ) from None
        if not tenant or len(tenant) > 64 or not tenant.replace("-", "").replace("_", "").isalnum():
            raise InvalidInput(f"tenant: {tenant!r} must be 1-64 letters, digits, - or _", field="tenant")
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        token_id = "k_" + secrets.token_hex(8)
        self.store.insert_token(token_id, hash_token(token), parsed.value, tenant, time.time())
        return token_id, token

    def revoke(self, token_id: str) -> None:
        if self.store.get_token(token_id) is None:
            raise NotFound(f"token {token_id} not found", field="id")
        self.store.revoke_token(token_id, time.time())
        self._cache.clear()

    def cached(self, header: str | None, need: str) -> Principal | None:
        """The principal if this token was looked up in the last few seconds (raises if it was bad); else None."""
        if not header or not header.lower().startswith("bearer "):
            raise Unauthorized("missing bearer token (Authorization: Bearer <token>)")
        hit = self._cache.get(hash_token(header[7:].strip()))
        if hit is None or time.monotonic() - hit[0] > self.CACHE_S:
            return None
        return self._check(hit[1], need)

    def verify(self, header: str | None, need: str) -> Principal:
        if not header or not header.lower().startswith("bearer "):
            raise Unauthorized("missing bearer token (Authorization: Bearer <token>)")
        digest = hash_token(header[7:].strip())
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is None or now - hit[0] > self.CACHE_S:
            row = self.store.find_token(digest)
            principal = None
            if row and row["revoked_at"] is None:
                principal = Principal(row["id"], Role(row["role"]), row["tenant"])
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[digest] = hit = (now, principal)
        return self._check(hit[1], need)

    @staticmethod
    def _check(principal: Principal | None, need: str) -> Principal:
        if principal is None:
            raise Unauthorized("unknown or revoked token")
        if principal.role not in ALLOWED[need]:
            raise Forbidden(f"a {principal.role.value} token cannot do this (needs {need})")
        return principal


def write_admin_token(home: Path, token: str) -> Path:
    """$TURNOUT_HOME/admin.token, mode 0600, where the CLI and SDK look."""
    home.mkdir(parents=True, exist_ok=True)
    path = home / "admin.token"
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(token + "\n")
    return path
