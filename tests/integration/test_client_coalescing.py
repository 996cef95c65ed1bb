"""The SDK's `submit()` calls made together go as one batch request, against a real controller on SQLite.

Each caller must still get its own task, or its own error worded as a single submit's would be; idempotency
keys and rate limits behave as they do for single submits, and a batch too large for the body limit is sent
in halves. Requests are counted with httpx's event hooks on the client's own connection.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.conftest import Cluster, Processes
from turnout.client import AsyncClient, AsyncTaskHandle, Client
from turnout.errors import Conflict, InvalidInput, RateLimited

CONFIG = """
limits:
  "*":  {submit_per_s: 10000}
  slow: {submit_per_s: 4}
"""
WINDOW_S = 0.05  # wide, so every call after the first in a gather lands in one batch on a busy machine


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A controller whose batch bodies are limited to 24 KiB, with a stand-in worker registering `coal`."""
    tmp = tmp_path_factory.mktemp("coalescing")
    (tmp / "turnout.yaml").write_text(CONFIG)
    procs = Processes()
    try:
        c = Cluster(tmp, procs, f"sqlite:///{tmp / 'turnout.db'}",
                    extra_args=["--config", str(tmp / "turnout.yaml"), "--request-limit", "max_batch_body_bytes=24Ki"])  # fmt: skip
        c.start_controller()
        body = {"name": "coal", "host": "h", "variants": [{"capability": "coal", "device": "cpu"}], "cpu": 1,
                "memory": 2**30}  # fmt: skip
        assert c.api("POST", "/v1/workers/register", json=body).status_code == 201
        yield c
    finally:
        procs.stop_all()


class Requests:
    """The submit requests a client made, and the statuses they got, by path."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.sent: list[str] = []
        self.statuses: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        http.event_hooks["request"].append(self._request)
        http.event_hooks["response"].append(self._response)

    async def _request(self, request: httpx.Request) -> None:
        with self._lock:
            self.sent.append(request.url.path)

    async def _response(self, response: httpx.Response) -> None:
        with self._lock:
            self.statuses.append((response.request.url.path, response.status_code))

    def count(self, path: str) -> int:
        return sum(1 for p in self.sent if p == path)


def gather(client: AsyncClient, calls: list[dict[str, Any]]) -> list[AsyncTaskHandle | BaseException]:
    async def go() -> list[AsyncTaskHandle | BaseException]:
        async with client:
            return await asyncio.gather(*(client.submit(**call) for call in calls), return_exceptions=True)

    return asyncio.run(go())


def test_submits_made_together_go_as_one_batch_and_each_caller_gets_its_own_task(controller: Cluster) -> None:
    client = AsyncClient(controller.url, controller.token, submit_window_s=WINDOW_S)
    requests = Requests(client.http)
    handles = gather(client, [{"capability": "coal", "input": {"i": i}} for i in range(20)])
    assert all(isinstance(h, AsyncTaskHandle) for h in handles), handles
    ids = [h.id for h in handles if isinstance(h, AsyncTaskHandle)]
    assert len(set(ids)) == 20
    for i, task_id in enumerate(ids):  # each caller's handle is its own task, not a neighbour's
        assert controller.api("GET", f"/v1/tasks/{task_id}").json()["input"] == {"i": i}
    assert requests.count("/v1/tasks/batch") >= 1
    assert requests.count("/v1/tasks") + requests.count("/v1/tasks/batch") < 20


def test_one_bad_task_in_a_batch_fails_only_its_own_caller_with_a_single_submits_error(
    controller: Cluster,
) -> None:
    calls: list[dict[str, Any]] = [
        {"capability": "coal", "input": {"i": 0}},
        {"capability": "coal", "input": {"i": 1}},
        {"capability": "coall", "input": {"i": 2}},  # no worker ever registered it (a typo)
        {"capability": "coal", "input": {"i": 3}},
        {"capability": "coal", "input": {"i": 4}, "gpu": "sometimes"},
        {"capability": "coal", "input": {"i": 5}, "timeout_s": -1},
        {"capability": "coal", "input": {"x": float("nan")}},  # refused here, never sent
        {"capability": "coal", "input": {"i": 7}},
    ]
    client = AsyncClient(controller.url, controller.token, submit_window_s=WINDOW_S)
    requests = Requests(client.http)
    out = gather(client, calls)

    assert requests.count("/v1/tasks/batch") >= 1
    for i in (0, 1, 3, 7):
        handle = out[i]
        assert isinstance(handle, AsyncTaskHandle), handle
        assert controller.api("GET", f"/v1/tasks/{handle.id}").json()["input"] == {"i": i}
    alone = controller.api("POST", "/v1/tasks", json={"capability": "coall", "input": {"i": 2}}).json()[
        "error"
    ]
    for i, field in ((2, "capability"), (4, "gpu"), (5, "timeout_s"), (6, "input.x")):
        error = out[i]
        assert isinstance(error, InvalidInput), (i, error)
        assert error.field == field and error.message.startswith(f"{field}:"), (i, error.field, error.message)
    assert isinstance(out[2], InvalidInput) and out[2].message == alone["message"]


def test_idempotency_keys_in_a_batch_answer_as_one_submit_after_another(controller: Cluster) -> None:
    key = "coalesced-key-1"
    calls = [
        {"capability": "coal", "input": {"i": 0}},
        {"capability": "coal", "input": {"same": True}, "idempotency_key": key},
        {"capability": "coal", "input": {"same": True}, "idempotency_key": key},  # the same request: its task
        {"capability": "coal", "input": {"same": False}, "idempotency_key": key},  # another request: 409
        {"capability": "coal", "input": {"i": 4}},
    ]
    out = gather(AsyncClient(controller.url, controller.token, submit_window_s=WINDOW_S), calls)
    first, again, other = out[1], out[2], out[3]
    assert isinstance(first, AsyncTaskHandle) and isinstance(again, AsyncTaskHandle)
    assert first.id == again.id
    assert isinstance(other, Conflict) and other.field == "idempotency_key", other
    assert isinstance(out[0], AsyncTaskHandle) and isinstance(out[4], AsyncTaskHandle)
    later = Client(controller.url, controller.token)  # a later single submit with the key finds the same task
    try:
        assert later.submit("coal", {"same": True}, idempotency_key=key).id == first.id
    finally:
        later.close()


def test_a_rate_limited_batch_waits_its_turn_as_each_submit_would(controller: Cluster) -> None:
    token = controller.api("POST", "/v1/tokens", json={"role": "submit", "tenant": "slow"}).json()["token"]
    impatient = AsyncClient(controller.url, token, submit_window_s=WINDOW_S, rate_limit_wait_s=0)
    requests = Requests(impatient.http)
    out = gather(impatient, [{"capability": "coal", "input": {"i": i}} for i in range(10)])
    limited = [e for e in out if isinstance(e, RateLimited)]
    assert limited and all(e.retry_after_s > 0 for e in limited)  # refused as a single submit is: 429, a wait
    assert all(isinstance(h, AsyncTaskHandle | RateLimited) for h in out), out
    made = [h.id for h in out if isinstance(h, AsyncTaskHandle)]
    listed = controller.api(
        "GET", "/v1/tasks", params={"limit": 1000}, headers={"Authorization": f"Bearer {token}"}
    )
    assert sorted(t["id"] for t in listed.json()["tasks"]) == sorted(made)  # refused means nothing was stored
    assert ("/v1/tasks/batch", 429) in requests.statuses

    patient = AsyncClient(controller.url, token, submit_window_s=WINDOW_S, rate_limit_wait_s=30)
    requests = Requests(patient.http)
    out = gather(patient, [{"capability": "coal", "input": {"i": i}} for i in range(10)])
    assert all(isinstance(h, AsyncTaskHandle) for h in out), out  # waited out the 429s, then all went in
    assert len({h.id for h in out if isinstance(h, AsyncTaskHandle)}) == 10
    assert any(status == 429 for _, status in requests.statuses)


def test_a_batch_over_the_body_limit_is_sent_in_halves(controller: Cluster) -> None:
    text = "x" * 5000  # ten of these are over the controller's 24 KiB for a batch body; three are not
    client = AsyncClient(controller.url, controller.token, submit_window_s=WINDOW_S)
    requests = Requests(client.http)
    out = gather(client, [{"capability": "coal", "input": {"i": i, "text": text}} for i in range(11)])
    assert all(isinstance(h, AsyncTaskHandle) for h in out), out
    assert ("/v1/tasks/batch", 413) in requests.statuses
    assert ("/v1/tasks/batch", 201) in requests.statuses


def test_the_sync_client_coalesces_submits_made_from_threads(controller: Cluster) -> None:
    barrier = threading.Barrier(12)
    with Client(controller.url, controller.token, submit_window_s=WINDOW_S) as client:
        requests = Requests(client._async.http)

        def one(i: int) -> tuple[int, str]:
            barrier.wait(timeout=30)
            return i, client.submit("coal", {"thread": i}).id

        with ThreadPoolExecutor(max_workers=12) as pool:
            made = dict(pool.map(one, range(12)))
    assert len(set(made.values())) == 12
    for i, task_id in made.items():
        assert controller.api("GET", f"/v1/tasks/{task_id}").json()["input"] == {"thread": i}
    assert requests.count("/v1/tasks/batch") >= 1
