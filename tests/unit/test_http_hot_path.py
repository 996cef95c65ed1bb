"""The async HTTP client the worker agent, the SDK and the CLI share imports nothing per request: httpcore imports
`sniffio` on every async request, and while it was missing each request searched sys.path for it twice (a third
of the worker agent's CPU per no-op task)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType

import httpx


class _Recorder(MetaPathFinder):
    def __init__(self) -> None:
        self.names: list[str] = []

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        self.names.append(fullname)
        return None  # the other finders go on as usual


ANSWER = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"ok":true}'


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer every request on the connection with ANSWER (a keep-alive HTTP/1.1 server of one route)."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)  # fmt: skip
            await reader.readexactly(length)
            writer.write(ANSWER)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def requests(n: int) -> None:
    """n requests through the real transport (httpcore, a socket on loopback), as the worker agent sends them."""
    server = await asyncio.start_server(_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            for _ in range(n):
                assert (await client.post("/v1/workers/w/complete", json={"results": []})).json() == {
                    "ok": True
                }
    finally:
        server.close()
        await server.wait_closed()


def test_async_requests_try_no_imports() -> None:
    asyncio.run(requests(2))  # whatever is imported once, the first time
    recorder = _Recorder()
    sys.meta_path.insert(0, recorder)
    try:
        asyncio.run(requests(20))
    finally:
        sys.meta_path.remove(recorder)
    assert recorder.names == []
