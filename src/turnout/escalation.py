"""Escalation: tasks that waited `after_s` with no local capacity go to a configured cloud endpoint.

    escalation:
      after_s: 30
      endpoints:
        - {capability: classify_text, kind: runpod, url: "https://api.runpod.ai/v2/ID", api_key_env: RUNPOD_API_KEY,
           price_per_s: 0.0019}
        - {capability: embed, kind: http, url: "https://models.example/embed", price_per_s: 0.001}

Kinds:
- `runpod`: a queue-based serverless endpoint. `POST {url}/run` with `{"input": ...}` and `Authorization: Bearer
  KEY` answers a job id; `GET {url}/status/{id}` answers IN_QUEUE, IN_PROGRESS, COMPLETED (with `output`),
  FAILED, CANCELLED or TIMED_OUT; `POST {url}/cancel/{id}` stops it. A result expires 30 minutes after it
  completes, so status is polled every `poll_s` and the output fetched at once. 429 means back off: the
  `Retry-After` it gives, else doubling from `poll_s`.
- `http`: `POST {url}` with `{"input": ...}` answers the output as JSON (200), or an error (4xx/5xx).

Which tasks go (`eligible`) is a pure decision; the loop that sends and polls (`Escalator`) lives in the API
process beside the controller, and keeps its remote job id on the task (`routing.cloud_job`), so a controller
restart resumes polling instead of sending the task twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import httpx

from turnout.errors import InvalidInput, number
from turnout.models import Completion, Device, GpuMode, Routing, Task, TaskState, check_capability_name

if TYPE_CHECKING:
    from turnout.api.service import Service
    from turnout.controller import Controller

log = logging.getLogger("turnout.escalation")

KINDS = ("runpod", "http")
ENDPOINT_KEYS = ("capability", "kind", "url", "api_key_env", "price_per_s", "name", "poll_s", "timeout_s")
# a cloud endpoint is a GPU: only tasks whose gpu value allows a GPU go there
ESCALATES = frozenset({GpuMode.PREFER, GpuMode.REQUIRE, GpuMode.AUTO})


@dataclass(frozen=True)
class Endpoint:
    capability: str
    kind: str
    url: str
    name: str
    api_key: str | None = field(default=None, repr=False)
    price_per_s: float | None = None
    poll_s: float = 1.0
    timeout_s: float = 600.0  # a job not finished by then is cancelled and its task fails `timeout`


@dataclass(frozen=True)
class EscalationSettings:
    after_s: float = 30.0
    endpoints: tuple[Endpoint, ...] = ()

    def endpoint_for(self, capability: str) -> Endpoint | None:
        return next((e for e in self.endpoints if e.capability == capability), None)

    def by_name(self, name: str) -> Endpoint | None:
        return next((e for e in self.endpoints if e.name == name), None)


def parse_escalation(
    raw: Any, source: str = "escalation", *, environ: Mapping[str, str] | None = None
) -> EscalationSettings | None:
    """The `escalation:` section; every error names the key. An `api_key_env` that is not set is an error now,
    at start, not a 401 on the first task an hour later."""
    if raw is None:
        return None
    env = environ or {}
    if not isinstance(raw, Mapping):
        raise InvalidInput(f"{source}: expected a mapping with after_s and endpoints", field=source)
    unknown = sorted(set(raw) - {"after_s", "endpoints"})
    if unknown:
        raise _bad(f"{source}.{unknown[0]}", "unknown key (known: after_s, endpoints)")
    after_s = _positive(raw.get("after_s", 30.0), f"{source}.after_s", zero_ok=True)
    items = raw.get("endpoints", [])
    if not isinstance(items, list):
        raise _bad(f"{source}.endpoints", "expected a list of endpoints")
    endpoints: list[Endpoint] = []
    for i, item in enumerate(items):
        at = f"{source}.endpoints.{i}"
        if not isinstance(item, Mapping):
            raise _bad(at, "expected a mapping (capability, kind, url, ...)")
        bad = sorted(set(item) - set(ENDPOINT_KEYS))
        if bad:
            raise _bad(f"{at}.{bad[0]}", f"unknown key (known: {', '.join(ENDPOINT_KEYS)})")
        for key in ("capability", "kind", "url"):
            if key not in item:
                raise _bad(f"{at}.{key}", "missing")
        capability = check_capability_name(item["capability"], f"{at}.capability")
        kind = item["kind"]
        if kind not in KINDS:
            raise _bad(f"{at}.kind", f"expected one of {', '.join(KINDS)}, got {kind!r}")
        url = item["url"]
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise _bad(f"{at}.url", f"expected an http:// or https:// URL, got {url!r}")
        key_env = item.get("api_key_env")
        api_key = None
        if key_env is not None:
            if not isinstance(key_env, str) or not key_env:
                raise _bad(f"{at}.api_key_env", f"expected an environment variable name, got {key_env!r}")
            api_key = env.get(key_env)
            if not api_key:
                raise _bad(f"{at}.api_key_env", f"the environment variable {key_env} is not set")
        price = item.get("price_per_s")
        if price is not None:
            price = _positive(price, f"{at}.price_per_s", zero_ok=True)
        name = item.get("name", f"{kind}-{capability}")
        if not isinstance(name, str) or not name or len(name) > 32:
            raise _bad(f"{at}.name", f"expected a name of 1 to 32 characters, got {name!r}")
        if any(e.name == name for e in endpoints):
            raise _bad(f"{at}.name", f"{name!r} names another endpoint too")
        if any(e.capability == capability for e in endpoints):
            raise _bad(f"{at}.capability", f"{capability!r} already has an endpoint")
        endpoints.append(Endpoint(capability, kind, url.rstrip("/"), name, api_key, price,
                                  _positive(item.get("poll_s", 1.0), f"{at}.poll_s"),
                                  _positive(item.get("timeout_s", 600.0), f"{at}.timeout_s")))  # fmt: skip
    return EscalationSettings(after_s, tuple(endpoints))


def _positive(value: Any, at: str, *, zero_ok: bool = False) -> float:
    if zero_ok:
        return number(value, at, "a number >= 0", lambda v: v >= 0)
    return number(value, at, "a number > 0", lambda v: v > 0)


def _bad(at: str, why: str) -> InvalidInput:
    return InvalidInput(f"{at}: {why}", field=at)


def eligible(
    mode: GpuMode, waited_s: float, settings: EscalationSettings | None, capability: str
) -> Endpoint | None:
    """The endpoint a queued task goes to now, or None: it must allow a GPU and have waited `after_s`."""
    if settings is None or mode not in ESCALATES or waited_s < settings.after_s:
        return None
    return settings.endpoint_for(capability)


# ---- the controller's side: claim tasks for an endpoint, finish them (on the database thread) ------------


def claim(ctrl: Controller, now: float, limit: int = 50) -> list[Task]:
    """Take queued tasks that waited `after_s` with no local worker taking them, for their endpoints.

    Tenants are taken in the fair order shared workers lease in (the one holding the fewest active tasks
    first, then in turn), so one tenant's backlog cannot keep another's tasks from escalating. An endpoint is a
    GPU: a task whose tenant is at its `max_gpus` (tasks held by endpoints count one each) or over its
    `gpu_allocations_per_min` waits in the queue as it would for a local GPU; its own limits hold it, not a
    want of capacity, and escalating it would lift them.
    """
    settings = ctrl.settings.escalation
    if settings is None or not settings.endpoints:
        return []
    caps = {e.capability for e in settings.endpoints}
    limits = ctrl.settings.tenant_limits
    gpu_use: dict[str, float] | None = None
    planned: dict[str, int] = {}  # per tenant: claimed in this call, not yet in the store or the buckets
    updates = []
    picked: list[Task] = []
    for task in ctrl.queued_fairly(caps, limit):
        waited = now - (task.queued_at or task.created_at)
        endpoint = eligible(task.spec.gpu, waited, settings, task.spec.capability)
        if endpoint is None:
            continue
        tenant, n = task.tenant, planned.get(task.tenant, 0)
        quota = limits.of(tenant).max_gpus
        if quota is not None:
            gpu_use = ctrl.store.gpu_use_by_tenant() if gpu_use is None else gpu_use
            if gpu_use.get(tenant, 0.0) + n + 1 > quota + 1e-9:
                continue
        if ctrl.gpu_allocations.wait_s(tenant, n + 1) > 0:
            continue
        planned[tenant] = n + 1
        routing = Routing(requested=task.spec.gpu.value, device=f"cloud:{endpoint.name}", cloud=endpoint.name,
                          reason=f"no local capacity for {waited:.0f} s (escalation.after_s {settings.after_s:g}); "
                                 f"sent to {endpoint.kind} endpoint {endpoint.name}")  # fmt: skip
        values = {"state": TaskState.LEASED, "worker_id": f"cloud:{endpoint.name}", "device": Device.GPU,
                  "gpus": None, "gpu_model": None, "routing": routing, "leased_at": now,
                  "attempts": task.attempts + 1, "unservable_since": None, "alloc": None}  # fmt: skip
        updates.append((task.id, (TaskState.QUEUED,), task.attempts, values))
        picked.append(replace(task, state=TaskState.LEASED, worker_id=f"cloud:{endpoint.name}", device=Device.GPU,
                              routing=routing, attempts=task.attempts + 1, leased_at=now))  # fmt: skip
    won = set(ctrl.store.update_tasks(updates)) if updates else set()
    claimed = [t for t in picked if t.id in won]
    for t in claimed:
        ctrl.gpu_allocations.take(t.tenant)
    return claimed


def held(ctrl: Controller) -> list[Task]:
    """Tasks an endpoint holds now (after a restart: the jobs to resume)."""
    return [t for t in ctrl.store.active_tasks() if (t.worker_id or "").startswith("cloud:")]


def record_job(ctrl: Controller, task_id: str, attempt: int, job_id: str) -> bool:
    """Keep the endpoint's job id on the task, so a restarted controller polls it instead of sending it twice."""
    task = ctrl.store.get_task(task_id)
    if task is None or task.attempts != attempt:
        return False
    routing = replace(task.routing or Routing(), cloud_job=job_id)
    return bool(ctrl.store.update_tasks([(task_id, (TaskState.LEASED, TaskState.RUNNING), attempt,
                                          {"state": TaskState.RUNNING, "started_at": ctrl.clock(), "routing": routing})]))  # fmt: skip


def still_held(ctrl: Controller, task_id: str, attempt: int) -> bool:
    task = ctrl.store.get_task(task_id)
    return (
        task is not None and task.attempts == attempt and task.state in (TaskState.LEASED, TaskState.RUNNING)
    )


def cloud_cost(endpoint: Endpoint | None, seconds: float | None) -> float | None:
    if endpoint is None or endpoint.price_per_s is None or seconds is None:
        return None
    return round(seconds * endpoint.price_per_s, 10)


# ---- the loop that sends, polls and cancels (in the API process, beside the controller) -------------------


class _Backoff(Exception):
    def __init__(self, delay_s: float) -> None:
        super().__init__(f"429: back off {delay_s:g} s")
        self.delay_s = delay_s


class Escalator:
    """Every `tick_s`, claims tasks for their endpoints and follows each one's job until it ends.

    A job's outcome is committed like a worker's result (`Controller.complete` with worker `cloud:NAME`), so a
    pipeline's next stage is queued in the same commit. A task cancelled in Turnout has its job cancelled
    (`POST {url}/cancel/{id}`); a job past the endpoint's `timeout_s` is cancelled and its task fails `timeout`.
    """

    def __init__(self, service: Service, *, tick_s: float = 0.25,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:  # fmt: skip
        self.service = service
        self.ctrl = service.controller
        self.tick_s = tick_s
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(30.0), transport=transport)
        self.jobs: dict[str, asyncio.Task[None]] = {}
        self._loop: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._loop = asyncio.create_task(self._run())

    async def stop(self) -> None:
        tasks = [t for t in (self._loop, *self.jobs.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.http.aclose()

    async def _run(self) -> None:
        try:
            for task in await self.service.read(held, self.ctrl):  # resume what a previous controller sent
                self._follow(task)
        except Exception:
            log.exception("escalation: could not read the tasks endpoints hold")
        while True:
            try:
                claimed = await self.service.call(claim, self.ctrl, self.ctrl.clock())
                if claimed:
                    self.service.changed()
                for task in claimed:
                    self._follow(task)
            except Exception:  # the loop must outlive a bad moment (a full disk)
                log.exception("escalation: claiming tasks failed")
            await asyncio.sleep(self.tick_s)

    def _follow(self, task: Task) -> None:
        if task.id in self.jobs:
            return
        job = asyncio.create_task(self._job(task))
        self.jobs[task.id] = job
        job.add_done_callback(lambda _: self.jobs.pop(task.id, None))

    async def _job(self, task: Task) -> None:
        settings = self.ctrl.settings.escalation
        name = (task.routing.cloud if task.routing else None) or ""
        endpoint = settings.by_name(name) if settings else None
        attempt = task.attempts
        if endpoint is None:
            await self._finish(task, attempt, False, None,
                               {"type": "cloud_error", "message": f"escalation endpoint {name!r} is no longer configured"}, None)  # fmt: skip
            return
        try:
            if endpoint.kind == "runpod":
                await self._runpod(endpoint, task, attempt)
            else:
                await self._http(endpoint, task, attempt)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("escalation: task %s on %s failed: %s", task.id, endpoint.name, exc)
            await self._finish(task, attempt, False, None,
                               {"type": "cloud_error", "message": f"{endpoint.name}: {type(exc).__name__}: {exc}"}, None)  # fmt: skip

    def _headers(self, endpoint: Endpoint) -> dict[str, str]:
        return {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}

    async def _send(self, method: str, url: str, endpoint: Endpoint, **kwargs: Any) -> httpx.Response:
        """One request; 429 raises _Backoff with the wait it asks for (Retry-After), else doubling poll_s."""
        resp = await self.http.request(method, url, headers=self._headers(endpoint), **kwargs)
        if resp.status_code == 429:
            try:
                delay = float(resp.headers.get("Retry-After", ""))
            except ValueError:
                delay = endpoint.poll_s * 2
            raise _Backoff(max(0.05, delay))
        return resp

    async def _runpod(self, endpoint: Endpoint, task: Task, attempt: int) -> None:
        job_id = task.routing.cloud_job if task.routing else None
        sent_at = time.monotonic()
        while job_id is None:
            if not await self.service.read(still_held, self.ctrl, task.id, attempt):
                return  # cancelled before it was sent
            try:
                resp = await self._send(
                    "POST", f"{endpoint.url}/run", endpoint, json={"input": task.spec.input}
                )
            except _Backoff as b:
                await asyncio.sleep(b.delay_s)
                continue
            if resp.status_code >= 400:
                await self._finish(task, attempt, False, None, _http_error(endpoint, "run", resp), None)
                return
            job_id = str(resp.json()["id"])
            await self.service.call(record_job, self.ctrl, task.id, attempt, job_id)
        delay = endpoint.poll_s
        while True:
            if not await self.service.read(still_held, self.ctrl, task.id, attempt):
                await self._cancel(endpoint, job_id)  # cancelled in Turnout: stop the job there too
                return
            if time.monotonic() - sent_at > endpoint.timeout_s:
                await self._cancel(endpoint, job_id)
                await self._finish(task, attempt, False, None, {"type": "timeout",
                                   "message": f"{endpoint.name} did not finish within its timeout_s={endpoint.timeout_s:g}; job cancelled"}, None)  # fmt: skip
                return
            try:
                resp = await self._send("GET", f"{endpoint.url}/status/{job_id}", endpoint)
                delay = endpoint.poll_s
            except _Backoff as b:
                delay = max(b.delay_s, delay * 2)
                await asyncio.sleep(delay)
                continue
            if resp.status_code >= 400:
                await self._finish(task, attempt, False, None, _http_error(endpoint, "status", resp), None)
                return
            body = resp.json()
            status = body.get("status")
            run_s = body.get("executionTime")
            seconds = float(run_s) / 1000.0 if isinstance(run_s, int | float) else time.monotonic() - sent_at
            if status == "COMPLETED":  # fetched at once: results expire 30 minutes after completion
                await self._finish(task, attempt, True, body.get("output"), None, seconds)
                return
            if status in ("FAILED", "CANCELLED", "TIMED_OUT"):
                kind = {"FAILED": "cloud_failed", "CANCELLED": "cloud_cancelled", "TIMED_OUT": "timeout"}[
                    status
                ]
                await self._finish(task, attempt, False, None, {"type": kind,
                                   "message": f"{endpoint.name} job {job_id}: {status}: {body.get('error') or ''}".rstrip(": ")}, seconds)  # fmt: skip
                return
            await asyncio.sleep(delay)

    async def _cancel(self, endpoint: Endpoint, job_id: str) -> None:
        for _ in range(5):
            try:
                await self._send("POST", f"{endpoint.url}/cancel/{job_id}", endpoint)
                return
            except _Backoff as b:
                await asyncio.sleep(b.delay_s)
            except httpx.HTTPError as exc:
                log.warning("escalation: cancelling job %s on %s failed: %s", job_id, endpoint.name, exc)
                return

    async def _http(self, endpoint: Endpoint, task: Task, attempt: int) -> None:
        started = time.monotonic()
        await self.service.call(record_job, self.ctrl, task.id, attempt, "http")
        while True:
            call = asyncio.create_task(self._send("POST", endpoint.url, endpoint, json={"input": task.spec.input},
                                                  timeout=endpoint.timeout_s))  # fmt: skip
            while not call.done():
                await asyncio.wait({call}, timeout=endpoint.poll_s)
                if not call.done() and not await self.service.read(still_held, self.ctrl, task.id, attempt):
                    call.cancel()  # cancelled in Turnout: drop the request
                    return
            try:
                resp = call.result()
            except _Backoff as b:
                await asyncio.sleep(b.delay_s)
                continue
            except httpx.TimeoutException:
                await self._finish(task, attempt, False, None, {"type": "timeout",
                                   "message": f"{endpoint.name} did not answer within its timeout_s={endpoint.timeout_s:g}"}, None)  # fmt: skip
                return
            seconds = time.monotonic() - started
            if resp.status_code >= 400:
                await self._finish(task, attempt, False, None, _http_error(endpoint, "call", resp), seconds)
            else:
                await self._finish(task, attempt, True, resp.json(), None, seconds)
            return

    async def _finish(self, task: Task, attempt: int, ok: bool, output: Any, error: dict[str, Any] | None,
                      run_s: float | None) -> None:  # fmt: skip
        completion = Completion(task.id, attempt, ok, output, error, run_s)
        worker = task.worker_id or f"cloud:{(task.routing.cloud if task.routing else None) or ''}"
        accepted, _, _ = await self.service.call(
            lambda: (*self.ctrl.complete(worker, [completion]), self.ctrl.runs.take_queued())
        )
        if accepted:
            self.service.changed()


def _http_error(endpoint: Endpoint, what: str, resp: httpx.Response) -> dict[str, Any]:
    return {
        "type": "cloud_error",
        "message": f"{endpoint.name} {what}: HTTP {resp.status_code}: {resp.text[:300]}",
    }
