"""The worker protocol (README, "Worker protocol"): what a worker agent calls, and only the worker itself.

    POST /v1/workers/register            (worker token) -> 201 {id, heartbeat_s, secret, serves, features}
    POST /v1/workers/{id}/heartbeat      {metrics?, quarantined?} -> {state, heartbeat_s}
    POST /v1/workers/{id}/lease          {max_tasks, running, wait_s, prefetch?, prefetch_s?, waiting?,
                                          prefetch_gpu?} long poll -> {tasks, cancel, backlog}
    POST /v1/workers/{id}/complete       {results, lease?} -> {accepted, refused} (and with lease: the next work)
    POST /v1/workers/{id}/events         {events: [{task_id, attempt, event}]} -> {stored}
    POST /v1/workers/{id}/scrubs         GPU scrubs it ran between tenants -> {stored}
    POST /v1/workers/{id}/leave          -> {ok}
    GET  /v1/workers/{id}/lifeline       held open while the worker lives (api/lifeline.py)

Every route but register proves the caller is the worker in the path: its registering token and the
`X-Worker-Secret` that register answered (another worker's routes answer 403).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Header, Request

from turnout.access import Action, Principal, worker_serves
from turnout.api.guards import Guards
from turnout.api.metrics import Metrics
from turnout.api.schemas import (
    EVENTS_BODY,
    WORKER_FEATURES,
    CompleteIn,
    FastJSON,
    HeartbeatIn,
    LeaseIn,
    RegisterIn,
    ScrubsIn,
    leases_out,
    parse_events,
)
from turnout.api.service import Service, Signal
from turnout.api.strictjson import StrictJsonRoute, json_body
from turnout.auth import WorkerCredential
from turnout.controller import LeaseResult, new_id
from turnout.errors import InvalidInput
from turnout.models import Worker
from turnout.runs import MAX_NOTED

CompleteAnswer = Callable[[str, CompleteIn, WorkerCredential], Awaitable[FastJSON]]
LeaseAnswer = Callable[[str, LeaseIn, WorkerCredential], Awaitable[FastJSON]]
EventItem = tuple[str, int, dict[str, Any]]  # (task_id, attempt, event), as `parse_events` checked it
EventsAnswer = Callable[[str, list[EventItem], WorkerCredential], Awaitable[FastJSON]]
LISTED_BEFORE_S = 5.0  # how long before its poll reached us a worker may have written the poll's `running`


@dataclass(frozen=True)
class WorkerRoutes:
    """The protocol's router, and the answers to a report (`complete`), a lease and an event batch, which
    `fastpath.py` also gives."""

    router: APIRouter
    complete: CompleteAnswer
    lease: LeaseAnswer
    events: EventsAnswer


def router(service: Service, guards: Guards, metrics: Metrics) -> WorkerRoutes:
    api = APIRouter(route_class=StrictJsonRoute)
    ctrl = service.controller
    limits = ctrl.settings.request_limits
    this_worker = guards.this_worker

    @api.post("/v1/workers/register", status_code=201)
    async def register(
        body: RegisterIn,
        p: Principal = guards.need(Action.WORKER),
        x_worker_secret: str | None = Header(
            None, description="registering again: the secret answered before"
        ),
    ) -> dict[str, Any]:
        variants = body.to_variants()

        def run() -> tuple[Worker, str, str]:
            cred, secret = service.workers.claim(p, body.worker_id or new_id("w_"), x_worker_secret)
            worker = ctrl.register_worker(
                name=body.name, host=body.host, variants=variants, cpu=body.cpu, memory_bytes=body.memory,
                gpus=[g.model_dump() for g in body.gpus], strategy=body.strategy, heartbeat_s=body.heartbeat_s,
                worker_id=cred.worker_id, tenant=cred.tenant,
            )  # fmt: skip
            return worker, secret, cred.tenant

        worker, secret, serves = await service.call(run)
        service.registered(worker)
        service.changed()
        return {"id": worker.id, "heartbeat_s": worker.heartbeat_s, "secret": secret, "serves": serves,
                "features": list(WORKER_FEATURES)}  # fmt: skip

    @api.post("/v1/workers/{worker_id}/heartbeat")
    async def heartbeat(
        worker_id: str, body: HeartbeatIn, me: WorkerCredential = this_worker()
    ) -> dict[str, Any]:
        # counted as it arrives, and answered without waiting behind slow writes (see Service.heartbeat)
        state, heartbeat_s = await service.heartbeat(
            worker_id,
            metrics=body.metrics.model_dump() if body.metrics else None,
            quarantined=body.quarantined,
        )
        return {"state": state, "heartbeat_s": heartbeat_s}

    def leased(result: LeaseResult) -> None:
        """Tasks went to a worker (by a lease poll or a completion's lease): their watchers and metrics hear."""
        if result.leases:
            metrics.observe_leases(result.leases)

    @api.post("/v1/workers/{worker_id}/lease", response_class=FastJSON)
    async def lease(worker_id: str, body: LeaseIn, me: WorkerCredential = this_worker()) -> FastJSON:
        listed_at = ctrl.clock()  # `running` is as of now, however long the poll waits
        arrived = time.monotonic()
        handed_upto = 0  # the hand-overs to its worker this poll has taken into `watching`
        deadline = time.monotonic() + min(body.wait_s, ctrl.settings.max_lease_wait_s)
        running = list(body.running)
        waiting = list(body.waiting)  # of `running`, what has not started there yet
        watching: list[str] = []  # leased to it since `running` was written: it may hold them unlisted
        mine = service.worker_signal(worker_id)
        since = body.since  # its last answer's epoch: unchanged, there is nothing new to look for yet

        def look_now() -> Callable[[], LeaseResult]:
            """This poll's look at the queue, as a call for the database thread: made by the poll itself, or
            by a submission in its own commit while the poll is parked (`Service.submit`)."""
            nonlocal watching, handed_upto
            # what the worker got outside its polls since it wrote `running` (a little before it came)
            handed, handed_upto = service.handed_since(worker_id, arrived - LISTED_BEFORE_S, handed_upto)
            watching = list(dict.fromkeys([*watching, *handed]))
            return functools.partial(ctrl.offer, worker_id, max_tasks=body.max_tasks, running=list(running),
                                     tenant=me.tenant, listed_at=listed_at, watching=list(watching),
                                     prefetch=body.prefetch, prefetch_s=body.prefetch_s,
                                     waiting=list(waiting), prefetch_gpu=body.prefetch_gpu)  # fmt: skip

        with service.queue_poll(worker_id, me.tenant) as poll:
            while True:
                queue, stops, capacity = (
                    service.queue_changed.current(),
                    service.changes.current(),
                    mine.current(),
                )
                woken_for = poll.look(
                    service.polls_epoch
                )  # new tasks it was woken for (`Service.tasks_queued`)
                delivered = poll.take_delivery()  # a look a submission made for it in its commit
                # what fires from now on, this look may not have seen
                epoch = delivered.epoch if delivered is not None else service.polls_epoch.token()
                if delivered is None and since == epoch and not woken_for:
                    result = LeaseResult(looked=True)  # what its last look found still holds: nothing more
                else:
                    with service.leasing(worker_id):
                        result = await (
                            delivered.answer if delivered is not None else service.call(look_now())
                        )
                since = None
                if unseen := poll.looked(result, woken_for):
                    service.pass_on(unseen, poll)
                gone = {*result.cancel, *result.finished}
                running = [tid for tid in running if tid not in gone]
                waiting = [tid for tid in waiting if tid not in gone]
                watching = [tid for tid in dict.fromkeys([*watching, *result.fresh]) if tid not in gone]
                left = deadline - time.monotonic()
                if result.leases or result.cancel or left <= 0 or service.closing.is_set():
                    leased(result)
                    answer = leases_out(result)
                    if (
                        result.looked and not result.backlog and not result.full
                    ):  # it took all there was for it
                        answer["since"] = epoch
                    return FastJSON(answer)
                # a full worker waits for its own capacity (or a cancel, a timeout, a fleet change), not for every
                # new task: under a flood of submissions that would re-run its lease for nothing, hundreds of times
                # a second; one with room, for a new task it could take, or any other change to the queue
                wake = [stops, capacity] if result.full else [poll.event, queue, capacity]
                # a batch still filling is leased once full or its wait is over: ask again by then (retry_in_s)
                with service.parked(worker_id, result):
                    # while it waits for new tasks, a submission may make its look for it (Service.submit)
                    poll.ask = None if result.full else look_now
                    try:
                        await Signal.wait_any([*wake, service.closing],
                                              min(left, service.recheck_s, result.retry_in_s or service.recheck_s))  # fmt: skip
                    finally:
                        poll.ask = None
                await service.still_valid(me.token_id)  # a worker whose token was revoked takes no more tasks

    @api.post("/v1/workers/{worker_id}/complete", response_class=FastJSON)
    async def complete(worker_id: str, body: CompleteIn, me: WorkerCredential = this_worker()) -> FastJSON:
        """Results, and (with `lease`) the next work for the room they free: one exchange, one commit."""
        return await complete_answer(worker_id, body, me)

    async def complete_answer(worker_id: str, body: CompleteIn, me: WorkerCredential) -> FastJSON:
        completions = [r.to_completion() for r in body.results]
        ask = body.lease.to_ask(me.tenant) if body.lease else None
        done = await service.call(ctrl.exchange, worker_id, completions, ask, watched=service.watched)
        answer: dict[str, Any] = {"accepted": done.accepted, "refused": done.refused}
        if done.chains.claimed:  # which of the stages the worker started may go on (the others it stops)
            answer.update(chained=done.chains.accepted, unchained=done.chains.refused)
        leased_ids = [le.task.id for le in done.lease.leases] if done.lease else []
        service.handed(worker_id, [*done.chains.accepted, *leased_ids])
        service.reported(worker_id, done.accepted)  # a chained stage may have ended in the same report
        if done.accepted:
            service.capacity_freed(worker_id, done.lease)  # its capacity is free again; other workers' is not
            service.results_in(  # a run's wait watches the run's id
                [*done.accepted, *done.runs], done.ended_tasks, done.ended_runs
            )
        if done.lease is not None:
            leased(done.lease)
            answer.update(leases_out(done.lease))
        taken = set(leased_ids)
        retried = bool(done.accepted) and any(not c.succeeded for c in completions)
        if retried or len(done.queued) >= MAX_NOTED:
            service.queue_changed.notify()  # a retry (or more stages than were noted) is queued, for anyone
        elif stages := [t for t in done.queued if t.id not in taken]:
            service.tasks_queued(stages)  # a pipeline's next stages: one poll that could take each
        return FastJSON(answer)

    @api.post("/v1/workers/{worker_id}/scrubs")
    async def scrubs(worker_id: str, body: ScrubsIn, me: WorkerCredential = this_worker()) -> dict[str, Any]:
        for i, scrub in enumerate(body.scrubs):  # a tenant's own worker hands GPUs over between its own tasks
            for name in ("tenant", "previous_tenant"):
                value = getattr(scrub, name)
                if value is not None and not worker_serves(me.tenant, value):
                    raise InvalidInput(f"scrubs.{i}.{name}: worker {worker_id} serves tenant {me.tenant} only",
                                       field=f"scrubs.{i}.{name}")  # fmt: skip
        stored = await service.call(ctrl.record_scrubs, worker_id, [s.model_dump() for s in body.scrubs])
        return {"stored": stored}

    @api.post("/v1/workers/{worker_id}/events", openapi_extra=EVENTS_BODY, response_class=FastJSON)
    async def worker_events(
        worker_id: str, request: Request, me: WorkerCredential = this_worker()
    ) -> FastJSON:
        return await events_answer(worker_id, parse_events(await json_body(request), limits), me)

    async def events_answer(worker_id: str, items: list[EventItem], me: WorkerCredential) -> FastJSON:
        last = await service.call(ctrl.append_events, worker_id, items)
        if last:
            service.events_added.notify()
        return FastJSON({"stored": len(items) if last else 0})

    @api.post("/v1/workers/{worker_id}/leave")
    async def leave(worker_id: str, me: WorkerCredential = this_worker()) -> dict[str, Any]:
        await service.call(ctrl.deregister, worker_id)
        service.changed()
        return {"ok": True}

    return WorkerRoutes(api, complete_answer, lease, events_answer)
