"""Routes. Each handler checks the token, translates the wire format, and calls the controller once."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from turnout import __version__
from turnout.access import (
    ALL_TENANTS,
    ANONYMOUS_OPERATOR,
    Action,
    Principal,
    allow,
    check_tenant_name,
    sees,
    worker_serves,
)
from turnout.api import dashboard, errors, files, lifeline, pipelines
from turnout.api import metrics as prometheus
from turnout.api.gate import SubmitGate
from turnout.api.limits import BodyLimit
from turnout.api.pipelines import profile_view
from turnout.api.schemas import (
    EVENTS_BODY,
    MAX_INT32,
    WORKER_FEATURES,
    CompleteIn,
    FastJSON,
    HeartbeatIn,
    LeaseIn,
    RegisterIn,
    ScrubsIn,
    TaskBatchIn,
    TaskIn,
    TokenIn,
    iso,
    leases_out,
    parse_events,
    task_out,
    worker_out,
)
from turnout.api.service import Service, Signal
from turnout.api.strictjson import StrictJsonRoute, json_body
from turnout.auth import WorkerCredential
from turnout.auth import check as check_worker
from turnout.controller import AUDIT_KINDS, LeaseAsk, LeaseResult, new_id
from turnout.errors import Forbidden, InvalidInput, NotFound
from turnout.escalation import Escalator
from turnout.models import Completion, Device, Task, TaskState, Variant, check_capability_name
from turnout.resources import parse_resources


def create_app(service: Service) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await service.start()
        escalator = Escalator(service) if service.controller.settings.escalation else None  # escalation.py
        if escalator:
            await escalator.start()
        try:
            yield
        finally:
            if escalator:
                await escalator.stop()
            await service.stop()

    # the API docs are served below, behind a token (they describe every route, worker protocol included)
    app = FastAPI(title="Turnout", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)  # fmt: skip
    app.router.route_class = StrictJsonRoute  # every JSON body below is parsed strictly (api/strictjson.py)
    errors.install(app)
    ctrl = service.controller
    limits = ctrl.settings.request_limits
    app.add_middleware(BodyLimit, limits=limits)
    app.add_middleware(SubmitGate, service=service)  # outermost: 429 over the rate, body unread
    metrics = prometheus.Metrics(ctrl)

    async def principal_of(authorization: str | None) -> Principal:
        if not service.auth:
            return ANONYMOUS_OPERATOR
        cached = service.tokens.cached(authorization)  # the hot path: no database, no thread hop
        if cached is not None:
            return cached
        return await service.read(service.tokens.verify, authorization)

    def need(action: Action) -> Any:
        """Every route but /healthz and /metrics declares the one action it needs."""

        async def check(authorization: str | None = Header(None)) -> Principal:
            return allow(await principal_of(authorization), action)

        return Depends(check)

    def this_worker() -> Any:
        """Worker routes: the caller must be the worker in the URL (its token and its secret); else 403."""

        async def check(
            worker_id: str,
            authorization: str | None = Header(None),
            x_worker_secret: str | None = Header(
                None, description="the secret /v1/workers/register answered"
            ),
        ) -> WorkerCredential:
            p = allow(await principal_of(authorization), Action.WORKER)
            cred = service.workers.cached(worker_id) or await service.read(service.workers.lookup, worker_id)
            return check_worker(cred, p, x_worker_secret)

        return Depends(check)

    def scope(p: Principal) -> str | None:
        """The tenant whose tasks this caller sees; None = all (the operator, a cluster-wide read token)."""
        return p.scope

    async def visible_workers(p: Principal) -> set[str] | None:
        """Ids of the workers this caller sees (its tenant's and the shared pool); None = all."""
        if p.scope is None:
            return None
        tenants = await service.read(ctrl.store.worker_tenants)
        return {w for w, serves in tenants.items() if worker_serves(serves, p.scope)}

    # ---- API docs ------------------------------------------------------------------------------

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_doc(p: Principal = need(Action.ANY)) -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs(p: Principal = need(Action.ANY)) -> HTMLResponse:
        # the document is inlined: the page's own fetch of /openapi.json would carry no token
        spec = json.dumps(app.openapi()).replace("</", "<\\/")
        return HTMLResponse(_SWAGGER_PAGE.replace("SPEC", spec))

    # ---- health --------------------------------------------------------------------------------

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True, "version": __version__, "time": iso(time.time())}

    # ---- tasks ---------------------------------------------------------------------------------

    @app.post("/v1/tasks", status_code=201, response_class=FastJSON)
    async def submit(body: TaskIn, p: Principal = need(Action.SUBMIT)) -> FastJSON:
        specs = [body.to_spec(limits)]
        service.admit(p.home_tenant, specs)  # a 429 before the database: a flood costs the others nothing
        tasks = await service.call(ctrl.submit, p.home_tenant, specs,
                                   waits_for_capacity=[body.waits_for_capacity])  # fmt: skip
        service.queue_changed.notify()
        return FastJSON(task_out(tasks[0]), status_code=201)

    @app.post("/v1/tasks/batch", status_code=201, response_class=FastJSON)
    async def submit_batch(body: TaskBatchIn, p: Principal = need(Action.SUBMIT)) -> FastJSON:
        specs = body.to_specs(limits)
        service.admit(p.home_tenant, specs)
        tasks = await service.call(ctrl.submit, p.home_tenant, specs,
                                   prefixes=[f"tasks.{i}." for i in range(len(body.tasks))],
                                   waits_for_capacity=[t.waits_for_capacity for t in body.tasks])  # fmt: skip
        service.queue_changed.notify()
        return FastJSON({"tasks": [task_out(t) for t in tasks]}, status_code=201)

    @app.get("/v1/tasks")
    async def list_tasks(
        state: str | None = None,
        capability: str | None = None,
        limit: int = Query(50, ge=1, le=1000),
        cursor: str | None = None,
        p: Principal = need(Action.READ),
    ) -> dict[str, Any]:
        if state is not None and state not in {s.value for s in TaskState}:
            raise InvalidInput(f"state: {state!r} is not a task state", field="state")
        tasks = await service.read(ctrl.list_tasks, scope(p), state=state, capability=capability, limit=limit,
                                   cursor=cursor)  # fmt: skip
        return {
            "tasks": [task_out(t) for t in tasks],
            "next_cursor": tasks[-1].id if len(tasks) == limit else None,
        }

    @app.get("/v1/tasks/{task_id}", response_class=FastJSON)
    async def get_task(task_id: str, p: Principal = need(Action.READ)) -> FastJSON:
        return FastJSON(task_out(await service.read(ctrl.get_task, scope(p), task_id)))

    @app.get("/v1/tasks/{task_id}/result", response_class=FastJSON)
    async def get_result(
        task_id: str, wait: float = Query(0, ge=0, le=3600), p: Principal = need(Action.READ)
    ) -> FastJSON:
        deadline = time.monotonic() + wait
        while True:
            signal = service.tasks_changed.current()
            task = await service.read(ctrl.get_task, scope(p), task_id)
            left = deadline - time.monotonic()
            if task.state.terminal or left <= 0:
                return FastJSON(task_out(task))
            await Signal.wait(signal, min(left, service.recheck_s))

    @app.post("/v1/tasks/{task_id}/cancel")
    async def cancel(task_id: str, p: Principal = need(Action.SUBMIT)) -> dict[str, Any]:
        task = await service.call(ctrl.cancel, scope(p), task_id, by=p.token_id)
        service.changed()
        return task_out(task)

    @app.get("/v1/tasks/{task_id}/events")
    async def events(
        request: Request,
        task_id: str,
        after: int = Query(0, ge=0, le=MAX_INT32),
        last_event_id: str | None = Header(None),
        p: Principal = need(Action.READ),
    ) -> StreamingResponse:
        await service.read(ctrl.get_task, scope(p), task_id)  # 404 before the stream starts
        start = after
        if last_event_id:
            digits = last_event_id.isascii() and last_event_id.isdigit() and len(last_event_id) <= 10
            if not digits or int(last_event_id) > MAX_INT32:
                raise InvalidInput(
                    "Last-Event-ID: expected the seq number of the last event seen", field="Last-Event-ID"
                )
            start = max(start, int(last_event_id))

        def frame(seq: int, ts: float | None, body: dict[str, Any]) -> bytes:
            payload = {**body, "seq": seq, "ts": iso_cached(ts)}
            return (
                f"id: {seq}\nevent: {body.get('event', 'message')}\ndata: {json.dumps(payload)}\n\n".encode()
            )

        async def stream() -> AsyncIterator[bytes]:
            seen = start
            while True:
                signal = service.events_added.current()
                batch = await service.read(ctrl.store.read_events, task_id, seen, 5000)
                frames = []  # one write per batch: a chatty task costs the event loop little per event
                for seq, ts, body in batch:
                    seen = seq
                    frames.append(frame(seq, ts, body))
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
                    if await service.read(ctrl.store.read_events, task_id, seen, 1):
                        continue
                    last = await service.read(ctrl.store.last_event_seq, task_id)
                    if seen <= last:
                        yield frame(last + 1, task.finished_at, finish_event(task))
                    return
                if await request.is_disconnected():
                    return
                await Signal.wait(signal, service.recheck_s)

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    # ---- capabilities and workers --------------------------------------------------------------

    @app.get("/v1/capabilities")
    async def capabilities(p: Principal = need(Action.READ)) -> dict[str, Any]:
        seen = await visible_workers(p)
        workers = [w for w in await service.read(ctrl.workers) if seen is None or w.id in seen]
        depths = await service.read(ctrl.store.queue_depths, scope(p))
        caps: dict[str, dict[str, Any]] = {}
        for w in workers:
            for v in w.variants:
                entry = caps.setdefault(v.capability, {"name": v.capability, "variants": {}})
                var = entry["variants"].setdefault(
                    v.device.value,
                    {"device": v.device.value, "resources": v.resources.to_dict(), "workers": []},
                )
                var["workers"].append({"id": w.id, "name": w.name, "state": w.state.value})
        for name in depths:
            caps.setdefault(name, {"name": name, "variants": {}})
        learned = await service.read(ctrl.runs.store.profiles)
        out = []
        for name in sorted(caps):
            entry = caps[name]
            d = depths.get(name, {})
            out.append({"name": name, "variants": list(entry["variants"].values()),
                        "queue_depth": d.get("queued", 0), "running": d.get("leased", 0) + d.get("running", 0),
                        **profile_view(name, entry["variants"], learned)})  # fmt: skip
        return {"capabilities": out}

    @app.get("/v1/workers")
    async def workers(p: Principal = need(Action.READ)) -> dict[str, Any]:
        seen = await visible_workers(p)
        ws = [w for w in await service.read(ctrl.workers) if seen is None or w.id in seen]
        active = await service.read(ctrl.store.active_tasks)
        counts: dict[str, int] = {}
        for t in active:
            if sees(p, t.tenant):  # a shared worker's load from other tenants is theirs to know
                counts[t.worker_id or ""] = counts.get(t.worker_id or "", 0) + 1
        return {"workers": [worker_out(w, counts.get(w.id, 0)) for w in ws]}

    @app.post("/v1/workers/{worker_id}/drain")
    async def drain(worker_id: str, p: Principal = need(Action.ADMIN)) -> dict[str, Any]:
        if not p.is_operator:
            cred = await service.read(service.workers.lookup, worker_id)
            if cred is None or cred.tenant not in (ALL_TENANTS, p.tenant):
                raise NotFound(f"worker {worker_id} not found", field="worker")
            if cred.tenant == ALL_TENANTS:
                raise Forbidden("a shared worker (serving every tenant) is drained by the operator only")
        return worker_out(await service.call(ctrl.drain, worker_id, by=p.token_id))

    # ---- worker protocol -----------------------------------------------------------------------

    @app.post("/v1/workers/register", status_code=201)
    async def register(
        body: RegisterIn,
        p: Principal = need(Action.WORKER),
        x_worker_secret: str | None = Header(
            None, description="registering again: the secret answered before"
        ),
    ) -> dict[str, Any]:
        variants = []
        for i, v in enumerate(body.variants):
            check_capability_name(v.capability, f"variants.{i}.capability")
            variants.append(
                Variant(
                    v.capability,
                    Device(v.device),
                    parse_resources(v.resources, f"variants.{i}.resources"),
                    v.max_batch_size,
                    v.max_batch_wait_ms,
                )
            )

        def run() -> tuple[Any, str, str]:
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

    @app.post("/v1/workers/{worker_id}/heartbeat")
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
            service.tasks_changed.notify()
            metrics.observe_leases(result.leases)

    @app.post("/v1/workers/{worker_id}/lease", response_class=FastJSON)
    async def lease(worker_id: str, body: LeaseIn, me: WorkerCredential = this_worker()) -> FastJSON:
        listed_at = ctrl.clock()  # `running` is as of now, however long the poll waits
        deadline = time.monotonic() + min(body.wait_s, ctrl.settings.max_lease_wait_s)
        running = list(body.running)
        mine = service.worker_signal(worker_id)
        while True:
            queue, stops, capacity = (
                service.queue_changed.current(),
                service.changes.current(),
                mine.current(),
            )
            result = await service.call(ctrl.offer, worker_id, max_tasks=body.max_tasks, running=running,
                                        tenant=me.tenant, listed_at=listed_at)  # fmt: skip
            running = [tid for tid in running if tid not in set(result.cancel)]
            left = deadline - time.monotonic()
            if result.leases or result.cancel or left <= 0 or service.closing.is_set():
                leased(result)
                return FastJSON(leases_out(result))
            # a full worker waits for its own capacity (or a cancel, a timeout, a fleet change), not for every new
            # task: under a flood of submissions that would re-run its lease for nothing, hundreds of times a second
            wake = [stops, capacity] if result.full else [queue, capacity]
            # a batch still filling is leased once full or its wait is over: ask again by then (retry_in_s)
            with service.parked(worker_id, full=result.full):
                await Signal.wait_any([*wake, service.closing],
                                      min(left, service.recheck_s, result.retry_in_s or service.recheck_s))  # fmt: skip

    @app.post("/v1/workers/{worker_id}/complete", response_class=FastJSON)
    async def complete(worker_id: str, body: CompleteIn, me: WorkerCredential = this_worker()) -> FastJSON:
        """Results, and (with `lease`) the next work for the room they free: one exchange, one commit."""
        completions = [
            Completion(
                r.task_id,
                r.attempt,
                r.status == "succeeded",
                r.output,
                r.error,
                r.run_s,
                r.started_at,
                r.isolation,
                r.cold_start_s,
                r.usage.model_dump(exclude_none=True) if r.usage else None,
                r.chain,
            )
            for r in body.results
        ]
        ask = body.lease
        done = await service.call(ctrl.exchange, worker_id, completions,
                                  LeaseAsk(ask.max_tasks, tuple(ask.running), me.tenant) if ask else None)  # fmt: skip
        answer: dict[str, Any] = {"accepted": done.accepted, "refused": done.refused}
        if done.chains.claimed:  # which of the stages the worker started may go on (the others it stops)
            answer.update(chained=done.chains.accepted, unchained=done.chains.refused)
        if done.accepted:
            service.capacity_freed(worker_id, done.lease)  # its capacity is free again; other workers' is not
            service.tasks_changed.notify()
        if done.lease is not None:
            leased(done.lease)
            answer.update(leases_out(done.lease))
        taken = {le.task.id for le in done.lease.leases} if done.lease else set()
        retried = bool(done.accepted) and any(not c.succeeded for c in completions)
        if retried or any(tid not in taken for tid in done.queued):
            service.queue_changed.notify()  # a retry or a pipeline's next stage is queued, for anyone
        return FastJSON(answer)

    @app.post("/v1/workers/{worker_id}/scrubs")
    async def scrubs(worker_id: str, body: ScrubsIn, me: WorkerCredential = this_worker()) -> dict[str, Any]:
        for i, scrub in enumerate(body.scrubs):  # a tenant's own worker hands GPUs over between its own tasks
            for name in ("tenant", "previous_tenant"):
                value = getattr(scrub, name)
                if value is not None and not worker_serves(me.tenant, value):
                    raise InvalidInput(f"scrubs.{i}.{name}: worker {worker_id} serves tenant {me.tenant} only",
                                       field=f"scrubs.{i}.{name}")  # fmt: skip
        stored = await service.call(ctrl.record_scrubs, worker_id, [s.model_dump() for s in body.scrubs])
        return {"stored": stored}

    @app.post("/v1/workers/{worker_id}/events", openapi_extra=EVENTS_BODY, response_class=FastJSON)
    async def worker_events(
        worker_id: str, request: Request, me: WorkerCredential = this_worker()
    ) -> FastJSON:
        items = parse_events(await json_body(request), limits)
        last = await service.call(ctrl.append_events, worker_id, items)
        if last:
            service.events_added.notify()
        return FastJSON({"stored": sum(1 for _ in items) if last else 0})

    @app.post("/v1/workers/{worker_id}/leave")
    async def leave(worker_id: str, me: WorkerCredential = this_worker()) -> dict[str, Any]:
        await service.call(ctrl.deregister, worker_id)
        service.changed()
        return {"ok": True}

    # ---- tokens --------------------------------------------------------------------------------

    @app.post("/v1/tokens", status_code=201)
    async def create_token(body: TokenIn, p: Principal = need(Action.ADMIN)) -> dict[str, Any]:
        tenant = body.tenant if body.tenant is not None else p.home_tenant

        def run() -> dict[str, Any]:  # the token and its audit record commit together
            made = service.tokens.grant(p, body.role, tenant)
            ctrl.audit("token_created", _audit_tenant(made["tenant"]),
                       {"token": made["id"], "role": made["role"], "token_tenant": made["tenant"], "by": p.token_id})  # fmt: skip
            return made

        return await service.call(run)

    @app.get("/v1/tokens")
    async def list_tokens(tenant: str | None = None, p: Principal = need(Action.ADMIN)) -> dict[str, Any]:
        if tenant is not None:
            check_tenant_name(tenant, allow_all=True)
        rows = await service.read(service.tokens.listed, p, tenant)
        return {"tokens": [{"id": r["id"], "role": r["role"], "tenant": r["tenant"], "created_at": iso(r["created_at"]),
                            "revoked_at": iso(r["revoked_at"])} for r in rows]}  # fmt: skip

    @app.delete("/v1/tokens/{token_id}")
    async def revoke_token(token_id: str, p: Principal = need(Action.ADMIN)) -> dict[str, Any]:
        def run() -> dict[str, Any]:
            row = service.tokens.revoke(p, token_id)
            ctrl.audit("token_revoked", _audit_tenant(row["tenant"]),
                       {"token": token_id, "role": row["role"], "token_tenant": row["tenant"], "by": p.token_id})  # fmt: skip
            return row

        row = await service.call(run)
        return {"id": token_id, "role": row["role"], "tenant": row["tenant"], "revoked": True}

    @app.get("/v1/audit")
    async def audit(
        since: str | None = None,
        tenant: str | None = None,
        kind: str | None = None,
        limit: int = Query(1000, ge=1, le=10_000),
        cursor: int | None = Query(None, ge=0),
        p: Principal = need(Action.ADMIN),
    ) -> dict[str, Any]:
        if tenant is not None:
            check_tenant_name(tenant)
            if not sees(p, tenant):
                raise NotFound(f"tenant {tenant} not found", field="tenant")
        if kind is not None and kind not in AUDIT_KINDS:
            raise InvalidInput(f"kind: {kind!r} is not one of {', '.join(sorted(AUDIT_KINDS))}", field="kind")
        records = await service.read(ctrl.store.list_audit, _parse_since(since), limit, tenant=tenant or scope(p),
                                     kind=kind, after_id=cursor)  # fmt: skip
        return {"audit": [_audit_out(r) for r in records],
                "next_cursor": records[-1]["id"] if len(records) == limit else None}  # fmt: skip

    app.include_router(prometheus.router(service, metrics))
    app.include_router(lifeline.router(service, this_worker()))  # held by the worker itself, as it heartbeats
    dashboard.install(app, service, need, scope, visible_workers)
    pipelines.install(app, service, need, scope)  # pipeline runs (api/pipelines.py)
    files.install(app, service, need, scope, this_worker())  # /v1/files (api/files.py)

    return app


AUDIT_TIMES = ("start", "end", "last_heartbeat")  # epoch seconds in the record, ISO 8601 on the wire


def _audit_out(r: dict[str, Any]) -> dict[str, Any]:
    body = {k: iso(v) if k in AUDIT_TIMES and isinstance(v, int | float) else v for k, v in r["body"].items()}
    return {**body, "id": r["id"], "ts": iso(r["ts"]), "kind": r["kind"], "tenant": r["tenant"]}


def _audit_tenant(tenant: str) -> str | None:
    return None if tenant == ALL_TENANTS else tenant


_SWAGGER_PAGE = """<!doctype html>
<html><head><title>Turnout API</title>
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({spec: SPEC, dom_id: "#swagger-ui"});</script>
</body></html>
"""

# A batch of events shares one timestamp: format it once, not once per event.
iso_cached = functools.lru_cache(maxsize=256)(iso)


def finish_event(task: Task) -> dict[str, Any]:
    if task.state is TaskState.SUCCEEDED:
        return {"event": "finish", "status": "completed", "output": task.output}
    return {"event": "finish", "status": "failed", "state": task.state.value, "error": task.error}


def _parse_since(since: str | None) -> float | None:
    if since is None:
        return None
    try:
        return float(since)
    except ValueError:
        pass
    from datetime import datetime

    try:
        # times go out rounded to the microsecond: a record's own `ts`, sent back as `since`, must include it
        return datetime.fromisoformat(since.replace("Z", "+00:00")).timestamp() - 1e-6
    except ValueError:
        raise InvalidInput(
            f"since: {since!r} is not an ISO 8601 time or epoch seconds", field="since"
        ) from None
