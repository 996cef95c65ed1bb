"""The worker protocol against a hostile worker: one holding a tenant's `worker` token (a private worker of that
tenant) or a shared pool's credentials, talking to the controller directly. What it reports must never break
a commit, bill a negative cost, or tell it about another tenant.

The API in-process (tests/inprocess/conftest.py): who may do what, and what a report does, is decided in the
routes and the controller, not by the socket.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.inprocess.conftest import CPU_SHOUT, Api, Worker, serve_api
from turnout.config import ControllerSettings, Prices
from turnout.models import new_id
from turnout.pipelines import parse_pipelines

TWO_STAGES = parse_pipelines({"two": {"stages": [{"capability": "shout", "gpu": "never"}] * 2}})


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def private_worker(api: Api, tenant: str) -> Worker:
    """A worker registered with `tenant`'s worker token: it serves that tenant only."""
    token = await api.token("worker", tenant)
    body = {"name": f"w-{tenant}", "host": "h", "variants": [CPU_SHOUT], "cpu": 4, "memory": 2**33,
            "heartbeat_s": 1.0}  # fmt: skip
    resp = await api.as_(token, "POST", "/v1/workers/register", json=body)
    assert resp.status_code == 201, resp.text
    return Worker(api, resp.json()["id"], token, resp.json()["secret"])


def succeeded(lease: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"task_id": lease["id"], "attempt": lease["attempt"], "status": "succeeded", "output": {"o": 1},
            **fields}  # fmt: skip


@pytest.mark.anyio
async def test_a_report_naming_one_chained_id_for_two_stages_is_refused_not_a_failed_commit() -> None:
    # Given two runs whose first stages are leased to one worker, each with its next stage chainable there
    async with serve_api(ControllerSettings(heartbeat_s=1.0, pipelines=TWO_STAGES), recheck_s=30.0) as api:
        worker = await api.worker()
        runs = []
        for _ in range(2):
            resp = await api.client.post("/v1/pipelines/two/runs", json={"input": {"text": "hi"}})
            assert resp.status_code == 201, resp.text
            runs.append(resp.json()["id"])
        stages = (await worker.lease())["tasks"]
        assert len(stages) == 2 and all(s["chain"] for s in stages)
        # When one report names the same id as the stage each of them chained
        same = new_id("t_")
        resp = await worker.post(
            "complete", {"results": [succeeded(s, run_s=0.1, chain=same) for s in stages]}
        )
        # Then both results count, the chain is refused, and each run's next stage is queued as usual
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        assert sorted(answer["accepted"]) == sorted(s["id"] for s in stages)
        assert answer["chained"] == [] and set(answer["unchained"]) == {same}
        assert (await api.client.get(f"/v1/tasks/{same}")).status_code == 404
        for run_id in runs:
            run = (await api.client.get(f"/v1/pipeline-runs/{run_id}")).json()
            assert [s["state"] for s in run["stages"]] == ["succeeded", "queued"]
            assert run["stages"][1]["task_id"] != same


@pytest.mark.anyio
async def test_a_start_time_outside_the_lease_never_bills_a_negative_or_a_longer_run() -> None:
    # Given a priced CPU, and a tenant's private worker holding two of its tasks for 5 s
    settings = ControllerSettings(heartbeat_s=1.0, prices=Prices(cpu=0.01))
    async with serve_api(settings, recheck_s=30.0) as api:
        worker = await private_worker(api, "acme")
        submit = await api.token("submit", "acme")
        for _ in range(2):
            resp = await api.as_(submit, "POST", "/v1/tasks", json={"capability": "shout", "gpu": "never"})
            assert resp.status_code == 201, resp.text
        leases = (await worker.lease())["tasks"]
        assert len(leases) == 2
        api.clock.advance(5.0)
        # When its results say one started in the year 9999 and the other in 1970, with no run_s
        future, past = (
            succeeded(leases[0], started_at=253_402_300_000.0),
            succeeded(leases[1], started_at=1.0),
        )
        resp = await worker.post("complete", {"results": [future, past]})
        assert resp.status_code == 200 and len(resp.json()["accepted"]) == 2, resp.text
        # Then each ran within its lease: none for ever, none for less than nothing
        ran = [await api.task(le["id"]) for le in leases]
        assert ran[0]["run_s"] == 0.0 and ran[0]["cost_usd"] == 0.0
        assert ran[1]["run_s"] == pytest.approx(5.0) and ran[1]["cost_usd"] == pytest.approx(0.05)


@pytest.mark.anyio
async def test_a_private_worker_learns_nothing_of_another_tenants_task_from_its_lease() -> None:
    # Given a private worker of acme, and a queued task of bob's (for the shared pool) whose id acme learned
    async with serve_api(ControllerSettings(heartbeat_s=1.0), recheck_s=30.0) as api:
        await api.worker()
        worker = await private_worker(api, "acme")
        submit = await api.token("submit", "bob")
        resp = await api.as_(submit, "POST", "/v1/tasks", json={"capability": "shout", "gpu": "never"})
        assert resp.status_code == 201, resp.text
        bobs = resp.json()["id"]
        # When acme's worker says it runs that task, and one that does not exist
        answer = await worker.lease(running=[bobs, new_id("t_")])
        # Then both are answered alike: an existing task of another tenant is not there for it
        assert answer["cancel"] == []


@pytest.mark.anyio
async def test_what_a_private_worker_reports_is_not_another_tenants_profile() -> None:
    # Given a shared worker offering `shout`, and a private worker of acme offering it too
    async with serve_api(ControllerSettings(heartbeat_s=1.0), recheck_s=30.0) as api:
        await api.worker()
        acme = await private_worker(api, "acme")
        submit = await api.token("submit", "acme")
        resp = await api.as_(submit, "POST", "/v1/tasks", json={"capability": "shout", "gpu": "never"})
        assert resp.status_code == 201, resp.text
        [lease] = (await acme.lease())["tasks"]
        # When acme's worker reports its task ran for ten years
        resp = await acme.post("complete", {"results": [succeeded(lease, run_s=315_360_000.0)]})
        assert resp.json()["accepted"] == [lease["id"]], resp.text
        # Then bob, whose tasks of `shout` `auto` routes on that capability's profiles, sees none of it
        bob = await api.token("read", "bob")
        [shout] = (await api.as_(bob, "GET", "/v1/capabilities")).json()["capabilities"]
        assert shout["profiles"] == []
