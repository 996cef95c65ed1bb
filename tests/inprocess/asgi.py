"""The API app in this process, on an event loop of its own thread, for tests written synchronously.

`InProcessApi` runs the app's lifespan (the service's database thread and sweep start and stop as under
uvicorn) and sends requests through `httpx.ASGITransport`: the routes, access checks, error mapping and
store are the production ones; only the socket is gone. A stream that never ends (events of a running task,
a worker's lifeline) is answered by `status`, which returns once the response has started.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine, MutableMapping
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI

R = TypeVar("R")
CALL_TIMEOUT_S = 60.0


class InProcessApi:
    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="inprocess-api", daemon=True)
        self._thread.start()
        self._stack = contextlib.AsyncExitStack()
        try:
            self.client: httpx.AsyncClient = self.run(self._start())
        except BaseException:
            self.close()
            raise

    async def _start(self) -> httpx.AsyncClient:
        await self._stack.enter_async_context(self.app.router.lifespan_context(self.app))
        transport = httpx.ASGITransport(app=self.app)
        return await self._stack.enter_async_context(
            httpx.AsyncClient(transport=transport, base_url="http://turnout")
        )

    def run(self, coro: Coroutine[Any, Any, R]) -> R:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(CALL_TIMEOUT_S)

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        return self.run(self.client.request(method, path, **kwargs))

    def status(self, method: str, path: str, **kwargs: Any) -> int:
        """The status code alone, once the response starts (its body, maybe an endless stream, unread)."""
        return self.run(self._status(self.client.build_request(method, path, **kwargs)))

    async def _status(self, request: httpx.Request) -> int:
        body = await request.aread()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
                 "headers": [(k.lower(), v) for k, v in request.headers.raw], "scheme": "http",
                 "path": request.url.path, "raw_path": request.url.raw_path.split(b"?")[0],
                 "query_string": request.url.query, "server": ("turnout", 80), "client": ("127.0.0.1", 123),
                 "root_path": ""}  # fmt: skip
        started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await started  # the client stays connected until it has its answer
            await asyncio.Event().wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start" and not started.done():
                started.set_result(int(message["status"]))

        handler = asyncio.ensure_future(self.app(scope, receive, send))
        try:
            done, _ = await asyncio.wait({handler, started}, return_when=asyncio.FIRST_COMPLETED)
            if started not in done:
                handler.result()  # the app ended without answering: raise what it raised
                raise AssertionError(f"{request.method} {request.url.path}: the app sent no response")
            return started.result()
        finally:
            handler.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await handler

    def close(self) -> None:
        """Stop the app (its lifespan's end stops the service and its threads), then the loop."""
        with contextlib.suppress(Exception):
            if self.loop.is_running():
                self.run(self._stack.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()
