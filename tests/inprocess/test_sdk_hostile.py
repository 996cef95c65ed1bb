"""The Python SDK used wrongly or pointed at the wrong thing: it raises at once, naming what is wrong, never hangs.

Every test drives `Client` over an `httpx.MockTransport`, so no controller is needed: what matters is what the
SDK sends (nothing, for a bad id) and what it makes of an answer that is not a Turnout controller's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from turnout.client import Client, NotAController, default_token
from turnout.errors import InvalidInput, NotFound, Unavailable
from turnout.files import SHA256_HEADER

URL = "http://127.0.0.1:1"
TASK = {"id": "t_0123456789abcdef01234567", "state": "queued"}


def within(seconds: float, call: Callable[[], Any]) -> BaseException | Any:
    """`call()`'s result or exception, failing the test (instead of hanging it) when it takes longer."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(call())
        except BaseException as exc:  # the test looks at it
            box.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the call did not return within {seconds} s"
    return box[0]


class Recorder:
    """A stand-in server: answers every request with `answer(request)` and keeps what was asked."""

    def __init__(self, answer: Callable[[httpx.Request], httpx.Response]) -> None:
        self.answer = answer
        self.seen: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        return self.answer(request)


def turnout_answer(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/v1/workers":
        return httpx.Response(200, json={"workers": []})
    return httpx.Response(200, json=TASK)


def client_of(answer: Callable[[httpx.Request], httpx.Response]) -> tuple[Client, Recorder]:
    recorder = Recorder(answer)
    return Client(URL, "tnt_test", transport=httpx.MockTransport(recorder)), recorder


# ---- H1: a closed client ---------------------------------------------------------------------------


def test_a_call_on_a_closed_client_raises_at_once_naming_that_it_is_closed() -> None:
    client, _ = client_of(turnout_answer)
    assert client.workers() == []
    client.close()
    got = within(5, client.workers)
    assert isinstance(got, RuntimeError) and "closed" in str(got)


def test_closing_a_client_twice_is_harmless() -> None:
    client, _ = client_of(turnout_answer)
    client.close()
    assert within(5, client.close) is None


def test_a_client_used_after_its_with_block_raises() -> None:
    with client_of(turnout_answer)[0] as client:
        handle = client.submit("shout", {"text": "a"})
    for call in (client.workers, handle.result, lambda: list(handle.events()), handle.cancel):
        got = within(5, call)
        assert isinstance(got, RuntimeError) and "closed" in str(got), call


def test_a_call_waiting_when_another_thread_closes_the_client_raises_instead_of_hanging() -> None:
    entered, release = threading.Event(), threading.Event()

    def slow(request: httpx.Request) -> httpx.Response:
        entered.set()
        release.wait(10)
        return turnout_answer(request)

    client, _ = client_of(slow)
    waiter: list[BaseException | Any] = []
    thread = threading.Thread(target=lambda: waiter.append(within(8, client.workers)), daemon=True)
    thread.start()
    assert entered.wait(5)
    threading.Timer(0.5, release.set).start()  # the mock transport runs on the loop: let close() finish
    client.close()
    thread.join(10)
    assert waiter and (waiter[0] == [] or isinstance(waiter[0], RuntimeError))


# ---- M3: not a Turnout controller ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "headers", "body", "says"),
    [
        (200, {"content-type": "text/html"}, b"<html>hi</html>", "HTTP 200 text/html"),
        (404, {"content-type": "text/html"}, b"<html>nope</html>", "HTTP 404 text/html"),
        (501, {"content-type": "text/html"}, b"<html>Unsupported</html>", "HTTP 501 text/html"),
        (307, {"location": "/v1/tasks"}, b"", "HTTP 307 redirect to /v1/tasks"),
        (200, {"content-type": "application/json"}, b"not json", "HTTP 200 application/json"),
    ],
)
def test_an_answer_that_is_not_turnouts_says_the_url_is_not_a_controller(
    status: int, headers: dict[str, str], body: bytes, says: str
) -> None:
    with client_of(lambda _: httpx.Response(status, headers=headers, content=body))[0] as client:
        for call in (client.workers, lambda: client.get_task(TASK["id"]), lambda: client.submit("shout", {})):
            with pytest.raises(NotAController) as caught:
                call()
            assert caught.value.message == f"{URL} did not answer as a Turnout controller ({says})"
            assert caught.value.field == "url"


def test_a_proxys_own_503_page_stays_unavailable_and_turnouts_404_stays_not_found() -> None:
    with client_of(lambda _: httpx.Response(503, headers={"content-type": "text/html"}, content=b"down"))[
        0
    ] as client:
        with pytest.raises(Unavailable) as caught:
            client.workers()
        assert not isinstance(caught.value, NotAController)
    missing = {"error": {"type": "not_found", "message": "task t_x not found", "field": "id"}}
    with client_of(lambda _: httpx.Response(404, json=missing))[0] as client, pytest.raises(NotFound):
        client.get_task("t_x")


def test_an_event_stream_that_is_not_one_is_refused() -> None:
    def page(_: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/html"}, content=b"<html></html>")

    with client_of(page)[0] as client, pytest.raises(NotAController):
        list(client.task(TASK["id"]).events())


# ---- M8: ids into URL paths ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "kind", "bad"),
    [
        (lambda c: c.get_task("../workers"), "task id", "../workers"),
        (lambda c: c.get_task("../../v1/workers"), "task id", "../../v1/workers"),
        (lambda c: c.get_task("t_x?wait=1"), "task id", "t_x?wait=1"),
        (lambda c: c.get_task(""), "task id", ""),
        (lambda c: c.cancel("../../v1/pipeline-runs/r_x"), "task id", "../../v1/pipeline-runs/r_x"),
        (lambda c: c.get_result("w_0123"), "task id", "w_0123"),
        (lambda c: c.pipeline_run("../tasks"), "run id", "../tasks"),
        (lambda c: c.cancel_pipeline_run("r_/x"), "run id", "r_/x"),
        (lambda c: c.revoke_token("k_../x"), "token id", "k_../x"),
        (lambda c: c.delete_file("f_%2e%2e"), "file id", "f_%2e%2e"),
        (lambda c: c.download("../tasks", "/tmp/never-written"), "file id", "../tasks"),
        (lambda c: list(c.task("t_a b").events()), "task id", "t_a b"),
    ],
)
def test_an_id_that_is_not_one_is_refused_naming_it_and_nothing_is_sent(
    call: Callable[[Client], Any], kind: str, bad: str
) -> None:
    client, recorder = client_of(turnout_answer)
    with client, pytest.raises(InvalidInput) as caught:
        call(client)
    assert caught.value.message.startswith(f"{kind}: {bad!r} is not a {kind}")
    assert recorder.seen == []


@pytest.mark.parametrize("name", [None, "None", "../tasks", "a/b", ""])
def test_a_pipeline_name_that_is_not_one_is_refused(name: Any) -> None:
    client, recorder = client_of(turnout_answer)
    with client, pytest.raises(InvalidInput) as caught:
        client.run_pipeline(name, {})
    assert caught.value.field == "pipeline" and recorder.seen == []


def test_well_formed_ids_still_reach_their_routes() -> None:
    client, recorder = client_of(turnout_answer)
    with client:
        client.get_task("t_0123456789abcdef01234567")
        client.get_task("t_nosuch")  # not one Turnout made, but harmless: the controller answers 404
    assert [r.url.path for r in recorder.seen] == [
        "/v1/tasks/t_0123456789abcdef01234567",
        "/v1/tasks/t_nosuch",
    ]


# ---- M4: a download nothing can check --------------------------------------------------------------


def test_a_download_without_the_controllers_sha256_is_refused_and_leaves_no_file(tmp_path: Path) -> None:
    def page(_: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/html"}, content=b"<html>not yours</html>")

    dest = tmp_path / "got"
    with client_of(page)[0] as client, pytest.raises(NotAController) as caught:
        client.download("f_0123456789ab0123456789abcdef", dest)
    assert SHA256_HEADER in caught.value.message
    assert list(tmp_path.iterdir()) == []


def test_a_download_with_the_sha256_is_kept(tmp_path: Path) -> None:
    import hashlib

    data = b"the bytes"
    headers = {SHA256_HEADER: hashlib.sha256(data).hexdigest()}
    with client_of(lambda _: httpx.Response(200, headers=headers, stream=httpx.ByteStream(data)))[
        0
    ] as client:
        got = client.download("f_0123456789ab0123456789abcdef", tmp_path / "got")
    assert (tmp_path / "got").read_bytes() == data and got["size"] == len(data)


@pytest.mark.parametrize("where", ["a directory", "in no directory"])
def test_a_download_to_a_path_that_cannot_take_it_is_refused_before_any_request_and_leaves_nothing(
    tmp_path: Path, where: str
) -> None:
    dest = tmp_path if where == "a directory" else tmp_path / "missing" / "got"
    client, recorder = client_of(turnout_answer)
    with client, pytest.raises(InvalidInput) as caught:
        client.download("f_0123456789ab0123456789abcdef", dest)
    assert caught.value.field == "output" and recorder.seen == []
    assert list(tmp_path.iterdir()) == []  # no .part beside it


def test_a_download_that_fails_midway_leaves_no_part_file(tmp_path: Path) -> None:
    class Broken(httpx.AsyncByteStream):
        async def __aiter__(self) -> Any:
            yield b"half of it"
            raise httpx.ReadError("the connection broke")

    headers = {SHA256_HEADER: "0" * 64}
    client = client_of(lambda _: httpx.Response(200, headers=headers, stream=Broken()))[0]
    with client, pytest.raises((httpx.ReadError, Unavailable)):
        client.download("f_0123456789ab0123456789abcdef", tmp_path / "got")
    assert list(tmp_path.iterdir()) == []


# ---- L4, L13: the constructor's arguments, L7: a token file that is not text ---------------------------


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"url": "http://[::1"}, "url"),
        ({"url": "localhost:8750"}, "url"),
        ({"url": 123}, "url"),
        ({"timeout_s": -1}, "timeout_s"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": float("nan")}, "timeout_s"),
        ({"timeout_s": "5"}, "timeout_s"),
        ({"rate_limit_wait_s": float("nan")}, "rate_limit_wait_s"),
        ({"rate_limit_wait_s": "x"}, "rate_limit_wait_s"),
        ({"submit_window_s": "x"}, "submit_window_s"),
    ],
)
def test_a_bad_constructor_argument_is_refused_naming_it(options: dict[str, Any], field: str) -> None:
    options = {"url": URL, **options}
    with pytest.raises(InvalidInput) as caught:
        Client(options.pop("url"), "tnt_test", **options)
    assert caught.value.field == field


def test_a_token_file_that_is_not_text_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "admin.token").write_bytes(b"\xff\xfe\x00garbage")
    monkeypatch.delenv("TURNOUT_TOKEN", raising=False)
    monkeypatch.setenv("TURNOUT_HOME", str(tmp_path))
    with pytest.raises(InvalidInput) as caught:
        default_token()
    assert caught.value.field == "token" and str(tmp_path / "admin.token") in caught.value.message
