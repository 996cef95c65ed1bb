"""A worker's reports: what JSON cannot carry becomes a clear task failure, and delivery never stalls on it.

The checks are pure functions tested as tables; delivery is tested against a stand-in controller
(`httpx.MockTransport`) that refuses what a real one would refuse, or is briefly away.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Collection
from typing import Any

import httpx
import pytest

from turnout.worker import delivery
from turnout.worker.delivery import Refusal, deliver
from turnout.worker.reports import (
    checked_completion,
    encode,
    event_problem,
    refused_completion,
    with_event_failure,
)
from turnout.worker.runner import result_lines


def completion(output: Any = None, *, status: str = "succeeded", error: Any = None) -> dict[str, Any]:
    return {"task_id": "t1", "attempt": 1, "status": status, "output": output, "error": error,
            "run_s": 0.1, "started_at": 1.0}  # fmt: skip


def strict_loads(line: str | bytes) -> Any:
    """What a strict reader (a browser, Go, jsonb) accepts: no NaN, no Infinity."""

    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return json.loads(line, parse_constant=refuse)


# ---- checks --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "field", "words"),
    [
        ({"x": float("nan")}, "output.x", "nan"),
        ({"scores": [0.5, float("-inf")]}, "output.scores.1", "-inf"),
        ({"text": "caf\ud800"}, "output.text", "surrogate"),
        ({"tags": {"a"}}, "output.tags", "set"),
        ({"blob": b"\x00"}, "output.blob", "bytes"),
        ([{"deep": object()}], "output.0.deep", "object"),
        ({1: "one"}, "output", "key 1"),
    ],
)
def test_an_output_json_cannot_carry_fails_the_task_naming_the_path(
    output: Any, field: str, words: str
) -> None:
    checked = checked_completion(completion(output))
    assert checked["status"] == "failed" and checked["output"] is None
    assert checked["error"]["type"] == "invalid_output"
    assert checked["error"]["field"] == field
    assert checked["error"]["message"].startswith(f"{field}: ") and words in checked["error"]["message"]
    strict_loads(encode(checked))  # the failure itself always goes over the wire


def test_a_completion_json_can_carry_is_sent_unchanged_with_any_extra_field() -> None:
    clean = {**completion({"x": 1.5, "items": [None, True, "é"]}), "isolation": "sandbox"}
    assert checked_completion(clean) is clean


def test_an_extra_field_json_cannot_carry_is_named_by_its_key() -> None:
    checked = checked_completion({**completion({"x": 1}), "isolation": float("nan")})
    assert checked["status"] == "failed" and checked["error"]["field"] == "isolation"


def test_an_error_json_cannot_carry_becomes_invalid_output_that_still_names_the_reported_type() -> None:
    checked = checked_completion(completion(status="failed", error={"type": "gpu_oom", "free": float("nan")}))
    assert checked["error"]["type"] == "invalid_output"
    assert checked["error"]["field"] == "error.free"
    assert "'gpu_oom'" in checked["error"]["message"]


def test_a_lone_surrogate_key_yields_an_error_that_can_itself_be_sent() -> None:
    checked = checked_completion(completion({"bad\udc80key": 1}))
    assert checked["error"]["type"] == "invalid_output"
    assert checked["error"]["field"] == "output.bad\\udc80key"
    strict_loads(encode(checked))


def test_an_event_json_cannot_carry_is_named_by_its_place_in_the_attempt_and_its_kind() -> None:
    where = event_problem({"event": "progress", "done": float("nan"), "total": 3}, 4)
    assert where is not None
    path, why = where
    assert path == "events.4.done"
    assert "'progress' event" in why and "4th" in why
    assert event_problem({"event": "progress", "done": 1, "total": 3}, 4) is None


def test_a_success_whose_event_was_dropped_fails_and_a_failure_keeps_its_own_error() -> None:
    dropped = {"type": "invalid_output", "message": "events.2.done: ...", "field": "events.2.done"}
    assert with_event_failure(completion({"ok": 1}), dropped)["error"] == dropped
    own = {"type": "gpu_oom", "message": "CUDA out of memory"}
    assert with_event_failure(completion(status="failed", error=own), dropped)["error"] == own
    clean = completion({"ok": 1})
    assert with_event_failure(clean, None) is clean


def test_a_refused_completion_is_replaced_by_a_small_failure_naming_the_controllers_words() -> None:
    big = completion({"rows": ["x" * 1000] * 10})
    replacement = refused_completion(big, 413, "body larger than 1 MiB", "results.0.output")
    assert replacement == {"task_id": "t1", "attempt": 1, "status": "failed", "output": None,
                           "error": replacement["error"]}  # fmt: skip
    assert replacement["error"]["type"] == "invalid_output"
    assert replacement["error"]["field"] == "output"
    assert "413: body larger than 1 MiB" in replacement["error"]["message"]


# ---- the runner's result lines ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("result", "field"),
    [
        ({"x": float("nan")}, "output.x"),
        ({"s": "\udcff"}, "output.s"),
        ({"tags": {1, 2}}, "output.tags"),
        ({"model": object()}, "output.model"),
    ],
)
def test_the_runner_writes_a_failed_finish_instead_of_a_result_json_cannot_carry(
    result: Any, field: str
) -> None:
    lines = result_lines(result, 0.25)
    assert len(lines) == 1
    finish = strict_loads(lines[0])
    assert finish["event"] == "finish" and finish["status"] == "failed"
    assert finish["error"]["type"] == "invalid_output" and finish["error"]["field"] == field
    assert finish["run_s"] == 0.25


@pytest.mark.skipif(
    not hasattr(sys, "get_int_max_str_digits"), reason="this Python prints ints of any length"
)
def test_the_runner_fails_a_result_with_an_int_too_long_to_print() -> None:
    finish = strict_loads(result_lines({"n": 10**5000}, 0.0)[0])
    assert finish["error"]["type"] == "invalid_output" and finish["error"]["field"] == "output.n"


def test_the_runner_writes_a_clean_result_and_its_finish_as_strict_json() -> None:
    lines = result_lines({"x": [1, 2.5, "é"]}, 0.5)
    assert [strict_loads(line)["event"] for line in lines] == ["result", "finish"]
    assert strict_loads(lines[0])["data"] == {"x": [1, 2.5, "é"]}


# ---- delivery against a stand-in controller --------------------------------------------------------------


class StandIn:
    """A controller that stores `results`, refuses (422) any batch holding a result marked `refuse`, and
    answers 503 to the first `unavailable` requests."""

    def __init__(self, unavailable: int = 0, drop_connections: int = 0) -> None:
        self.stored: list[dict[str, Any]] = []
        self.requests = 0
        self.unavailable = unavailable
        self.drop_connections = drop_connections

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        if self.drop_connections:
            self.drop_connections -= 1
            raise httpx.ConnectError("connection refused", request=request)
        if self.unavailable:
            self.unavailable -= 1
            return httpx.Response(
                503, json={"error": {"type": "storage_unavailable", "message": "disk full"}}
            )
        results = strict_loads(request.content)["results"]
        for i, r in enumerate(results):
            if (r.get("output") or {}).get("refuse"):
                error = {
                    "type": "invalid_input",
                    "message": "output: too large",
                    "field": f"results.{i}.output",
                }
                return httpx.Response(422, json={"error": error})
        self.stored += results
        return httpx.Response(200, json={"accepted": [r["task_id"] for r in results], "refused": []})


def send(stand_in: StandIn, items: list[dict[str, Any]], replace: delivery.Replace) -> None:
    async def go() -> None:
        transport = httpx.MockTransport(stand_in.handle)
        async with httpx.AsyncClient(transport=transport, base_url="http://controller") as http:

            async def post(body: bytes) -> httpx.Response:
                return await http.post("/v1/workers/w/complete", content=body)

            await asyncio.wait_for(deliver(post, "results", items, replace, "results"), timeout=20)

    asyncio.run(go())


def as_failure(item: dict[str, Any], refusal: Refusal) -> dict[str, Any] | None:
    return refused_completion(item, refusal.status, refusal.message, refusal.field)


def numbered(n: int, refuse: Collection[int] = ()) -> list[dict[str, Any]]:
    return [{**completion({"n": i, "refuse": i in refuse}), "task_id": f"t{i}"} for i in range(n)]


def test_a_refused_result_is_isolated_and_replaced_while_the_rest_of_its_batch_is_stored_in_order() -> None:
    stand_in = StandIn()
    send(stand_in, numbered(16, refuse={5}), as_failure)
    assert [r["task_id"] for r in stand_in.stored] == [f"t{i}" for i in range(16)]
    replaced = stand_in.stored[5]
    assert replaced["status"] == "failed" and replaced["error"]["type"] == "invalid_output"
    assert "422: output: too large" in replaced["error"]["message"] and replaced["error"]["field"] == "output"
    assert all(r["status"] == "succeeded" for i, r in enumerate(stand_in.stored) if i != 5)
    assert stand_in.requests <= 2 * 4 + 2  # halving 16 items: a few requests, not a retry loop


def test_a_replacement_that_is_refused_again_is_dropped_not_retried_forever() -> None:
    stand_in = StandIn()
    send(stand_in, numbered(3, refuse={1}), lambda item, refusal: item)  # offers the same item again
    assert [r["task_id"] for r in stand_in.stored] == ["t0", "t2"]
    assert stand_in.requests <= 6


def test_a_dropped_item_leaves_the_rest_delivered() -> None:
    stand_in = StandIn()
    send(stand_in, numbered(4, refuse={0, 3}), lambda item, refusal: None)
    assert [r["task_id"] for r in stand_in.stored] == ["t1", "t2"]


def test_an_item_json_cannot_encode_is_replaced_without_reaching_the_wire() -> None:
    stand_in = StandIn()
    items = numbered(3)
    items[1]["output"] = {"x": float("nan")}  # a bug upstream let it through: the sender still must not die
    send(stand_in, items, as_failure)
    assert [r["task_id"] for r in stand_in.stored] == ["t0", "t1", "t2"]
    assert stand_in.stored[1]["error"]["field"] == "output.x"


def test_an_unavailable_controller_and_dropped_connections_are_retried_until_stored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(delivery, "FIRST_BACKOFF_S", 0.01)
    stand_in = StandIn(unavailable=2, drop_connections=2)
    send(stand_in, numbered(3), as_failure)
    assert [r["status"] for r in stand_in.stored] == ["succeeded"] * 3
    assert stand_in.requests == 5
