"""`LeanTransport` keeps httpx's promises over a real loopback socket: reuse where HTTP/1.1 allows it, never a
connection left mid-answer, and httpx's own errors for every way a server can fail.

Each test scripts a small asyncio server (`Server`): it parses each request with httptools, records it, and
answers with the bytes the test gives, so the tests can send what a well-behaved server never would."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import httptools
import httpx
import pytest

from turnout import transport
from turnout.client import Client
from turnout.errors import InvalidInput
from turnout.tls import async_client
from turnout.transport import LeanTransport, lean_transport
from turnout.worker.client import ControllerClient

pytestmark = pytest.mark.anyio
OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


@dataclass
class Received:
    method: bytes
    path: bytes
    headers: dict[bytes, bytes]
    body: bytes
    connection: int  # which connection it came on, counted from 0


Answer = Callable[[Received, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class Server:
    """Answers the n-th request with `answers[n]` (the last one for any after); counts connections."""

    answers: list[Answer]
    requests: list[Received] = field(default_factory=list)
    connections: int = 0
    closed: int = 0  # connections the client closed (or gave up) before the server did

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = self.connections
        self.connections += 1
        try:
            while True:
                request = await _request(reader, number)
                if request is None:
                    self.closed += 1
                    return
                self.requests.append(request)
                answer = self.answers[min(len(self.requests), len(self.answers)) - 1]
                await answer(request, writer)
                if writer.is_closing():
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            self.closed += 1
        finally:
            writer.close()


async def _request(reader: asyncio.StreamReader, connection: int) -> Received | None:
    parts: dict[str, object] = {"headers": {}, "body": b"", "done": False}

    class Parse:
        def on_url(self, url: bytes) -> None:
            parts["path"] = url

        def on_header(self, name: bytes, value: bytes) -> None:
            parts["headers"][name.lower()] = value  # type: ignore[index]

        def on_body(self, body: bytes) -> None:
            parts["body"] += body  # type: ignore[operator]

        def on_message_complete(self) -> None:
            parts["done"] = True

    parser = httptools.HttpRequestParser(Parse())
    while not parts["done"]:
        data = await reader.read(65536)
        if not data:
            return None
        parser.feed_data(data)
    return Received(parser.get_method(), parts["path"], parts["headers"], parts["body"], connection)  # type: ignore[arg-type]


def send(*chunks: bytes, close: bool = False, pause_s: float = 0.0) -> Answer:
    async def answer(request: Received, writer: asyncio.StreamWriter) -> None:
        for chunk in chunks:
            writer.write(chunk)
            await writer.drain()
            await asyncio.sleep(pause_s)
        if close:
            writer.close()

    return answer


@contextlib.asynccontextmanager
async def serving(*answers: Answer) -> AsyncIterator[tuple[Server, httpx.AsyncClient]]:
    server = Server(list(answers))
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    client = httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", transport=lean_transport(ssl.create_default_context())
    )
    try:
        yield server, client
    finally:
        await client.aclose()
        listener.close()
        await listener.wait_closed()


PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")


@pytest.fixture
def no_proxy_variables(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    return monkeypatch


async def test_the_sdks_and_the_workers_clients_go_over_the_lean_transport(
    no_proxy_variables: pytest.MonkeyPatch,
) -> None:
    client = async_client(ca_cert=None, base_url="http://127.0.0.1:1")
    try:
        assert isinstance(client._transport, LeanTransport)
    finally:
        await client.aclose()


@pytest.mark.parametrize("variable", ["HTTP_PROXY", "http_proxy", "ALL_PROXY"])
async def test_a_proxy_the_environment_names_carries_every_call(
    no_proxy_variables: pytest.MonkeyPatch, variable: str
) -> None:
    async with serving(send(OK)) as (proxy, to_proxy):  # the scripted server stands in for the proxy
        no_proxy_variables.setenv(variable, str(to_proxy.base_url))
        client = async_client(ca_cert=None, base_url="http://controller.invalid:8900")
        try:
            assert (await client.get("/v1/health")).text == "ok"
        finally:
            await client.aclose()
    # the request went to the proxy, in the absolute form a proxy takes, for the controller the URL names
    assert [r.path for r in proxy.requests] == [b"http://controller.invalid:8900/v1/health"]


async def test_a_host_the_environment_exempts_from_its_proxy_is_reached_directly(
    no_proxy_variables: pytest.MonkeyPatch,
) -> None:
    async with serving(send(OK)) as (server, direct):
        no_proxy_variables.setenv("HTTP_PROXY", "http://127.0.0.1:1")  # nothing listens there
        no_proxy_variables.setenv("NO_PROXY", "127.0.0.1")
        client = async_client(ca_cert=None, base_url=str(direct.base_url))
        try:
            assert (await client.get("/v1/health")).text == "ok"
        finally:
            await client.aclose()
    assert [r.path for r in server.requests] == [b"/v1/health"]


def test_the_sdk_sends_every_call_through_a_transport_it_is_given() -> None:
    seen: list[httpx.Request] = []

    def controller(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(201, json={"id": "t_1", "state": "succeeded", "output": {"n": 2}})

    with Client("http://turnout.test", "tok", transport=httpx.MockTransport(controller)) as client:
        assert client.run("double", {"n": 1})["output"] == {"n": 2}
    assert [(r.method, r.url.path, r.headers["authorization"]) for r in seen] == [
        ("POST", "/v1/tasks", "Bearer tok")
    ]


async def test_sequential_requests_share_one_connection_and_each_gets_its_own_answer() -> None:
    async def echo(request: Received, writer: asyncio.StreamWriter) -> None:
        body = request.method + b" " + request.path + b" " + request.body
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))

    async with serving(echo) as (server, client):
        for i in range(5):
            resp = await client.post("/v1/tasks", params={"wait": i}, json={"n": i})
            assert resp.status_code == 200
            assert resp.text == f'POST /v1/tasks?wait={i} {{"n":{i}}}'
        assert server.connections == 1
        assert server.requests[0].headers[b"host"] == client.base_url.netloc


@pytest.mark.parametrize(
    ("answer", "text", "connections"),
    [
        (send(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"), "ok", 2),
        (send(b"HTTP/1.1 200 OK\r\n\r\nuntil ", b"the end", close=True, pause_s=0.02), "until the end", 2),
        (send(OK + b"EXTRA BYTES\r\n\r\n"), "ok", 2),
        (
            send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n3\r\n!!!\r\n0\r\n\r\n"),
            "ok!!!",
            1,
        ),
    ],
    ids=["connection-close", "body-ends-at-close", "garbage-after-the-answer", "chunked-came-whole"],
)
async def test_an_answer_is_read_whole_and_its_connection_reused_only_where_http_allows(
    answer: Answer, text: str, connections: int
) -> None:
    async with serving(answer, send(OK)) as (server, client):
        assert (await client.get("/a")).text == text
        assert (await client.get("/b")).text == "ok"
        assert server.connections == connections


async def test_a_connection_the_server_closed_while_idle_is_replaced_without_an_error() -> None:
    async with serving(send(OK, close=True), send(OK)) as (server, client):
        assert (await client.get("/a")).text == "ok"
        await asyncio.sleep(0.1)  # the server's close arrives while the connection is idle
        assert (await client.get("/b")).text == "ok"
        assert [r.connection for r in server.requests] == [0, 1]


async def test_a_chunked_answer_streams_each_part_as_it_arrives() -> None:
    second_part = asyncio.Event()

    async def chunks(request: Received, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await second_part.wait()  # sent only once the client has read the first
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")

    async with serving(chunks, send(OK)) as (server, client):
        parts = []
        async with client.stream("GET", "/events") as resp:
            async for part in resp.aiter_bytes():
                parts.append(part)
                second_part.set()
        assert parts == [b"first", b"second"]
        assert (await client.get("/again")).text == "ok"
        assert server.connections == 1  # read to its end: reused


async def test_a_gzipped_answer_is_decoded_as_httpx_decodes_one() -> None:
    packed = gzip.compress(b'{"state": "succeeded"}')
    head = b"HTTP/1.1 200 OK\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n" % len(packed)
    async with serving(send(head + packed)) as (_, client):
        assert (await client.get("/t")).json() == {"state": "succeeded"}


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (send(close=True), "without sending a response"),
        (send(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf", close=True), "complete message body"),
        (send(b"HELLO THERE\r\n\r\n"), "not an HTTP/1.1 answer"),
        (send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"), "not an HTTP/1.1 answer"),
    ],
    ids=["closed-at-once", "closed-mid-body", "not-http", "bad-chunk"],
)
async def test_a_server_that_breaks_off_or_speaks_garbage_is_a_remote_protocol_error(
    answer: Answer, said: str
) -> None:
    async with serving(answer, send(OK)) as (server, client):
        with pytest.raises(httpx.RemoteProtocolError, match=said):
            await client.get("/a")
        assert (await client.get("/b")).text == "ok"
        assert server.connections == 2  # the broken connection was not reused


async def test_a_silent_server_is_a_read_timeout_and_its_connection_is_closed() -> None:
    async def silent(request: Received, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    async with serving(silent, send(OK)) as (server, client):
        with pytest.raises(httpx.ReadTimeout):
            await client.get("/a", timeout=httpx.Timeout(5.0, read=0.2))
        assert (await client.get("/b")).text == "ok"
        assert server.connections == 2


async def test_a_caller_that_gives_up_mid_answer_leaves_no_connection_to_reuse() -> None:
    async def slow(request: Received, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nab")
        await writer.drain()
        await asyncio.sleep(5)

    async with serving(slow, send(OK)) as (server, client):
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(client.get("/a"), 0.2)
        assert (await client.get("/b")).text == "ok"
        assert server.connections == 2
        async with client.stream("GET", "/c") as resp:  # a stream closed unread: its connection stays good
            assert resp.status_code == 200
        assert (await client.get("/d")).text == "ok"
        assert server.connections == 2


async def test_nothing_listening_is_a_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
        client = httpx.AsyncClient(transport=lean_transport(ssl.create_default_context()))
        try:
            with pytest.raises(httpx.ConnectError):
                await client.get(f"http://127.0.0.1:{port}/")
        finally:
            await client.aclose()


@pytest.mark.parametrize("length_known", [True, False], ids=["content-length", "chunked"])
async def test_a_streamed_upload_arrives_byte_for_byte(length_known: bool) -> None:
    parts = [b"a" * 70_000, b"", b"b" * 3, b"c" * 100_000]

    async def body() -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    headers = {"content-length": str(sum(map(len, parts)))} if length_known else {}
    async with serving(send(OK)) as (server, client):
        assert (await client.put("/v1/files", content=body(), headers=headers)).text == "ok"
        assert server.requests[0].body == b"".join(parts)
        assert (b"transfer-encoding" in server.requests[0].headers) is not length_known


async def test_a_head_request_goes_to_httpxs_own_transport() -> None:
    head = send(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")
    async with serving(head, send(OK)) as (server, client):
        resp = await client.head("/v1/files/f_1")
        assert resp.status_code == 200 and resp.headers["content-length"] == "1000" and resp.content == b""
        assert server.requests[0].method == b"HEAD"


async def test_past_the_connection_limit_a_request_waits_its_pool_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(transport, "MAX_CONNECTIONS", 1)
    held = asyncio.Event()

    async def hold(request: Received, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        await writer.drain()
        await held.wait()
        writer.write(b"ok")

    async with serving(hold, send(OK)) as (_, client):
        first = asyncio.ensure_future(client.get("/a"))
        await asyncio.sleep(0.1)
        with pytest.raises(httpx.PoolTimeout):
            await client.get("/b", timeout=httpx.Timeout(5.0, pool=0.1))
        held.set()
        assert (await first).text == "ok"
        assert (await client.get("/c")).text == "ok"  # the slot came back


@pytest.mark.parametrize(
    ("method", "headers"),
    [
        ("GET", {"authorization": "Bearer tok\r\nX-Role: admin"}),
        ("GET", {"x-trailing": "tok\n"}),
        ("GET", {"bad name": "v"}),
        ("GET / HTTP/1.1\r\nX-Smuggled: 1\r\n\r\nGET", {}),
    ],
    ids=["crlf-in-value", "newline-in-value", "space-in-name", "method-with-a-request"],
)
async def test_a_header_or_method_that_would_smuggle_a_line_is_refused_before_anything_is_sent(
    method: str, headers: dict[str, str]
) -> None:
    async with serving(send(OK)) as (server, client):
        with pytest.raises(httpx.LocalProtocolError, match="illegal"):
            await client.request(method, "/a", headers=headers)
        assert server.connections == 0
        assert (await client.get("/b")).text == "ok"


@pytest.mark.parametrize("token", ["tnt_abc\n", "tnt abc", "tnt_\x00abc"], ids=["newline", "space", "nul"])
def test_a_token_that_would_break_its_header_line_is_refused_naming_token_and_never_said(token: str) -> None:
    for make in (
        lambda: Client("http://127.0.0.1:1", token),
        lambda: ControllerClient("http://127.0.0.1:1", token),
    ):
        with pytest.raises(InvalidInput, match=r"^token: ") as refused:
            make()
        assert refused.value.field == "token" and token.strip() not in str(refused.value)


async def test_a_connection_idle_past_its_keep_alive_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        transport, "IDLE_S", 0.05
    )  # 4 s, under uvicorn's 5: never reused as the server drops it
    async with serving(send(OK)) as (server, client):
        assert (await client.get("/a")).text == "ok"
        assert (await client.get("/b")).text == "ok"
        await asyncio.sleep(0.1)
        assert (await client.get("/c")).text == "ok"
        assert [r.connection for r in server.requests] == [0, 0, 1]


async def test_an_interim_answer_is_passed_over_for_the_answer_after_it() -> None:
    async with serving(send(b"HTTP/1.1 100 Continue\r\n\r\n", OK, pause_s=0.01), send(OK)) as (
        server,
        client,
    ):
        resp = await client.post("/a", content=b"x")
        assert (resp.status_code, resp.text) == (200, "ok")
        assert (await client.get("/b")).text == "ok"
        assert server.connections == 1


async def test_an_answer_whose_headers_never_end_is_refused_not_held_in_memory() -> None:
    async def endless(request: Received, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for i in range(100_000):  # 2 MB of headers unless the client stops reading
            writer.write(b"x-filler-%06d: %s\r\n" % (i, b"y" * 4))
            if i % 1000 == 0:
                await writer.drain()

    async with serving(endless, send(OK)) as (server, client):
        with pytest.raises(httpx.RemoteProtocolError, match="headers run past 64 KiB"):
            await client.get("/a")
        assert (await client.get("/b")).text == "ok"
        assert server.connections == 2
