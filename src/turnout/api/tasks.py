"""Task routes: submit (one or a batch), read, wait for a result, list, cancel, and stream events.

    POST /v1/tasks?wait=S               (submit) one task -> 201 the task, once it ended or after S s (default 0)
    POST /v1/tasks/batch                (submit) {"tasks": [...]} -> 201 {"tasks": [...]} in the order sent
    GET  /v1/tasks?state=&capability=&limit=&cursor=   (read) newest first
    GET  /v1/tasks/{id}                 (read)
    GET  /v1/tasks/{id}/result?wait=S   (read) the task once terminal, or after S s
    POST /v1/tasks/{id}/cancel          (submit)
    GET  /v1/tasks/{id}/events          (read) Server-Sent Events; `Last-Event-ID` or `?after=N` resumes

A tenant sees only its own tasks: another tenant's id answers 404, as a missing one does.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse

from turnout.access import Action, Principal
from turnout.api.guards import Guards
from turnout.api.schemas import MAX_INT32, MAX_WAIT_S, FastJSON, TaskBatchIn, TaskIn, iso, task_out
from turnout.api.service import Service, Signal
from turnout.api.strictjson import StrictJsonRoute
from turnout.errors import InvalidInput, Unauthorized
from turnout.models import Task, TaskSpec, TaskState

EVENTS_PER_READ = 5000
SSE_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # an event name the stream's `event:` line carries as it is

# A batch of events shares one timestamp: format it once, not once per event.
iso_cached = functools.lru_cache(maxsize=256)(iso)


SubmitAnswer = Callable[[TaskIn, float, Principal], Awaitable[FastJSON]]  # (body, wait, caller)
ResultAnswer = Callable[[str, float, Principal], Awaitable[FastJSON]]


@dataclass(frozen=True)
class TaskRoutes:
    """The task routes, and the answers to a single submission and to a wait for a result, which `fastpath.py`
    also gives."""

    router: APIRouter
    submit: SubmitAnswer
    result: ResultAnswer


def router(service: Service, guards: Guards) -> TaskRoutes:
    api = APIRouter(route_class=StrictJsonRoute)
    ctrl = service.controller
    limits = ctrl.settings.request_limits
    need = guards.need

    async def submitted(tenant: str, specs: list[TaskSpec], **options: Any) -> list[Task]:
        """Queue the tasks; an idle worker's parked poll may lease them in the same commit (`Service.submit`),
        the others wake a poll that could take them."""
        return await service.submit(tenant, functools.partial(ctrl.submit, tenant, specs, **options),
                                    [(s.capability, tenant) for s in specs], queued=list)  # fmt: skip

    async def submit_answer(body: TaskIn, wait: float, p: Principal) -> FastJSON:
        """The task as submitted; with `wait`, as it stands once it ended or `wait` seconds passed: a client
        that wants the result at once needs no second request (`Client.run`)."""
        specs = [body.to_spec(limits)]
        # a 429 before the database: a flood costs the others nothing
        await service.admit(p.home_tenant, specs)
        (task,) = await submitted(p.home_tenant, specs, waits_for_capacity=[body.waits_for_capacity])
        if wait <= 0 or task.state.terminal:
            return FastJSON(task_out(task), status_code=201)
        # a task this request created has not ended before the wait below begins: no result for it can have
        # come in since its commit (were one to, on another replica, the wait's periodic look still finds it);
        # an idempotent repeat names an older task, which may end any moment: that one is read first
        try:
            return await result_answer(task.id, wait, p, status_code=201, fresh=body.idempotency_key is None)
        except Unauthorized:
            # its token was revoked while it waited: the submission stands, but nothing newer is told
            return FastJSON(task_out(task), status_code=201)

    @api.post("/v1/tasks", status_code=201, response_class=FastJSON)
    async def submit(
        body: TaskIn, wait: float = Query(0, ge=0, le=MAX_WAIT_S), p: Principal = need(Action.SUBMIT)
    ) -> FastJSON:
        return await submit_answer(body, wait, p)

    @api.post("/v1/tasks/batch", status_code=201, response_class=FastJSON)
    async def submit_batch(body: TaskBatchIn, p: Principal = need(Action.SUBMIT)) -> FastJSON:
        specs = body.to_specs(limits)
        await service.admit(p.home_tenant, specs)
        tasks = await submitted(p.home_tenant, specs, prefixes=[f"tasks.{i}." for i in range(len(body.tasks))],
                                waits_for_capacity=[t.waits_for_capacity for t in body.tasks])  # fmt: skip
        return FastJSON({"tasks": [task_out(t) for t in tasks]}, status_code=201)

    @api.get("/v1/tasks")
    async def list_tasks(
        state: str | None = None,
        capability: str | None = None,
        limit: int = Query(50, ge=1, le=1000),
        cursor: str | None = None,
        p: Principal = need(Action.READ),
    ) -> dict[str, Any]:
        if state is not None and state not in {s.value for s in TaskState}:
            raise InvalidInput(f"state: {state!r} is not a task state", field="state")
        tasks = await service.read(ctrl.list_tasks, p.scope, state=state, capability=capability, limit=limit,
                                   cursor=cursor)  # fmt: skip
        return {
            "tasks": [task_out(t) for t in tasks],
            "next_cursor": tasks[-1].id if len(tasks) == limit else None,
        }

    @api.get("/v1/tasks/{task_id}", response_class=FastJSON)
    async def get_task(task_id: str, p: Principal = need(Action.READ)) -> FastJSON:
        return FastJSON(task_out(await service.read(ctrl.get_task, p.scope, task_id)))

    @api.get("/v1/tasks/{task_id}/result", response_class=FastJSON)
    async def get_result(
        task_id: str, wait: float = Query(0, ge=0, le=MAX_WAIT_S), p: Principal = need(Action.READ)
    ) -> FastJSON:
        return await result_answer(task_id, wait, p)

    async def result_answer(
        task_id: str, wait: float, p: Principal, status_code: int = 200, *, fresh: bool = False
    ) -> FastJSON:
        """The task once it ended or `wait` seconds passed. `fresh`: this request created the task, which cannot
        have ended before the wait begins, so the wait begins without reading it."""
        deadline = time.monotonic() + wait
        with service.watch_tasks([task_id]) as ended:
            if fresh:
                await Signal.wait_any([ended, service.tasks_changed.current()], min(wait, service.recheck_s))
                await service.still_valid(p.token_id)
            while True:
                ended.clear()
                signal = service.tasks_changed.current()
                task = service.ended_task(task_id, p.scope)
                if task is None:
                    task = await service.read(ctrl.get_task, p.scope, task_id)
                left = deadline - time.monotonic()
                if task.state.terminal or left <= 0:
                    return FastJSON(task_out(task), status_code=status_code)
                await Signal.wait_any([ended, signal], min(left, service.recheck_s))
                await service.still_valid(p.token_id)  # a token revoked while it waited hears no more

    @api.post("/v1/tasks/{task_id}/cancel")
    async def cancel(task_id: str, p: Principal = need(Action.SUBMIT)) -> dict[str, Any]:
        task = await service.call(ctrl.cancel, p.scope, task_id, by=p.token_id)
        service.changed()
        return task_out(task)

    @api.get("/v1/tasks/{task_id}/events")
    async def events(
        request: Request,
        task_id: str,
        after: int = Query(0, ge=0, le=MAX_INT32),
        last_event_id: str | None = Header(None),
        p: Principal = need(Action.READ),
    ) -> StreamingResponse:
        await service.read(ctrl.get_task, p.scope, task_id)  # 404 before the stream starts
        start = max(after, _resume_from(last_event_id))
        return StreamingResponse(
            _stream(service, request, task_id, start, p.token_id),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    return TaskRoutes(api, submit_answer, result_answer)


def _resume_from(last_event_id: str | None) -> int:
    """The seq a reconnecting browser last saw (`Last-Event-ID`), 0 for none; anything else is a 422."""
    if not last_event_id:
        return 0
    digits = last_event_id.isascii() and last_event_id.isdigit() and len(last_event_id) <= 10
    if not digits or int(last_event_id) > MAX_INT32:
        raise InvalidInput(
            "Last-Event-ID: expected the seq number of the last event seen", field="Last-Event-ID"
        )
    return int(last_event_id)


async def _stream(
    service: Service, request: Request, task_id: str, start: int, token_id: str
) -> AsyncIterator[bytes]:
    """The task's events after `start`, as they are stored, ending with its `finish`; cut short (no `finish`)
    once the caller's token is revoked: a reconnect then hears the 401."""
    ctrl = service.controller
    seen = start
    while True:
        try:
            await service.still_valid(token_id)
        except Unauthorized:
            return
        signal = service.events_added.current()
        batch = await service.read(ctrl.events, task_id, seen, EVENTS_PER_READ)
        frames = []  # one write per batch: a chatty task costs the event loop little per event
        for seq, ts, body in batch:
            seen = seq
            frames.append(_frame(seq, ts, body))
            if body.get("event") == "finish":
                yield b"".join(frames)
                return
        if batch:
            yield b"".join(frames)
            continue
        task = await service.read(ctrl.get_task, None, task_id)
        if task.state.terminal:
            # Python handlers' results arrive as the task's completion, not as stored events: the
            # stream ends with a `finish` made from the task record, at the next seq, every time alike.
            if await service.read(ctrl.events, task_id, seen, 1):
                continue
            last = await service.read(ctrl.last_event_seq, task_id)
            if seen <= last:
                yield _frame(last + 1, task.finished_at, finish_event(task))
            return
        if await request.is_disconnected():
            return
        await Signal.wait(signal, service.recheck_s)


def _frame(seq: int, ts: float | None, body: dict[str, Any]) -> bytes:
    """One SSE frame. The `event:` line holds the event's name only where it is a plain word: a name a handler
    made up with a line break in it would otherwise end the line and write frames of its own (a forged
    `finish`). Any other name goes out as `message`, and as it was in the JSON of `data:`, which escapes it."""
    payload = {**body, "seq": seq, "ts": iso_cached(ts)}
    name = body.get("event")
    said = name if isinstance(name, str) and SSE_NAME.fullmatch(name) else "message"
    return f"id: {seq}\nevent: {said}\ndata: {json.dumps(payload)}\n\n".encode()


def finish_event(task: Task) -> dict[str, Any]:
    """The `finish` event a terminal task's stream ends with, made from its record."""
    if task.state is TaskState.SUCCEEDED:
        return {"event": "finish", "status": "completed", "output": task.output}
    return {"event": "finish", "status": "failed", "state": task.state.value, "error": task.error}
