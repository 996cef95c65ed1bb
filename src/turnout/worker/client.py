"""The worker's side of the worker protocol (README, "The worker protocol"): one object, one HTTP client.

Each method is one call, answered or raised (`httpx.HTTPError` for the network and the controller's 5xx
where the caller retries); the loops that retry, and what they do with the answers, are the agent's. The
transport is injectable, so a test drives an agent against `httpx.MockTransport` with no socket at all.
Registering records who the worker is (its id, and the secret every later call carries) and what the
controller's protocol offers beyond its first version (`features`). Where it offers the channel (a WebSocket,
`channel.py`) and the worker may use it, leases and reports go there, and over HTTP whenever it is not open.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import orjson

from turnout.access import WORKER_SECRET_HEADER
from turnout.errors import InvalidInput
from turnout.tls import async_client, bearer, context_of
from turnout.worker.channel import Channel, ChannelUnavailable

log = logging.getLogger("turnout.worker")
LIFELINE_READ_S = 15.0  # the controller pings the lifeline every 5 s; three missed pings: reconnect
REPORT_TIMEOUT_S = 30.0
JSON = {"Content-Type": "application/json"}
# a larger report goes over HTTP: one big frame would hold up the answers behind it
CHANNEL_MAX_BODY = 1024 * 1024
CHANNEL_HEADERS = ("authorization", WORKER_SECRET_HEADER.lower())  # who we are, on the channel too


class ControllerClient:
    """Register, heartbeat, lease, complete, events, scrubs, lifeline and leave, as the worker `worker_id`."""

    def __init__(
        self,
        controller_url: str,
        token: str | None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        ca_cert: Path | None = None,
        channel: bool = True,
    ) -> None:
        headers = bearer(token)
        # file transfers (`files.py`) share this client: the same connections, token and secret
        self.http = async_client(base_url=controller_url.rstrip("/"), headers=headers,
                                 timeout=httpx.Timeout(10.0, read=90.0), transport=transport,
                                 ca_cert=ca_cert)  # fmt: skip
        self.worker_id: str | None = None
        self._channel_requests: dict[tuple[str | None, str], httpx.Request] = {}
        self.features: frozenset[str] = frozenset()
        # a stand-in transport (tests) is reached only through httpx, so only a real controller gets a channel
        self.wants_channel = channel and transport is None
        self.channel: Channel | None = None

    def _path(self, call: str) -> str:
        return f"/v1/workers/{self.worker_id}/{call}"

    async def register(self, body: dict[str, Any]) -> dict[str, Any]:
        """Register (again, when `body` names our `worker_id`); raises InvalidInput when the controller refuses
        the worker itself (a bad token, a bad variant), which no retry can mend."""
        resp = await self.http.post("/v1/workers/register", json=body)
        if resp.status_code in (401, 403, 422):
            raise InvalidInput(f"controller refused registration: {resp.text}", field="worker")
        resp.raise_for_status()
        answer: dict[str, Any] = resp.json()
        self.worker_id = answer["id"]
        self.features = frozenset(answer.get("features") or ())
        # who we are, on every later call (registering again included): our token and this secret
        self.http.headers[WORKER_SECRET_HEADER] = answer["secret"]
        await self._open_channel()
        return answer

    async def _open_channel(self) -> None:
        """A channel for who we are now (a new registration may be a new id); opened at its first call."""
        if self.channel is not None:
            await self.channel.close()
            self.channel = None
        if self.wants_channel and "channel" in self.features:
            url = str(
                self.http.base_url.copy_with(scheme="wss" if self.http.base_url.scheme == "https" else "ws")
            )
            headers = {k: v for k, v in self.http.headers.items() if k.lower() in CHANNEL_HEADERS}
            self.channel = Channel(url.rstrip("/") + self._path("channel"), headers, context_of(self.http))

    def _channel_request(self, call: str) -> httpx.Request:
        """The request a channel answer is to (what its errors name), made once per call and worker id: joining
        the URL for each answer was a tenth of the worker's own CPU per task."""
        key = (self.worker_id, call)
        request = self._channel_requests.get(key)
        if request is None:
            request = httpx.Request("POST", self.http.base_url.join(self._path(call)))
            self._channel_requests[key] = request
        return request

    async def _post(self, call: str, body: bytes, timeout: httpx.Timeout | float) -> httpx.Response:
        """`POST /v1/workers/{id}/<call>`: over the channel when it is open, else (nothing sent) over HTTP."""
        if self.channel is not None and len(body) <= CHANNEL_MAX_BODY:
            wait_s = timeout.read if isinstance(timeout, httpx.Timeout) else timeout
            try:
                status, answer = await self.channel.call(call, body, wait_s or REPORT_TIMEOUT_S)
            except ChannelUnavailable:
                pass
            else:
                return httpx.Response(status, content=answer, request=self._channel_request(call))
        return await self.http.post(self._path(call), content=body, timeout=timeout, headers=JSON)

    async def heartbeat(self, metrics: dict[str, Any], quarantined: Any, timeout_s: float) -> bool:
        """Beat; False when the controller no longer knows this worker (register again)."""
        resp = await self.http.post(self._path("heartbeat"), json={"metrics": metrics, "quarantined": quarantined},
                                    timeout=timeout_s)  # fmt: skip
        return resp.status_code != 404

    async def lease(self, ask: dict[str, Any], wait_s: float) -> dict[str, Any] | None:
        """The long poll: `{tasks, cancel, backlog}` within about `wait_s`; None when the controller no longer
        knows this worker (register again)."""
        resp = await self._post(
            "lease",
            orjson.dumps({**ask, "wait_s": wait_s}),
            # an answer lost on a dead connection is given up soon after the controller would have sent it
            httpx.Timeout(10.0, read=wait_s + 15.0),
        )
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        answer: dict[str, Any] = resp.json()  # not orjson: a task's input may hold an integer past 64 bits
        return answer

    async def report(self, call: str, body: bytes) -> httpx.Response:
        """Post an encoded report (`complete`, `events`, `scrubs`); the caller (`delivery.py`) sorts the answer."""
        return await self._post(call, body, REPORT_TIMEOUT_S)

    async def hold_lifeline(self) -> bool:
        """Hold `GET .../lifeline` open until it breaks; whether the controller took it (404 until registered
        again, 5xx while it starts). Never raises but CancelledError: the caller's loop must outlive anything."""
        held = False
        try:
            async with self.http.stream("GET", self._path("lifeline"),
                                        timeout=httpx.Timeout(10.0, read=LIFELINE_READ_S)) as resp:  # fmt: skip
                held = resp.status_code == 200
                if held:
                    async for _ in resp.aiter_raw():
                        pass
        except httpx.HTTPError as exc:
            log.debug("lifeline to the controller broke: %s", exc)
        except Exception:  # without the lifeline, a death of this worker goes unseen for three heartbeats
            log.exception("lifeline to the controller failed")
        return held

    async def leave(self) -> None:
        """Say goodbye (best effort: a controller that is gone sees the lifeline drop instead)."""
        try:
            await self.http.post(self._path("leave"), timeout=5)
        except httpx.HTTPError as exc:
            log.debug("leaving: the controller did not answer (%s)", exc)

    async def aclose(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        await self.http.aclose()
