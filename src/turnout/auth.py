"""Credentials: bearer tokens and worker secrets, made once, shown once, stored as SHA-256 hashes.

Who may do what is decided in `access.py`; this module only stores and verifies. A worker proves who it is
on every call with two things: the token that registered it, and the secret its registration answered
(header `X-Worker-Secret`). A token alone cannot act as another worker, and a stolen secret is useless
without the token.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from turnout.access import ALL_TENANTS, WORKER_SECRET_HEADER, Principal, check_grant, visible
from turnout.errors import Forbidden, NotFound, Unauthorized
from turnout.models import Role
from turnout.store.base import Store

TOKEN_PREFIX = "tnt_"
WORKER_SECRET_PREFIX = "tws_"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _bearer(header: str | None) -> str:
    if not header or not header.lower().startswith("bearer "):
        raise Unauthorized("missing bearer token (Authorization: Bearer <token>)")
    return header[7:].strip()


class TokenBook:
    """Verifies bearer tokens with a short cache, so a hot path does not hit the database per request."""

    CACHE_S = 5.0

    def __init__(self, store: Store) -> None:
        self.store = store
        self._cache: dict[str, tuple[float, Principal | None]] = {}
        self._alive: dict[str, tuple[float, bool]] = {}  # token id -> (when looked up, not revoked then)
        # bumped by `forget`: a lookup that began before a revocation committed must not cache what it read
        self._generation = 0

    def create(self, role: Role, tenant: str) -> tuple[str, str]:
        """Returns (token id, token), for a (role, tenant) already checked. The token itself is never stored."""
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        token_id = "k_" + secrets.token_hex(8)
        self.store.insert_token(token_id, hash_token(token), role.value, tenant, time.time())
        return token_id, token

    def grant(self, by: Principal, role: Any, tenant: Any) -> dict[str, Any]:
        """`by` makes a token: `{id, token, role, tenant}`, after `access.check_grant` allows it."""
        parsed, name = check_grant(by, role, tenant)
        token_id, token = self.create(parsed, name)
        return {"id": token_id, "token": token, "role": parsed.value, "tenant": name}

    def listed(self, by: Principal, tenant: str | None = None) -> list[dict[str, Any]]:
        """Tokens `by` may see: its own tenant's, or (the operator) any tenant's, optionally one."""
        if tenant is not None:
            visible(by, tenant, f"tenant {tenant}", "tenant")
        return self.store.list_tokens(tenant if tenant is not None else by.scope)

    def revoke(self, by: Principal, token_id: str) -> tuple[dict[str, Any], bool]:
        """Revoke a token of `by`'s tenant (any, for the operator); another tenant's token is 404. Returns its
        row and whether this call revoked it (False: it already was). Runs inside a transaction: the caller
        calls `forget` once it committed."""
        row = self.store.get_token(token_id)
        if row is None or not _may_manage(by, row["tenant"]):
            raise NotFound(f"token {token_id} not found", field="id")
        return row, self.store.revoke_token(token_id, time.time())

    def forget(self) -> None:
        """Drop every cached lookup, once a revocation is committed (here or on another replica).

        Not before the commit: a request verified in between reads the token as still valid and would cache it
        so for `CACHE_S` after the revocation was answered. A lookup that began before this call caches nothing.
        """
        self._generation += 1
        self._cache.clear()
        self._alive.clear()

    def cached(self, header: str | None) -> Principal | None:
        """The principal if this token was looked up in the last few seconds (raises if it was bad); else None."""
        hit = self._cache.get(hash_token(_bearer(header)))
        if hit is None or time.monotonic() - hit[0] > self.CACHE_S:
            return None
        return _known(hit[1])

    def verify(self, header: str | None) -> Principal:
        digest = hash_token(_bearer(header))
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is None or now - hit[0] > self.CACHE_S:
            generation = self._generation
            row = self.store.find_token(digest)
            principal = None
            if row and row["revoked_at"] is None:
                principal = Principal(row["id"], Role(row["role"]), row["tenant"])
            hit = (now, principal)
            if generation == self._generation:  # else a revocation committed since the row was read
                if len(self._cache) > 10_000:
                    self._cache.clear()
                self._cache[digest] = hit
                if row:
                    self._remember(row["id"], now, principal is not None)
        return _known(hit[1])

    def alive_cached(self, token_id: str) -> bool | None:
        """Whether the token `token_id` was valid when last looked up, in the last `CACHE_S`; None: not known."""
        hit = self._alive.get(token_id)
        return None if hit is None or time.monotonic() - hit[0] > self.CACHE_S else hit[1]

    def alive(self, token_id: str) -> bool:
        """Whether the token `token_id` is still valid (not revoked), for a request admitted earlier and still
        held open (a long poll, an event stream): from the cache, or the database at most once per `CACHE_S`."""
        cached = self.alive_cached(token_id)
        if cached is not None:
            return cached
        now, generation = time.monotonic(), self._generation
        row = self.store.get_token(token_id)
        valid = row is not None and row["revoked_at"] is None
        if generation == self._generation:
            self._remember(token_id, now, valid)
        return valid

    def _remember(self, token_id: str, now: float, valid: bool) -> None:
        if len(self._alive) > 10_000:
            self._alive.clear()
        self._alive[token_id] = (now, valid)


UNKNOWN_TOKEN = "unknown or revoked token"


def _known(principal: Principal | None) -> Principal:
    if principal is None:
        raise Unauthorized(UNKNOWN_TOKEN)
    return principal


def _may_manage(by: Principal, tenant: str) -> bool:
    """A token of `tenant` is managed by the operator, or by an admin of that very tenant (not of "*")."""
    return by.is_operator or (tenant != ALL_TENANTS and tenant == by.tenant)


@dataclass(frozen=True)
class WorkerCredential:
    """Who a worker is: written once at its first registration, never changed."""

    worker_id: str
    secret_hash: str
    token_id: str
    tenant: str  # the tenant it serves; "*" for a shared pool


class WorkerKeys:
    """Issues and checks worker secrets. Credentials never change, so they are cached for good."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._cache: dict[str, WorkerCredential] = {}

    def lookup(self, worker_id: str) -> WorkerCredential | None:
        cred = self._cache.get(worker_id)
        if cred is None:
            row = self.store.get_worker_credential(worker_id)
            if row is None:
                return None
            cred = WorkerCredential(row["worker_id"], row["secret_hash"], row["token_id"], row["tenant"])
            if len(self._cache) > 100_000:
                self._cache.clear()
            self._cache[worker_id] = cred
        return cred

    def cached(self, worker_id: str) -> WorkerCredential | None:
        return self._cache.get(worker_id)

    def claim(self, by: Principal, worker_id: str, secret: str | None) -> tuple[WorkerCredential, str]:
        """The credential for registering `worker_id`, and its secret: the one already issued (which the
        caller must present, with the token that registered it) or, for a new worker id, a fresh one bound
        to the caller's token and tenant."""
        existing = self.lookup(worker_id)
        if existing is not None:
            return check(existing, by, secret), secret or ""
        fresh = WORKER_SECRET_PREFIX + secrets.token_urlsafe(32)
        cred = WorkerCredential(worker_id, hash_token(fresh), by.token_id, by.tenant)
        # not cached here: this runs inside a transaction that may yet roll back; lookup() caches once it is read
        self.store.insert_worker_credential(worker_id, cred.secret_hash, by.token_id, by.tenant, time.time())
        return cred, fresh


def check(cred: WorkerCredential | None, by: Principal, secret: str | None) -> WorkerCredential:
    """The caller is this worker: its registering token, and its secret. Unknown worker: 404 (register
    again); someone else's worker: 403."""
    if cred is None:
        raise NotFound("worker not found; register again", field="worker")
    if (
        not secret
        or not hmac.compare_digest(hash_token(secret), cred.secret_hash)
        or by.token_id != cred.token_id
    ):
        raise Forbidden(
            f"not worker {cred.worker_id}: a worker calls with the token that registered it and the secret "
            f"its registration answered ({WORKER_SECRET_HEADER})",
            field="worker",
        )
    return cred


def write_admin_token(home: Path, token: str) -> Path:
    """$TURNOUT_HOME/admin.token, mode 0600, where the CLI and SDK look. Written whole and renamed into place,
    so a CLI started beside the controller reads the old token or the new one, never an empty file."""
    home.mkdir(parents=True, exist_ok=True)
    path = home / "admin.token"
    part = home / f"admin.token.{os.getpid()}.part"
    try:
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(token + "\n")
        os.chmod(part, 0o600)  # O_CREAT's mode applies only to a new file
        os.replace(part, path)
    except BaseException:
        part.unlink(missing_ok=True)  # a full disk leaves no half-written part behind
        raise
    return path
