"""The API in-process: the FastAPI app of `api/app.py` over a memory store, its lifespan run (so the
service's database thread and sweep run as in production), driven through `httpx.ASGITransport`. No port,
no subprocess; the controller's clock is a fake one the test moves."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.inprocess.asgi import InProcessApi
from tests.inprocess.harness import FakeClock, Harness
from turnout.access import ALL_TENANTS
from turnout.api.app import Api as AppApi
from turnout.api.app import create_app
from turnout.api.service import Service
from turnout.auth import TokenBook
from turnout.config import ControllerSettings
from turnout.controller import Controller
from turnout.models import Role, Task
from turnout.runtime import build_controller
from turnout.store import MemoryStore, Store, open_store

CPU_SHOUT = {"capability": "shout", "device": "cpu", "resources": {"cpu": 1}}
GPU_SHOUT = {"capability": "shout", "device": "gpu", "resources": {"cpu": 1, "gpu": 1}}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class Api:
    """A client of the in-process API with the operator's token, and what stands behind it."""

    client: httpx.AsyncClient
    service: Service
    clock: FakeClock
    store: Store
    app: AppApi | None = None  # the application the client calls, where the test built it

    @property
    def ctrl(self) -> Controller:
        return self.service.controller

    async def token(self, role: str = "submit", tenant: str = "default") -> str:
        resp = await self.client.post("/v1/tokens", json={"role": role, "tenant": tenant})
        assert resp.status_code == 201, resp.text
        return str(resp.json()["token"])

    async def as_(self, token: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return await self.client.request(method, path, headers={"Authorization": f"Bearer {token}"}, **kwargs)

    async def worker(self, *variants: dict[str, Any], gpus: int = 0, heartbeat_s: float = 1.0) -> Worker:
        """Register a worker with a worker token of its own, as an agent would."""
        token = await self.token("worker", ALL_TENANTS)
        body = {"name": "w", "host": "h", "variants": list(variants) or [CPU_SHOUT], "cpu": 4, "memory": 2**33,
                "gpus": [_gpu(i) for i in range(gpus)], "heartbeat_s": heartbeat_s}  # fmt: skip
        resp = await self.as_(token, "POST", "/v1/workers/register", json=body)
        assert resp.status_code == 201, resp.text
        return Worker(self, resp.json()["id"], token, resp.json()["secret"])

    async def submit(self, capability: str = "shout", **fields: Any) -> dict[str, Any]:
        resp = await self.client.post(
            "/v1/tasks", json={"capability": capability, "input": {"text": "hi"}, **fields}
        )
        assert resp.status_code == 201, resp.text
        return dict(resp.json())

    async def task(self, task_id: str) -> dict[str, Any]:
        resp = await self.client.get(f"/v1/tasks/{task_id}")
        assert resp.status_code == 200, resp.text
        return dict(resp.json())

    async def sweep(self) -> bool:
        """One round of the sweep, as the service's loop runs it (on its database thread)."""
        return await self.service.call(self.ctrl.reap, self.service.heard)


@dataclass
class Worker:
    """The worker protocol over HTTP, spoken by the test."""

    api: Api
    id: str
    token: str
    secret: str

    async def post(self, action: str, body: dict[str, Any]) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}", "X-Worker-Secret": self.secret}
        return await self.api.client.post(f"/v1/workers/{self.id}/{action}", json=body, headers=headers)

    async def lease(self, running: list[str] | None = None, max_tasks: int = 8) -> dict[str, Any]:
        resp = await self.post("lease", {"max_tasks": max_tasks, "wait_s": 0, "running": running or []})
        assert resp.status_code == 200, resp.text
        return dict(resp.json())

    async def complete(
        self, task: dict[str, Any], output: Any = None, error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        result = {"task_id": task["id"], "attempt": task["attempt"], "status": "failed" if error else "succeeded",
                  "output": output, "error": error, "run_s": 0.25}  # fmt: skip
        resp = await self.post("complete", {"results": [result]})
        assert resp.status_code == 200, resp.text
        return dict(resp.json())

    async def heartbeat(self) -> None:
        resp = await self.post("heartbeat", {})
        assert resp.status_code == 200, resp.text


def task_reads(api: Api, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ids of the tasks the controller reads (`get_task`) from now on, in order."""
    reads: list[str] = []
    get_task = api.ctrl.get_task

    def counted(tenant: str | None, task_id: str) -> Task:
        reads.append(task_id)
        return get_task(tenant, task_id)

    monkeypatch.setattr(api.ctrl, "get_task", counted)
    return reads


def _gpu(i: int) -> dict[str, Any]:
    return {"index": i, "uuid": f"GPU-fake-{i}", "name": "Fake H100", "memory_total_bytes": 80 * 2**30}


@contextlib.asynccontextmanager
async def serve_api(
    settings: ControllerSettings | None = None, store: Store | None = None, **service_args: Any
) -> AsyncIterator[Api]:
    """The API on a fresh memory store (or `store`) with these settings, lifespan started (the service's
    threads stop however the block ends); the operator's token on every request."""
    clock = FakeClock()
    store = store or MemoryStore()
    tokens = TokenBook(store)
    _, admin = tokens.create(Role.ADMIN, ALL_TENANTS)
    controller = Controller(store, settings or ControllerSettings(heartbeat_s=1.0), clock=clock)
    service = Service(controller, tokens, **service_args)
    app = create_app(service)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        headers = {"Authorization": f"Bearer {admin}"}
        async with httpx.AsyncClient(
            transport=transport, base_url="http://turnout", headers=headers
        ) as client:
            yield Api(client, service, clock, store, app)


@pytest.fixture
async def api() -> AsyncIterator[Api]:
    """The API on a fresh memory store, lifespan started; the operator's token on every request."""
    async with serve_api() as served_api:
        yield served_api


@dataclass
class Served:
    """The app `turnout controller --db memory://` serves, called synchronously, and the operator's token."""

    api: InProcessApi
    token: str

    def call(self, method: str, path: str, token: str | None = None, **kwargs: Any) -> httpx.Response:
        """A request with `token` (default: the operator's; "" for none)."""
        bearer = self.token if token is None else token
        headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
        return self.api.request(method, path, headers={**headers, **kwargs.pop("headers", {})}, **kwargs)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """`runtime.build_controller` on the memory store, with tokens on, as `turnout controller` wires it."""
    parts = build_controller(db="memory://", home=tmp_path / "home")
    assert parts.admin_token is not None
    api = InProcessApi(create_app(parts.service))
    try:
        yield Served(api, parts.admin_token)
    finally:
        api.close()


@pytest.fixture(params=["memory", "sqlite"])
def h(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    """The controller over the memory store, and over a SQLite file: it meets the same rules on both."""
    store = open_store("memory://" if request.param == "memory" else f"sqlite:///{tmp_path / 'turnout.db'}")
    try:
        yield Harness(store=store)
    finally:
        store.close()


@pytest.fixture(params=["memory", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """A fresh store, in memory and as a SQLite file: what runs on one runs on the other."""
    opened = open_store("memory://" if request.param == "memory" else f"sqlite:///{tmp_path / 'turnout.db'}")
    try:
        yield opened
    finally:
        opened.close()
