"""A tenant that keeps sending submissions while refused hears its 429s held (`tenancy.RefusalPace`), so it sends
one a second per connection instead of as many as the controller can refuse; a client that waits out its 429s,
and every other tenant, is answered at once."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.inprocess.conftest import Api, serve_api
from turnout.config import ControllerSettings
from turnout.pipelines import parse_pipelines
from turnout.tenancy import RefusalPace, parse_limits

pytestmark = pytest.mark.anyio

HOLD_S = 0.3
SUBMIT = {"capability": "shout", "gpu": "never", "input": {}}


async def timed(api: Api, token: str) -> tuple[float, httpx.Response]:
    started = time.monotonic()
    resp = await api.as_(token, "POST", "/v1/tasks", json=SUBMIT)
    return time.monotonic() - started, resp


async def test_refusals_past_the_free_ones_are_held_and_another_tenant_is_answered_at_once() -> None:
    limits = parse_limits({"*": {"submit_per_s": 0.2}}, None)  # one submission, then 5 s to wait
    async with serve_api(ControllerSettings(heartbeat_s=1.0, tenant_limits=limits)) as api:
        api.service.pace = RefusalPace(free=3, hold_s=HOLD_S, max_held=4)
        await api.worker()
        flood, calm = await api.token("submit", "flood"), await api.token("submit", "calm")
        assert (await timed(api, flood))[1].status_code == 201
        # Given the flooding tenant's first refusals of this second, answered at once
        for _ in range(3):
            seconds, resp = await timed(api, flood)
            assert resp.status_code == 429 and seconds < HOLD_S, (seconds, resp.text)
        first_wait = resp.json()["error"]["retry_after_s"]
        # When it keeps sending, from six connections at once
        held = [asyncio.ensure_future(timed(api, flood)) for _ in range(6)]
        await asyncio.sleep(0.05)
        # Then another tenant's submission is answered at once meanwhile
        seconds, resp = await timed(api, calm)
        assert resp.status_code == 201 and seconds < HOLD_S
        assert api.service.pace.held == {"flood": 4}  # at most max_held at once
        # And the flood's refusals come: four after the hold, with that much less to wait; the rest at once
        answers = [await asyncio.wait_for(f, 5) for f in held]
        assert all(r.status_code == 429 and r.json()["error"]["type"] == "rate_limited" for _, r in answers)
        late = [(s, r) for s, r in answers if s >= HOLD_S]
        assert len(late) == 4, [s for s, _ in answers]
        assert all(r.json()["error"]["retry_after_s"] <= first_wait - HOLD_S + 0.05 for _, r in late)
        assert all(int(r.headers["Retry-After"]) >= 1 for _, r in answers)
        assert api.service.pace.held == {}


async def test_a_batch_and_a_pipeline_run_over_the_rate_are_paced_alike() -> None:
    limits = parse_limits({"*": {"submit_per_s": 0.2}}, None)
    one = parse_pipelines({"one": {"stages": [{"capability": "shout", "gpu": "never"}]}})
    async with serve_api(ControllerSettings(heartbeat_s=1.0, tenant_limits=limits, pipelines=one)) as api:
        api.service.pace = RefusalPace(free=1, hold_s=HOLD_S)
        await api.worker()
        token = await api.token("submit", "flood")
        assert (await timed(api, token))[1].status_code == 201
        assert (await timed(api, token))[1].status_code == 429  # the free one
        started = time.monotonic()
        batch = await api.as_(token, "POST", "/v1/tasks/batch", json={"tasks": [SUBMIT]})
        assert batch.status_code == 429 and time.monotonic() - started >= HOLD_S
        started = time.monotonic()
        run = await api.as_(token, "POST", "/v1/pipelines/one/runs", json={"input": {}})
        assert run.status_code == 429 and time.monotonic() - started >= HOLD_S
