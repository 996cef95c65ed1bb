"""Pipeline routes: start a run, read one, list them, cancel one; and the configured pipelines.

POST /v1/pipelines/{name}/runs?wait=S     {input, gpu?}  -> the run (201), after at most S s of waiting
GET  /v1/pipeline-runs/{id}?wait=S        the run: stages with their cost, cost_usd, gpu_only_cost_usd
GET  /v1/pipeline-runs?state=&limit=&cursor=
POST /v1/pipeline-runs/{id}/cancel        cancels the stage in flight and those not started
GET  /v1/pipelines                        what turnout.yaml configures
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Query

from turnout.access import Action, Principal
from turnout.api.guards import Guards
from turnout.api.schemas import GPU_SCHEMA, MAX_WAIT_S, FastJSON, Strict, check_task_size, device_of, iso
from turnout.api.service import Service, Signal
from turnout.api.strictjson import StrictJsonRoute
from turnout.config import Prices
from turnout.errors import InvalidInput, Unauthorized
from turnout.models import GpuMode, Task, new_id
from turnout.pipelines import PipelineRun, RunState, run_costs, stage_gpu


class RunIn(Strict):
    input: Any = None
    gpu: Annotated[Any, GPU_SCHEMA] = None  # for stages whose config sets no gpu of their own


StartAnswer = Callable[[str, RunIn, float, Principal], Awaitable[FastJSON]]  # (pipeline, body, wait, caller)


@dataclass(frozen=True)
class PipelineRoutes:
    """The pipeline routes, and the answer to a run's start, which `fastpath.py` also gives."""

    router: APIRouter
    start: StartAnswer


def router(service: Service, guards: Guards) -> PipelineRoutes:
    """The pipeline routes. A run belongs to the tenant that started it: another tenant's run answers 404,
    as its tasks do."""
    api = APIRouter(route_class=StrictJsonRoute)
    need = guards.need
    ctrl = service.controller
    runs = ctrl.runs
    limits = ctrl.settings.request_limits

    async def answer(
        tenant: str | None, run_id: str, wait: float, token_id: str, status_code: int = 200
    ) -> FastJSON:
        """The run once it ends or `wait` seconds pass, encoded in one step (a waiting client is on the clock).
        A wait whose token (`token_id`) is revoked meanwhile ends with a 401, as its next request would."""
        deadline = time.monotonic() + wait
        with service.watch_tasks([run_id]) as ended:  # a result that ends one of its stages names the run
            while True:
                ended.clear()
                signal = service.tasks_changed.current()
                view = service.ended_run(run_id, tenant)
                run, tasks = view if view is not None else await service.read(_run_and_tasks, tenant, run_id)
                left = deadline - time.monotonic()
                if run.state.terminal or left <= 0:
                    return FastJSON(run_out(run, tasks, ctrl.settings.prices), status_code=status_code)
                await Signal.wait_any([ended, signal], min(left, service.recheck_s))
                await service.still_valid(token_id)

    def _run_and_tasks(tenant: str | None, run_id: str) -> tuple[PipelineRun, list[Task | None]]:
        run = runs.get(tenant, run_id)
        return run, runs.tasks_of(run, bare=True)  # the answer shows no stage's input or output

    @api.get("/v1/pipelines")
    async def pipelines(p: Principal = need(Action.READ)) -> dict[str, Any]:
        return {"pipelines": [{"name": pl.name, "stages": [s.to_dict() for s in pl.stages]}
                              for pl in ctrl.settings.pipelines.values()]}  # fmt: skip

    @api.post("/v1/pipelines/{name}/runs", status_code=201, response_class=FastJSON)
    async def start(
        name: str,
        body: RunIn,
        wait: float = Query(0, ge=0, le=MAX_WAIT_S),
        p: Principal = need(Action.SUBMIT),
    ) -> FastJSON:
        return await start_answer(name, body, wait, p)

    async def start_answer(name: str, body: RunIn, wait: float, p: Principal) -> FastJSON:
        check_task_size(body.input, {}, limits)
        gpu = GpuMode.parse(body.gpu, "gpu") if body.gpu is not None else None
        first = runs.pipeline(name).stages[0]  # 404 for a pipeline not configured, before any token is taken
        # the run is one submission (its first stage's, GPU-only where that stage is); the stages the
        # controller queues after it are not the client's submissions: only max_gpus and the allocation
        # rate hold them, at lease time, as for any task
        await service.admit_counts(p.home_tenant, 1, int(stage_gpu(first, gpu) is GpuMode.REQUIRE))
        deadline = time.monotonic() + wait
        run_id = new_id("r_")
        with service.watch_tasks([run_id]) as ended:  # from before it exists: it may end before we look
            signal = service.tasks_changed.current()
            # an idle worker's parked poll may lease its first stage in the same commit
            run, first_task = await service.submit(p.home_tenant,
                                 functools.partial(runs.start, p.home_tenant, name, body.input, gpu, run_id=run_id),
                                 [(first.capability, p.home_tenant)], queued=lambda started: [started[1]])  # fmt: skip
            try:
                if wait > 0:  # a run just started is running: nothing to read before it could have ended
                    await Signal.wait_any([ended, signal], min(wait, service.recheck_s))
                    await service.still_valid(p.token_id)
                return await answer(p.scope, run_id, max(0.0, deadline - time.monotonic()), p.token_id, 201)
            except Unauthorized:  # its token was revoked as it waited: the run stands, nothing newer is told
                stages: list[Task | None] = [first_task, *([None] * (len(run.stages) - 1))]
                return FastJSON(run_out(run, stages, ctrl.settings.prices), status_code=201)

    @api.get("/v1/pipeline-runs")
    async def list_runs(
        state: str | None = None,
        limit: int = Query(50, ge=1, le=1000),
        cursor: str | None = None,
        p: Principal = need(Action.READ),
    ) -> dict[str, Any]:
        if state is not None and state not in {s.value for s in RunState}:
            raise InvalidInput(f"state: {state!r} is not a run state ({', '.join(s.value for s in RunState)})",
                               field="state")  # fmt: skip
        found = await service.read(_list_with_tasks, p.scope, state, limit, cursor)
        return {
            "pipeline_runs": [run_out(run, tasks, ctrl.settings.prices) for run, tasks in found],
            "next_cursor": found[-1][0].id if len(found) == limit else None,
        }

    def _list_with_tasks(tenant: str | None, state: str | None, limit: int,
                         cursor: str | None) -> list[tuple[PipelineRun, list[Task | None]]]:  # fmt: skip
        return [
            (r, runs.tasks_of(r, bare=True))
            for r in runs.list(tenant, state=state, limit=limit, cursor=cursor)
        ]

    @api.get("/v1/pipeline-runs/{run_id}", response_class=FastJSON)
    async def get_run(
        run_id: str, wait: float = Query(0, ge=0, le=MAX_WAIT_S), p: Principal = need(Action.READ)
    ) -> FastJSON:
        return await answer(p.scope, run_id, wait, p.token_id)

    @api.post("/v1/pipeline-runs/{run_id}/cancel", response_class=FastJSON)
    async def cancel(run_id: str, p: Principal = need(Action.SUBMIT)) -> FastJSON:
        await service.call(runs.cancel, p.scope, run_id, by=p.token_id)
        service.changed()
        return await answer(p.scope, run_id, 0, p.token_id)

    return PipelineRoutes(api, start_answer)


def run_out(run: PipelineRun, tasks: Sequence[Task | None], prices: Prices) -> dict[str, Any]:
    """A run as the API answers it: each stage with where it ran and what it cost, and the totals."""
    cost, gpu_only = run_costs(prices, tasks)
    stages = []
    for i, (stage, task) in enumerate(zip(run.stages, tasks, strict=True)):
        entry: dict[str, Any] = {"index": i, "capability": stage.capability, "state": "pending", "task_id": None,
                                 "device": None, "gpu_model": None, "worker": None, "queue_s": None,
                                 "cold_start_s": None, "run_s": None, "cost_usd": None, "reason": None,
                                 "attempts": 0, "error": None}  # fmt: skip
        if task is not None:
            start = task.started_at or task.leased_at or task.finished_at
            entry.update(state=task.state.value, task_id=task.id, device=device_of(task), gpu_model=task.gpu_model,
                         worker=task.worker_id, queue_s=_round(start - task.created_at if start else None),
                         cold_start_s=_round(task.cold_start_s), run_s=_round(task.run_s), cost_usd=task.cost_usd,
                         reason=task.routing.reason if task.routing else None, attempts=task.attempts, error=task.error,
                         batch_size=(task.usage or {}).get("batch_size"))  # fmt: skip
        stages.append(entry)
    saving = None if cost is None or gpu_only is None else round(gpu_only - cost, 10)
    return {
        "id": run.id, "pipeline": run.pipeline, "tenant": run.tenant, "state": run.state.value, "input": run.input,
        "output": run.output, "error": run.error, "gpu": run.gpu.value if run.gpu else None, "stages": stages,
        "cost_usd": cost, "gpu_only_cost_usd": gpu_only, "saving_usd": saving,
        "run_s": _round(sum(t.run_s or 0.0 for t in tasks if t is not None)),
        "duration_s": _round((run.finished_at - run.created_at) if run.finished_at else None),
        "created_at": iso(run.created_at), "finished_at": iso(run.finished_at),
    }  # fmt: skip


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)
