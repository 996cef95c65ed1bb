"""The Python SDK. `AsyncClient` is the one implementation; `Client` drives it on a private event loop.

from turnout import Client
client = Client()                                  # TURNOUT_URL, TURNOUT_TOKEN or $TURNOUT_HOME/admin.token
task = client.submit("shout", {"text": "hi"}, gpu="prefer")
print(task.result(timeout=30)["output"])
print(client.run("shout", {"text": "hi"}, timeout=30)["output"])   # submit and wait: one request
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import math
import os
import random
import re
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx

from turnout.config import DEFAULT_PORT
from turnout.errors import (
    HTTP_STATUS,
    InvalidInput,
    PayloadTooLarge,
    RateLimited,
    TurnoutError,
    Unavailable,
    number,
)
from turnout.jsonsafe import problem
from turnout.models import CAPABILITY_NAME
from turnout.tls import async_client, bearer

T = TypeVar("T")
log = logging.getLogger("turnout.client")
TERMINAL = {"succeeded", "failed", "cancelled"}
_BY_STATUS: dict[int, type[TurnoutError]] = {code: cls for cls, code in HTTP_STATUS.items()}
SUBMIT_WINDOW_S = 0.002  # concurrent submissions this close together go as one batch request
MAX_BATCH = 1000  # what `POST /v1/tasks/batch` takes at once
WAIT_STEP_S = 30.0  # the longest one request waits for a task or run to end; a longer wait asks again


def seconds_or_none(value: float | None, name: str) -> float | None:
    """A wait a caller gave: None or infinity (no limit), or a number >= 0. NaN is refused naming the argument:
    it compares false with every deadline, so a wait on it would never end."""
    if value is None or value == math.inf:
        return value
    return number(value, name, "a number of seconds >= 0", lambda v: v >= 0)


def default_url() -> str:
    return os.environ.get("TURNOUT_URL") or f"http://127.0.0.1:{DEFAULT_PORT}"


def controller_url(url: Any) -> str:
    """The controller's base URL, checked: `http://` or `https://` with a host. A malformed one (`http://[::1`,
    `localhost:8750`) is an InvalidInput naming `url`, before any request."""
    if not isinstance(url, str):
        raise InvalidInput(f"url: expected the controller's URL as a string, got {url!r}", field="url")
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise InvalidInput(f"url: {url!r} is not a URL ({exc})", field="url") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise InvalidInput(f"url: {url!r} is not an http:// or https:// URL with a host, "
                           f"e.g. http://127.0.0.1:{DEFAULT_PORT}", field="url")  # fmt: skip
    return url.rstrip("/")


def default_ca_cert() -> Path | None:
    """A private CA to trust for an https controller: `TURNOUT_CA_CERT` (a PEM file), else the system's."""
    value = os.environ.get("TURNOUT_CA_CERT")
    return Path(value).expanduser() if value else None


def default_token() -> str | None:
    if os.environ.get("TURNOUT_TOKEN"):
        return os.environ["TURNOUT_TOKEN"]
    path = Path(os.environ.get("TURNOUT_HOME") or "~/.turnout").expanduser() / "admin.token"
    try:
        return path.read_text(encoding="utf-8").strip() or None
    except OSError:
        return None
    except UnicodeDecodeError:
        raise InvalidInput(f"token: {path} is not UTF-8 text, so it holds no Turnout token; set TURNOUT_TOKEN, "
                           "or remove the file", field="token") from None  # fmt: skip


# What each kind of id looks like before it goes into a URL path (`models.new_id`, `blobs.new_file_id`,
# `auth.TokenBook.create`): its prefix, then letters, digits, `_` or `-`. Checked, not only quoted: `../workers`
# or `t_x?wait=1` would reach another route, and the CLI would show that route's answer as the object asked for.
ID_PREFIXES = {"task id": "t_", "run id": "r_", "file id": "f_", "token id": "k_"}
_ID_TAIL = re.compile(r"[A-Za-z0-9_-]{1,128}")


def path_id(value: Any, kind: str) -> str:
    """`value` where it is an id of `kind` (`task id`, `run id`, `file id`, `token id`), safe as one URL path
    segment; else an InvalidInput naming it: `task id: '../v1/workers' is not a task id (t_...)`."""
    prefix = ID_PREFIXES[kind]
    if isinstance(value, str) and value.startswith(prefix) and _ID_TAIL.fullmatch(value[len(prefix) :]):
        return value
    field = kind.replace(" ", "_")
    raise InvalidInput(f"{kind}: {value!r} is not a {kind} ({prefix}... as Turnout made it)", field=field)


def pipeline_name(value: Any) -> str:
    """A pipeline's name as turnout.yaml may define it (the shape of a capability name), safe in a URL path."""
    if isinstance(value, str) and CAPABILITY_NAME.fullmatch(value):
        return value
    raise InvalidInput(f"pipeline: {value!r} is not a pipeline name (lower-case letters, digits, _ . -)",
                       field="pipeline")  # fmt: skip


class NotAController(Unavailable):
    """What answered at the client's URL is not a Turnout controller (a web page, a redirect, another API)."""

    def __init__(self, url: str, what: str) -> None:
        super().__init__(f"{url} did not answer as a Turnout controller ({what})", field="url")
        self.url = url


def what_came(resp: httpx.Response) -> str:
    """`HTTP 200 text/html`, `HTTP 307 redirect to /v1/tasks`: what an answer was, for a message."""
    kind = resp.headers.get("content-type", "").split(";")[0].strip() or "no content type"
    if 300 <= resp.status_code < 400:
        return f"HTTP {resp.status_code} redirect to {resp.headers.get('location', '?')}"
    return f"HTTP {resp.status_code} {kind}"


def _origin(resp: httpx.Response) -> str:
    """`http://host:port` of the request `resp` answers, for a message."""
    try:
        url = resp.request.url
    except RuntimeError:  # a response made by hand, with no request
        return "the server"
    return f"{url.scheme}://{url.netloc.decode('ascii', 'replace')}"


def _turnout_error(resp: httpx.Response) -> dict[str, Any] | None:
    """The `{"error": {...}}` a Turnout controller answers a refusal with; None for any other body."""
    if "json" not in resp.headers.get("content-type", ""):
        return None
    try:
        err = resp.json().get("error")
    except (ValueError, AttributeError):
        return None
    return err if isinstance(err, dict) else None


def json_body(resp: httpx.Response, url: str) -> Any:
    """The JSON of a Turnout answer (after `raise_for_error`); anything else (a 2xx web page, a 3xx, JSON that
    is not Turnout's) is a NotAController naming `url` and what came back, never a JSONDecodeError."""
    raise_for_error(resp, url)
    if 200 <= resp.status_code < 300 and "json" in resp.headers.get("content-type", ""):
        try:
            return resp.json()
        except ValueError:
            pass
    raise NotAController(url, what_came(resp))


# What a proxy in front of a controller may answer on its own (a body of its own, not Turnout's): kept as the
# class its status maps to. Any other status with a body that is not Turnout's is not a controller answering.
PROXY_STATUSES = frozenset({401, 403, 407, 413, 429, 502, 503, 504})


def raise_for_error(resp: httpx.Response, url: str | None = None) -> None:
    """Raise the controller's error as the class it maps to: InvalidInput (422, `.field` names what to fix),
    Conflict (409, e.g. an idempotency_key reused for another request), PayloadTooLarge (413, the message
    names the limit), RateLimited (429, `.retry_after_s`), ... An answer from a proxy keeps its status; any
    other refusal that is not Turnout's (a web server's 404 page) is a NotAController naming `url`."""
    if resp.status_code < 400:
        return
    err = _turnout_error(resp)
    if err is None:
        if resp.status_code not in PROXY_STATUSES:
            raise NotAController(url or _origin(resp), what_came(resp))
        err = {"message": f"HTTP {resp.status_code}: {resp.text[:200]}"}
    message = err.get("message") or f"HTTP {resp.status_code}"
    if resp.status_code == 429:
        raise RateLimited(message, retry_after_s=retry_after_s(resp), field=err.get("field"))
    cls = _BY_STATUS.get(resp.status_code, TurnoutError)
    raise cls(message, field=err.get("field"))


def retry_after_s(resp: httpx.Response) -> float:
    """How long a 429 asks us to wait: the body's exact `retry_after_s`, else the Retry-After header (seconds)."""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        exact = resp.json()["error"]["retry_after_s"]
        if isinstance(exact, int | float) and exact >= 0:
            return float(exact)
    try:
        return max(0.0, float(resp.headers.get("Retry-After", "1")))
    except ValueError:
        return 1.0


class AsyncTaskHandle:
    def __init__(self, client: AsyncClient, task: dict[str, Any]) -> None:
        self.client = client
        self.id: str = task["id"]
        self.task = task

    async def result(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait for a terminal state (at most `timeout` seconds) and return the task; a task known to have
        ended already (a handle from `run`) is returned as it is: it cannot change."""
        timeout = seconds_or_none(timeout, "timeout")
        if self.task.get("state") in TERMINAL:
            return self.task
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            wait = WAIT_STEP_S if deadline is None else max(0.0, min(WAIT_STEP_S, deadline - loop.time()))
            self.task = await self.client.get_result(self.id, wait=wait)
            if self.task["state"] in TERMINAL:
                return self.task
            if deadline is not None and loop.time() >= deadline:
                raise TimeoutError(f"task {self.id} still {self.task['state']} after {timeout} s")

    async def events(self, after: int = 0) -> AsyncIterator[dict[str, Any]]:
        async for event in self.client.events(self.id, after=after):
            yield event

    async def cancel(self) -> dict[str, Any]:
        return await self.client.cancel(self.id)


class AsyncClient:
    """`rate_limit_wait_s`: how long in all a call waits out 429s (as Retry-After says) before raising RateLimited.
    `submit_window_s`: concurrent `submit()` calls this close together go as one batch (0: each on its own).
    `transport`: an httpx transport to send every call through instead of Turnout's own (`transport.py`), for
    example `httpx.MockTransport` in a test of your code, or `httpx.AsyncHTTPTransport()` (httpx's own); its own
    TLS settings apply, not `ca_cert`'s."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout_s: float = 30.0,
        rate_limit_wait_s: float = 60.0,
        ca_cert: str | Path | None = None,
        submit_window_s: float = SUBMIT_WINDOW_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = controller_url(url or default_url())
        timeout_s = number(timeout_s, "timeout_s", "a number of seconds > 0", lambda v: v > 0)
        self.rate_limit_wait_s = number(rate_limit_wait_s, "rate_limit_wait_s", "a number of seconds >= 0",
                                        lambda v: v >= 0)  # fmt: skip
        submit_window_s = number(
            submit_window_s, "submit_window_s", "a number of seconds >= 0", lambda v: v >= 0
        )
        headers = bearer(token or default_token())
        ca = Path(ca_cert).expanduser() if ca_cert else default_ca_cert()
        self.http = async_client(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s, read=None),
            ca_cert=ca,
            transport=transport,
        )
        self._submissions = _Coalescer(self, submit_window_s)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._submissions.drain()
        await self.http.aclose()

    async def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """One API call. A 429 accepted nothing, so it is safe to send again: wait as Retry-After says (with
        a little jitter, so many clients do not return at once), up to `rate_limit_wait_s` in all."""
        found = problem(kwargs["json"]) if "json" in kwargs else None
        if found is not None:  # refused here, naming the field, rather than as httpx's ValueError or a 422
            raise InvalidInput(f"{found[0]}: {found[1]}", field=found[0])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.rate_limit_wait_s
        while True:
            try:
                resp = await self.http.request(method, path, **kwargs)
            except httpx.ConnectError as exc:
                raise Unavailable(f"cannot reach the Turnout controller at {self.url}: {exc}") from None
            if resp.status_code == 429:
                wait = retry_after_s(resp) * (1 + 0.1 * random.random())
                if loop.time() + wait <= deadline:
                    log.warning("rate limited by the controller: waiting %.2f s, as Retry-After says", wait)
                    await asyncio.sleep(wait)
                    continue
            return json_body(resp, self.url)

    async def submit(
        self, capability: str, input: Any = None, *, gpu: str | bool = "auto", **options: Any
    ) -> AsyncTaskHandle:
        """Submit one task. Calls made while another submission is on its way, within `submit_window_s` of each
        other, go together as one `POST /v1/tasks/batch`; each caller still gets its own task, or its own error
        (a 422 names the caller's own field, as a single submit's would)."""
        body = {"capability": capability, "input": input, "gpu": gpu, **options}
        found = problem(body)
        if found is not None:  # this caller's alone: never sent, never in anyone's batch
            raise InvalidInput(f"{found[0]}: {found[1]}", field=found[0])
        return AsyncTaskHandle(self, await self._submissions.submit(body))

    async def run(
        self,
        capability: str,
        input: Any = None,
        *,
        gpu: str | bool = "auto",
        timeout: float | None = None,
        **options: Any,
    ) -> dict[str, Any]:
        """Submit one task and wait for it to end; returns the task (TimeoutError after `timeout` seconds).

        One request where the task ends within `WAIT_STEP_S` (`POST /v1/tasks?wait=`): the submission's answer
        is the result. Never batched with other callers' `submit()`s, whose answers cannot wait for it."""
        timeout = seconds_or_none(timeout, "timeout")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        wait = WAIT_STEP_S if timeout is None else min(WAIT_STEP_S, timeout)
        body = {"capability": capability, "input": input, "gpu": gpu, **options}
        handle = AsyncTaskHandle(
            self, await self.request("POST", "/v1/tasks", params={"wait": wait}, json=body)
        )
        try:
            return await handle.result(None if deadline is None else max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise TimeoutError(f"task {handle.id} still {handle.task['state']} after {timeout} s") from None

    async def submit_batch(self, tasks: list[dict[str, Any]]) -> list[AsyncTaskHandle]:
        body = await self.request("POST", "/v1/tasks/batch", json={"tasks": tasks})
        return [AsyncTaskHandle(self, t) for t in body["tasks"]]

    async def get_task(self, task_id: str) -> dict[str, Any]:
        return await self.request("GET", f"/v1/tasks/{path_id(task_id, 'task id')}")

    async def get_result(self, task_id: str, wait: float = 0) -> dict[str, Any]:
        return await self.request(
            "GET", f"/v1/tasks/{path_id(task_id, 'task id')}/result", params={"wait": wait}
        )

    async def cancel(self, task_id: str) -> dict[str, Any]:
        return await self.request("POST", f"/v1/tasks/{path_id(task_id, 'task id')}/cancel")

    async def tasks(self, **filters: Any) -> dict[str, Any]:
        return await self.request(
            "GET", "/v1/tasks", params={k: v for k, v in filters.items() if v is not None}
        )

    async def workers(self) -> list[dict[str, Any]]:
        return (await self.request("GET", "/v1/workers"))["workers"]

    async def capabilities(self) -> list[dict[str, Any]]:
        return (await self.request("GET", "/v1/capabilities"))["capabilities"]

    async def create_token(self, role: str, tenant: str | None = None) -> dict[str, Any]:
        """A new token `{id, token, role, tenant}` (shown once); tenant defaults to the caller's own."""
        body = {"role": role} if tenant is None else {"role": role, "tenant": tenant}
        return await self.request("POST", "/v1/tokens", json=body)

    async def list_tokens(self, tenant: str | None = None) -> list[dict[str, Any]]:
        params = {"tenant": tenant} if tenant is not None else {}
        return (await self.request("GET", "/v1/tokens", params=params))["tokens"]

    async def revoke_token(self, token_id: str) -> dict[str, Any]:
        return await self.request("DELETE", f"/v1/tokens/{path_id(token_id, 'token id')}")

    async def audit(
        self, since: str | None = None, tenant: str | None = None, kind: str | None = None
    ) -> list[dict[str, Any]]:
        """Every audit record that matches, oldest first (all pages)."""
        params: dict[str, Any] = {
            k: v for k, v in (("since", since), ("tenant", tenant), ("kind", kind)) if v
        }
        out: list[dict[str, Any]] = []
        while True:
            page = await self.request("GET", "/v1/audit", params=params)
            out += page["audit"]
            if page.get("next_cursor") is None:
                return out
            params["cursor"] = page["next_cursor"]

    async def upload(self, path: str | Path, name: str | None = None) -> dict[str, Any]:
        """Upload a file (streamed from disk); returns `{id, name, size, sha256, ...}`. Put `{"$file": id}`
        in a task's input to hand it to the task."""
        from turnout.files import upload

        try:
            return await upload(self.http, Path(path), name=name)
        except httpx.ConnectError as exc:
            raise Unavailable(f"cannot reach the Turnout controller at {self.url}: {exc}") from None

    async def download(self, file_id: str, dest: str | Path) -> dict[str, Any]:
        """Download a file to `dest` (streamed to disk, its sha256 checked); returns `{id, size, sha256, path}`."""
        from turnout.files import download

        try:
            return await download(self.http, file_id, Path(dest))
        except httpx.ConnectError as exc:
            raise Unavailable(f"cannot reach the Turnout controller at {self.url}: {exc}") from None

    async def delete_file(self, file_id: str) -> dict[str, Any]:
        return await self.request("DELETE", f"/v1/files/{path_id(file_id, 'file id')}")

    async def run_pipeline(
        self, name: str, input: Any = None, *, wait: float | None = None, **options: Any
    ) -> dict[str, Any]:
        """Start a run of pipeline `name`; with `wait`, wait up to that many seconds for it to end.

        Answers the run: `state`, `stages` (each with device, worker, seconds and cost), `cost_usd`,
        `gpu_only_cost_usd`. `options`: `gpu` for stages that set none in the config."""
        wait = seconds_or_none(wait, "wait")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (wait or 0.0)
        run = await self.request("POST", f"/v1/pipelines/{pipeline_name(name)}/runs", json={"input": input, **options},
                                 params={"wait": min(WAIT_STEP_S, wait)} if wait else None)  # fmt: skip
        if not wait or run["state"] in TERMINAL:
            return run
        return await self.pipeline_run(run["id"], wait=max(0.0, deadline - loop.time()))

    async def pipeline_run(self, run_id: str, wait: float = 0) -> dict[str, Any]:
        """A run; waits up to `wait` seconds (in steps of at most 30 s) for it to end."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (seconds_or_none(wait, "wait") or 0.0)
        while True:
            step = max(0.0, min(WAIT_STEP_S, deadline - loop.time()))
            run = await self.request(
                "GET", f"/v1/pipeline-runs/{path_id(run_id, 'run id')}", params={"wait": step}
            )
            if run["state"] in TERMINAL or loop.time() >= deadline:
                return run

    async def pipeline_runs(self, **filters: Any) -> dict[str, Any]:
        return await self.request(
            "GET", "/v1/pipeline-runs", params={k: v for k, v in filters.items() if v is not None}
        )

    async def cancel_pipeline_run(self, run_id: str) -> dict[str, Any]:
        return await self.request("POST", f"/v1/pipeline-runs/{path_id(run_id, 'run id')}/cancel")

    async def events(self, task_id: str, after: int = 0) -> AsyncIterator[dict[str, Any]]:
        """The task's events as they happen (Server-Sent Events), resuming after `after`; ends after `finish`."""
        async for batch in self.event_batches(task_id, after):
            for event in batch:
                yield event

    async def event_batches(self, task_id: str, after: int = 0) -> AsyncGenerator[list[dict[str, Any]], None]:
        """`events` in the batches the network delivers, so a caller on another thread pays one hop per batch."""
        seen = after
        while True:
            headers = {"Last-Event-ID": str(seen)} if seen else {}
            try:
                async with self.http.stream(
                    "GET", f"/v1/tasks/{path_id(task_id, 'task id')}/events", headers=headers
                ) as resp:
                    if resp.status_code >= 400:
                        await resp.aread()
                        raise_for_error(resp, self.url)
                    if resp.status_code != 200 or "text/event-stream" not in resp.headers.get(
                        "content-type", ""
                    ):
                        raise NotAController(self.url, what_came(resp))
                    frames = _SseFrames()
                    async for chunk in resp.aiter_text():
                        batch = frames.feed(chunk)
                        for i, event in enumerate(batch):
                            seen = int(event.get("seq", seen))
                            if event.get("event") == "finish":
                                yield batch[: i + 1]
                                return
                        if batch:
                            yield batch
                return
            except (httpx.RemoteProtocolError, httpx.ReadError):
                continue  # the connection dropped: resume where we were


class _Coalescer:
    """Submissions in flight together, sent as batches.

    A call with nothing else on its way goes at once, alone (`POST /v1/tasks`: no added wait). Calls made while
    a submission is on its way gather for `window_s` and go as one `POST /v1/tasks/batch`. The batch route takes
    all or none, and a refusal names the task (`tasks.3.gpu`): that caller gets the error as a single submit
    would have said it (`gpu`), and the others are sent again without it. An error about the whole request
    (401, 429 past `rate_limit_wait_s`, 503) is every caller's, as it would have been for each alone; a body
    over the batch size limit is split in halves.
    """

    def __init__(self, client: AsyncClient, window_s: float) -> None:
        self.client = client
        self.window_s = window_s
        self.pending: list[tuple[dict[str, Any], asyncio.Future[dict[str, Any]]]] = []
        self.in_flight = 0
        self.sending: set[asyncio.Task[None]] = set()
        self.timer: asyncio.TimerHandle | None = None

    async def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.window_s <= 0 or (self.in_flight == 0 and not self.pending):
            self.in_flight += 1
            try:
                return await self.client.request("POST", "/v1/tasks", json=body)
            finally:
                self.in_flight -= 1
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict[str, Any]] = loop.create_future()
        self.pending.append((body, future))
        if len(self.pending) >= MAX_BATCH:
            self._flush()
        elif self.timer is None:
            self.timer = loop.call_later(self.window_s, self._flush)
        return await future

    def _flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        batch = [(body, future) for body, future in self.pending if not future.done()]  # a caller gave up
        self.pending = []
        if batch:
            task = asyncio.ensure_future(self._send(batch))
            self.sending.add(task)
            task.add_done_callback(self.sending.discard)

    async def drain(self) -> None:
        """Send what is gathered now and wait for every batch on its way (the client is closing)."""
        self._flush()
        if self.sending:
            await asyncio.gather(*self.sending, return_exceptions=True)

    async def _send(self, batch: list[tuple[dict[str, Any], asyncio.Future[dict[str, Any]]]]) -> None:
        self.in_flight += 1
        try:
            while batch:
                try:
                    if len(batch) == 1:
                        _settle(batch[0][1], await self.client.request("POST", "/v1/tasks", json=batch[0][0]))
                        return
                    body = {"tasks": [b for b, _ in batch]}
                    answer = await self.client.request("POST", "/v1/tasks/batch", json=body)
                except TurnoutError as exc:
                    refused = _task_of(exc, len(batch))
                    if refused is not None:  # that caller's own error; the others go again without it
                        _settle(batch.pop(refused[0])[1], refused[1])
                        continue
                    if (
                        isinstance(exc, PayloadTooLarge) and len(batch) > 1
                    ):  # the whole body: send it in halves
                        half = len(batch) // 2
                        await asyncio.gather(self._send(batch[:half]), self._send(batch[half:]))
                        return
                    for _, future in batch:
                        _settle(future, exc)
                    return
                except (
                    Exception
                ) as exc:  # the network (Unavailable, a timeout): every caller's, as for each alone
                    for _, future in batch:
                        _settle(future, exc)
                    return
                except BaseException as exc:  # cancelled (the client closing): its callers hear so, too
                    for _, future in batch:
                        _settle(future, exc)
                    raise
                for (_, future), task in zip(batch, answer["tasks"], strict=True):
                    _settle(future, task)
                return
        finally:
            self.in_flight -= 1


def _settle(future: asyncio.Future[dict[str, Any]], outcome: dict[str, Any] | BaseException) -> None:
    if future.done():
        return
    if isinstance(outcome, asyncio.CancelledError):
        future.cancel()
    elif isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _task_of(exc: TurnoutError, n: int) -> tuple[int, TurnoutError] | None:
    """(index, the error as a single submit would have said it) when `exc` names one task of a batch of `n`
    (`tasks.3.gpu`); None when it is about the whole request."""
    prefix, _, rest = (exc.field or "").partition(".")
    index, _, field = rest.partition(".")
    if prefix != "tasks" or not index.isdigit() or int(index) >= n or isinstance(exc, RateLimited):
        return None
    message = exc.message.removeprefix(f"tasks.{index}.")
    try:
        return int(index), type(exc)(message, field=field or None)
    except TypeError:  # an error class with a constructor of its own: keep it as it came
        return int(index), exc


class _SseFrames:
    """Splits a Server-Sent Events byte stream into the JSON `data` of each complete frame."""

    def __init__(self) -> None:
        self.buffer = ""

    def feed(self, chunk: str) -> list[dict[str, Any]]:
        self.buffer = (self.buffer + chunk).replace("\r\n", "\n")
        *complete, self.buffer = self.buffer.split("\n\n")
        out = []
        for frame in complete:
            data = [line[5:].lstrip() for line in frame.split("\n") if line.startswith("data:")]
            if data:
                out.append(json.loads("\n".join(data)))
        return out


async def _next(agen: AsyncGenerator[T, None]) -> T:
    return await agen.__anext__()


CLOSED = "this turnout Client is closed: make a new Client (or use it inside `with Client() as client:`)"


class _Loop:
    """A private event loop on a daemon thread, so the sync client can drive the async one.

    Once closed, its loop runs nothing: a call raises RuntimeError at once instead of waiting for ever on a
    loop that stopped, and a call still waiting when it closes (on another thread) raises the same."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="turnout-client", daemon=True)
        self.closed = False
        self._lock = threading.Lock()
        self._waiting: set[concurrent.futures.Future[Any]] = set()
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        with self._lock:
            if self.closed:
                coro.close()  # never started: no "never awaited" warning
                raise RuntimeError(CLOSED)
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
            self._waiting.add(future)
        try:
            return future.result()
        except concurrent.futures.CancelledError:
            if self.closed:
                raise RuntimeError(CLOSED) from None
            raise
        finally:
            with self._lock:
                self._waiting.discard(future)

    def close(self) -> None:
        """Stop the loop (once; again does nothing), and wake every call still waiting on it."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            waiting = list(self._waiting)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        for future in waiting:
            future.cancel()


class TaskHandle:
    def __init__(self, client: Client, handle: AsyncTaskHandle) -> None:
        self._client = client
        self._handle = handle
        self.id = handle.id

    @property
    def task(self) -> dict[str, Any]:
        return self._handle.task

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        return self._client._run(self._handle.result(timeout))

    def cancel(self) -> dict[str, Any]:
        return self._client._run(self._handle.cancel())

    def events(self, after: int = 0) -> Iterator[dict[str, Any]]:
        batches = self._client._async.event_batches(self.id, after)
        try:
            while True:
                try:
                    batch: list[dict[str, Any]] = self._client._run(_next(batches))
                except StopAsyncIteration:
                    return
                yield from batch
        finally:
            if not self._client.closed:  # a caller that stops early closes the stream now
                self._client._run(batches.aclose())


class Client:
    """Blocking facade over `AsyncClient`: the same methods (and options), one implementation."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout_s: float = 30.0,
        rate_limit_wait_s: float = 60.0,
        ca_cert: str | Path | None = None,
        submit_window_s: float = SUBMIT_WINDOW_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._loop = _Loop()
        options = {"timeout_s": timeout_s, "rate_limit_wait_s": rate_limit_wait_s, "ca_cert": ca_cert,
                   "submit_window_s": submit_window_s, "transport": transport}  # fmt: skip
        try:
            self._async = self._loop.run(_make_async(url, token, **options))
        except BaseException:
            self._loop.close()
            raise
        self.url = self._async.url

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run(coro)

    @property
    def closed(self) -> bool:
        return self._loop.closed

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Send what is gathered, close the connections and the private loop. Closing again does nothing; any
        other call after it (or a TaskHandle's) raises RuntimeError at once."""
        if self._loop.closed:
            return
        try:
            self._run(self._async.aclose())
        finally:
            self._loop.close()

    def submit(
        self, capability: str, input: Any = None, *, gpu: str | bool = "auto", **options: Any
    ) -> TaskHandle:
        return TaskHandle(self, self._run(self._async.submit(capability, input, gpu=gpu, **options)))

    def submit_batch(self, tasks: list[dict[str, Any]]) -> list[TaskHandle]:
        return [TaskHandle(self, h) for h in self._run(self._async.submit_batch(tasks))]

    def task(self, task_id: str) -> TaskHandle:
        return TaskHandle(self, AsyncTaskHandle(self._async, {"id": task_id}))

    def __getattr__(self, name: str) -> Any:
        """run, get_task, get_result, cancel, tasks, workers, capabilities, create_token, list_tokens, revoke_token,
        audit, run_pipeline, pipeline_run, pipeline_runs, cancel_pipeline_run, upload, download, delete_file: run
        the async twin."""
        if name.startswith("_"):  # not made yet (a constructor that failed), or private: never the async twin
            raise AttributeError(name)
        method = getattr(self._async, name)
        if not asyncio.iscoroutinefunction(method):
            raise AttributeError(name)
        return lambda *a, **kw: self._run(method(*a, **kw))


async def _make_async(url: str | None, token: str | None, **options: Any) -> AsyncClient:
    """The async client, made on the private loop's thread (its connections belong to that loop)."""
    return AsyncClient(url, token, **options)
