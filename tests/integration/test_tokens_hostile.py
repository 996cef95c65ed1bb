"""A token revoked on one controller replica stops on the others at once, not once their token caches expire.

Two controllers' APIs, tokens on, in one event loop on one PostgreSQL database, each with its own store,
token cache and bus, as `turnout controller` wires them. Their caches are made to hold a minute here, so a
request refused within the bound below was refused because replica A told replica B of the revocation.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest

from turnout.access import ALL_TENANTS
from turnout.api.app import create_app
from turnout.api.service import Service
from turnout.auth import TokenBook
from turnout.config import ControllerSettings
from turnout.controller import Controller
from turnout.models import Role
from turnout.store import open_store
from turnout.store.notify import ReplicaBus

pytestmark = pytest.mark.postgres
CACHE_S = 60.0
BOUND_S = 20.0


@asynccontextmanager
async def replica(url: str) -> AsyncIterator[tuple[Service, httpx.AsyncClient]]:
    """One controller replica with tokens on, its token cache holding for `CACHE_S`; stopped however it ends."""
    store = open_store(url)
    tokens = TokenBook(store)
    tokens.CACHE_S = CACHE_S
    service = Service(Controller(store, ControllerSettings()), tokens, bus=ReplicaBus(store.url))
    await service.start()
    try:
        assert service.bus is not None
        assert await asyncio.get_running_loop().run_in_executor(None, service.bus.wait_listening, 10.0)
        transport = httpx.ASGITransport(app=create_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
            yield service, client
    finally:
        await service.stop()


def test_a_token_revoked_on_one_replica_is_refused_by_another_at_once(pg_url: str) -> None:
    async def main() -> None:
        async with replica(pg_url) as (a, api_a), replica(pg_url) as (_, api_b):
            _, operator = a.tokens.create(Role.ADMIN, ALL_TENANTS)
            admin = {"Authorization": f"Bearer {operator}"}
            made = (
                await api_a.post("/v1/tokens", json={"role": "read", "tenant": "acme"}, headers=admin)
            ).json()
            bearer = {"Authorization": f"Bearer {made['token']}"}
            # Given replica B has seen the token (it is in its cache)
            assert (await api_b.get("/v1/whoami", headers=bearer)).status_code == 200
            # When replica A revokes it
            resp = await api_a.delete(f"/v1/tokens/{made['id']}", headers=admin)
            assert resp.status_code == 200, resp.text
            # Then B refuses it too, as soon as A's notice arrives (its cache alone would admit it for a minute)
            deadline = time.monotonic() + BOUND_S
            while (status := (await api_b.get("/v1/whoami", headers=bearer)).status_code) == 200:
                assert time.monotonic() < deadline, "replica B still admits the revoked token"
                await asyncio.sleep(0.05)
            assert status == 401

    asyncio.run(main())
