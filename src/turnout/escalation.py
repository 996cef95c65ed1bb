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
  `Retry-After` it gives (seconds or a date; at most 60 s), else doubling from `poll_s`; a 5xx or a dropped
  status poll is polled again the same way, until the job's time is up.
- `http`: `POST {url}` with `{"input": ...}` answers the output as JSON (200), or an error (4xx/5xx).

Which tasks go (`eligible`) is a pure decision; the loop that sends and polls (`Escalator`) lives in the API
process beside the controller, and keeps its remote job id on the task (`routing.cloud_job`), so a controller
restart resumes polling instead of sending the task twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any

import httpx

from turnout import jsonsafe
from turnout.errors import InvalidInput, StorageUnavailable, number
from turnout.models import Completion, Device, GpuMode, Routing, Task, TaskState, check_capability_name
from turnout.store.replicas import claim_sweep

if TYPE_CHECKING:
    from turnout.api.service import Service
    from turnout.controller import Controller

log = logging.getLogger("turnout.escalation")

KINDS = ("runpod", "http")
MIN_POLL_S = 0.05  # each poll is a request to the endpoint and a read of the task: never a tight loop
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
                                  number(item.get("poll_s", 1.0), f"{at}.poll_s", f"a number of seconds >= {MIN_POLL_S:g}",
                                         lambda v: v >= MIN_POLL_S),
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

CALL_S = 30.0  # the most one call to a queue endpoint (run, status, cancel) may take, body included
# the longest back-off a Retry-After gets; the wait is also cut to the time the job has left
MAX_WAIT_S = 60.0
LEAD_S = 10.0  # a replica leading escalation that has not renewed its claim for this long is replaced
LEAD_RENEW_S = 1.0  # how often the leader renews it (and the others look whether it is still renewed)
LAST_POLL_S = 10.0  # the status poll made once a job's time is up, in case it ended meanwhile
# A job id goes into URLs (`{url}/status/{id}`): a plain token, never a path (`../..`), an object or 10 MB
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}")


class _Backoff(Exception):
    def __init__(self, delay_s: float) -> None:
        super().__init__(f"429: back off {delay_s:g} s")
        self.delay_s = delay_s


class _Failed(Exception):
    """The task fails with `error`; a job already sent is cancelled first (it runs, and bills, no more)."""

    def __init__(self, error: dict[str, Any], run_s: float | None = None) -> None:
        super().__init__(error.get("message", ""))
        self.error = error
        self.run_s = run_s


class _Transient(Exception):
    """A status poll that may well answer next time (5xx, a dropped or hung connection): poll again."""


@dataclass(frozen=True)
class _Answer:
    status: int
    body: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


class Escalator:
    """Every `tick_s`, claims tasks for their endpoints and follows each one's job until it ends.

    One replica at a time escalates (PostgreSQL with several controllers): the one holding the `escalation`
    claim (`store.replicas.claim_sweep`), which it renews every LEAD_RENEW_S. A replica that stops renewing
    (it died, or lost its database) is replaced after LEAD_S by another, which resumes every job an endpoint
    holds from the job ids on the tasks. So a job is never followed twice (an `http` call sent twice, a RunPod
    job polled by two), and no job is left unfollowed while a replica runs: the reaper leaves such tasks to
    this loop. On SQLite the one controller always leads.

    A job's outcome is committed like a worker's result (`Controller.complete` with worker `cloud:NAME`), so a
    pipeline's next stage is queued in the same commit. A task cancelled in Turnout has its job cancelled
    (`POST {url}/cancel/{id}`); a job past the endpoint's `timeout_s` (or the task's own, if shorter) is
    cancelled and its task fails `timeout`.

    An endpoint is outside data: every call has a deadline (a slow or silent one cannot hold a task), every
    answer is read up to `max_worker_body_bytes` and must be strict JSON, a job id must be a plain token, and
    the endpoint's key is never written into a task, an error or a log.
    """

    def __init__(self, service: Service, *, tick_s: float = 0.25,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:  # fmt: skip
        self.service = service
        self.ctrl = service.controller
        self.tick_s = tick_s
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(CALL_S), transport=transport)
        self.jobs: dict[str, asyncio.Task[None]] = {}
        self._lost: set[str] = set()  # tasks whose following stopped on a storage failure: followed again
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
        leading, renewed = False, -math.inf
        while True:
            try:
                if time.monotonic() - renewed >= LEAD_RENEW_S:
                    try:
                        now_leading = await self.service.call(claim_sweep, self.ctrl.store, "escalation",
                                                              self.service.replica_id, self.ctrl.clock(), LEAD_S)  # fmt: skip
                    except Exception:
                        if leading and time.monotonic() - renewed > LEAD_S / 2:
                            self._let_go()  # another replica may take over before we know: not both
                            leading = False
                        raise
                    renewed = time.monotonic()
                    if now_leading and not leading:  # resume what a previous leader (or controller) sent
                        self._lost.update(t.id for t in await self.service.read(held, self.ctrl))
                    elif leading and not now_leading:
                        self._let_go()
                    leading = now_leading
                if leading:
                    await self._escalate()
            except Exception:  # the loop must outlive a bad moment (a full disk)
                log.exception("escalation: claiming tasks failed")
            await asyncio.sleep(self.tick_s)

    async def _escalate(self) -> None:
        """The leader's round: follow again what it lost (or must resume), and claim what waited long enough."""
        if self._lost:  # from what the store holds now: its job id, or that it ended meanwhile
            for task in await self.service.read(held, self.ctrl):
                if task.id in self._lost:
                    self._follow(task)
            self._lost.clear()
        claimed = await self.service.call(claim, self.ctrl, self.ctrl.clock())
        if claimed:
            self.service.changed()
        for task in claimed:
            self._follow(task)

    def _let_go(self) -> None:
        """Stop following every job (not cancelling any): another replica leads escalation now, and follows them."""
        log.info("escalation: another replica leads escalation now; it follows the %d jobs followed here",
                 len(self.jobs))  # fmt: skip
        for job in list(self.jobs.values()):
            job.cancel()
        self._lost.clear()

    def _follow(self, task: Task) -> None:
        if task.id in self.jobs:
            return
        job = asyncio.create_task(self._job(task))
        self.jobs[task.id] = job
        job.add_done_callback(functools.partial(self._ended, task.id))

    def _ended(self, task_id: str, job: asyncio.Task[None]) -> None:
        """A job's follower is done. One stopped by the database failing (its task neither ended nor given up:
        the reaper leaves tasks an endpoint holds to this loop) is followed again once the store answers."""
        self.jobs.pop(task_id, None)
        exc = None if job.cancelled() else job.exception()
        if isinstance(exc, StorageUnavailable):
            log.warning("escalation: following task %s stopped: %s; following it again", task_id, exc)
            self._lost.add(task_id)
        elif exc is not None:
            log.error("escalation: following task %s failed", task_id, exc_info=exc)

    async def _job(self, task: Task) -> None:
        settings = self.ctrl.settings.escalation
        name = (task.routing.cloud if task.routing else None) or ""
        endpoint = settings.by_name(name) if settings else None
        attempt = task.attempts
        if endpoint is None:
            await self._finish(task, attempt, False, None,
                               {"type": "cloud_error", "message": f"escalation endpoint {name!r} is no longer configured"}, None)  # fmt: skip
            return
        run_s: float | None = None
        try:
            if endpoint.kind == "runpod":
                await self._runpod(endpoint, task, attempt)
            else:
                await self._http(endpoint, task, attempt)
            return
        except (asyncio.CancelledError, StorageUnavailable):
            raise  # StorageUnavailable: the job goes on there; it is followed again (`_ended`)
        except _Failed as failed:
            error, run_s = failed.error, failed.run_s
        except Exception as exc:
            error = {"type": "cloud_error", "message": f"{endpoint.name}: {type(exc).__name__}: {exc}"}
        error = {**error, "message": _secret_out(endpoint, str(error.get("message", "")))}
        log.warning("escalation: task %s on %s failed: %s", task.id, endpoint.name, error["message"])
        await self._finish(task, attempt, False, None, error, run_s)

    def _deadline(self, endpoint: Endpoint, task: Task) -> tuple[float, float, str]:
        """(monotonic time the job began, its deadline, the limit's name): the endpoint's `timeout_s` or the
        task's own if shorter, counted from when the endpoint was given the task, so a restarted controller
        does not start the clock again."""
        limit, which = endpoint.timeout_s, f"{endpoint.name} timeout_s={endpoint.timeout_s:g}"
        if task.spec.timeout_s is not None and task.spec.timeout_s < limit:
            limit, which = task.spec.timeout_s, f"the task's timeout_s={task.spec.timeout_s:g}"
        given = task.leased_at or task.started_at
        elapsed = max(0.0, self.ctrl.clock() - given) if given else 0.0
        began = time.monotonic() - elapsed
        return began, began + limit, which

    def _headers(self, endpoint: Endpoint) -> dict[str, str]:
        return {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}

    async def _send(self, method: str, url: str, endpoint: Endpoint, deadline: float, *, most_s: float = CALL_S,
                    body: Any = None) -> _Answer:  # fmt: skip
        """One request, over by `deadline` (and within `most_s`) whatever the server does, its answer read up to
        `max_worker_body_bytes` (past it: `_Failed`). A 429 raises _Backoff with the wait it asks for.
        Redirects are not followed: the key goes to the configured URL only."""
        left = min(deadline - time.monotonic(), most_s)
        if left <= 0:
            raise asyncio.TimeoutError(f"{method} {url}: no time left")
        return await asyncio.wait_for(self._request(method, url, endpoint, left, body), left)

    async def _request(
        self, method: str, url: str, endpoint: Endpoint, timeout_s: float, body: Any
    ) -> _Answer:
        cap = self.ctrl.settings.request_limits.max_worker_body_bytes
        kwargs: dict[str, Any] = {} if body is None else {"json": body}
        async with self.http.stream(method, url, headers=self._headers(endpoint), timeout=timeout_s,
                                    **kwargs) as resp:  # fmt: skip
            if resp.status_code == 429:
                raise _Backoff(_retry_after(resp.headers.get("Retry-After"), endpoint.poll_s * 2))
            data = bytearray()
            async for chunk in resp.aiter_bytes():
                data += chunk
                if len(data) > cap:
                    raise _Failed({"type": "cloud_error", "message": f"{endpoint.name} answered more than "
                                   f"{cap} bytes (max_worker_body_bytes): too large"})  # fmt: skip
            return _Answer(resp.status_code, bytes(data))

    async def _pause(
        self, endpoint: Endpoint, task: Task, attempt: int, delay: float, deadline: float
    ) -> bool:
        """Wait `delay` (no further than `deadline`), looking every second (or `poll_s`) of a longer wait whether
        the task is still the endpoint's: False once it is not (cancelled in Turnout). Where the wait ends, the
        caller looks itself."""
        until = min(time.monotonic() + delay, deadline)
        while (left := until - time.monotonic()) > 0:
            await asyncio.sleep(min(left, max(endpoint.poll_s, 1.0)))
            if until > time.monotonic() and not await self.service.read(
                still_held, self.ctrl, task.id, attempt
            ):
                return False
        return True

    def _timed_out(self, endpoint: Endpoint, which: str, what: str, after: str = "") -> _Failed:
        return _Failed({"type": "timeout", "message": f"{endpoint.name} {what} within {which}{after}"})

    async def _runpod(self, endpoint: Endpoint, task: Task, attempt: int) -> None:
        job_id = task.routing.cloud_job if task.routing else None
        began, deadline, which = self._deadline(endpoint, task)
        while job_id is None:
            if not await self.service.read(still_held, self.ctrl, task.id, attempt):
                return  # cancelled before it was sent
            try:
                answer = await self._send("POST", f"{endpoint.url}/run", endpoint, deadline,
                                          body={"input": task.spec.input})  # fmt: skip
            except _Backoff as b:
                await self._pause(endpoint, task, attempt, b.delay_s, deadline)
                continue
            except asyncio.TimeoutError:
                raise self._timed_out(endpoint, which, "did not take the job") from None
            if not answer.ok:
                raise _Failed(_http_error(endpoint, "run", answer))
            job_id = _job_id(endpoint, _json(endpoint, "run", answer))
            await self.service.call(record_job, self.ctrl, task.id, attempt, job_id)
        try:
            await self._poll(endpoint, task, attempt, job_id, began, deadline, which)
        except (asyncio.CancelledError, StorageUnavailable):
            raise
        except Exception:
            await self._cancel(endpoint, job_id)
            raise

    async def _poll(self, endpoint: Endpoint, task: Task, attempt: int, job_id: str, began: float,
                    deadline: float, which: str) -> None:  # fmt: skip
        """Poll the job until it ends; a 5xx or a dropped poll is polled again (backing off) until the deadline.
        At the deadline it is polled once more before it is given up: a job that ended meanwhile (while a
        restarted controller was down, say) keeps its result, which the endpoint holds for 30 minutes."""
        delay = endpoint.poll_s
        gave_up = self._timed_out(endpoint, which, "did not finish the job", "; job cancelled")
        while True:
            if not await self.service.read(still_held, self.ctrl, task.id, attempt):
                await self._cancel(endpoint, job_id)  # cancelled in Turnout: stop the job there too
                return
            overdue = time.monotonic() >= deadline
            try:
                answer = await self._send("GET", f"{endpoint.url}/status/{job_id}", endpoint,
                                          time.monotonic() + LAST_POLL_S if overdue else deadline)  # fmt: skip
                if answer.status >= 500:
                    raise _Transient(f"HTTP {answer.status}")
                delay = endpoint.poll_s
            except (_Backoff, _Transient, httpx.TransportError, asyncio.TimeoutError) as exc:
                if overdue:
                    raise gave_up from None
                delay = max(exc.delay_s if isinstance(exc, _Backoff) else 0.0, delay * 2)
                log.info("escalation: polling job %s on %s: %s; again in %.3g s", job_id, endpoint.name,
                         type(exc).__name__, delay)  # fmt: skip
                await self._pause(endpoint, task, attempt, min(delay, MAX_WAIT_S), deadline)
                continue
            if not answer.ok:
                raise _Failed(_http_error(endpoint, "status", answer))
            body = _json(endpoint, "status", answer)
            status = body.get("status")
            wall = time.monotonic() - began
            seconds = _run_seconds(body.get("executionTime"), wall, deadline - began)
            if status == "COMPLETED":  # fetched at once: results expire 30 minutes after completion
                await self._finish(task, attempt, True, _output(endpoint, body.get("output")), None, seconds)
                return
            if status in ("FAILED", "CANCELLED", "TIMED_OUT"):
                kind = {"FAILED": "cloud_failed", "CANCELLED": "cloud_cancelled", "TIMED_OUT": "timeout"}[
                    status
                ]
                said = _shown(endpoint, str(body.get("error") or ""))
                error = {
                    "type": kind,
                    "message": f"{endpoint.name} job {job_id}: {status}: {said}".rstrip(": "),
                }
                await self._finish(task, attempt, False, None, error, seconds)
                return
            if overdue:
                raise gave_up
            if not await self._pause(endpoint, task, attempt, delay, deadline):
                await self._cancel(endpoint, job_id)
                return

    async def _cancel(self, endpoint: Endpoint, job_id: str) -> None:
        deadline = time.monotonic() + CALL_S
        for _ in range(5):
            try:
                await self._send("POST", f"{endpoint.url}/cancel/{job_id}", endpoint, deadline)
                return
            except _Backoff as b:
                await asyncio.sleep(min(b.delay_s, max(0.0, deadline - time.monotonic())))
            except Exception as exc:
                log.warning("escalation: cancelling job %s on %s failed: %s", job_id, endpoint.name,
                            _secret_out(endpoint, f"{type(exc).__name__}: {exc}"))  # fmt: skip
                return

    async def _http(self, endpoint: Endpoint, task: Task, attempt: int) -> None:
        began, deadline, which = self._deadline(endpoint, task)
        await self.service.call(record_job, self.ctrl, task.id, attempt, "http")
        while True:
            if not await self.service.read(still_held, self.ctrl, task.id, attempt):
                return  # cancelled in Turnout
            call = asyncio.create_task(self._send("POST", endpoint.url, endpoint, deadline, most_s=endpoint.timeout_s,
                                                  body={"input": task.spec.input}))  # fmt: skip
            while not call.done():
                await asyncio.wait({call}, timeout=endpoint.poll_s)
                if not call.done() and not await self.service.read(still_held, self.ctrl, task.id, attempt):
                    call.cancel()  # cancelled in Turnout: drop the request
                    return
            try:
                answer = call.result()
            except _Backoff as b:
                if not await self._pause(endpoint, task, attempt, b.delay_s, deadline):
                    return
                continue
            except (httpx.TimeoutException, asyncio.TimeoutError):
                raise self._timed_out(endpoint, which, "did not answer") from None
            seconds = time.monotonic() - began
            if not answer.ok:
                raise _Failed(_http_error(endpoint, "call", answer), seconds)
            output = _output(endpoint, _json(endpoint, "call", answer, want_object=False))
            await self._finish(task, attempt, True, output, None, seconds)
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


def _retry_after(value: str | None, fallback: float) -> float:
    """The wait a 429 asks for: `Retry-After` in seconds or as an HTTP date, else `fallback`; a value that is no
    time at all (NaN, infinite, in the past) counts as the fallback or the least wait, and none is over
    MAX_WAIT_S."""
    delay = fallback
    if value:
        try:
            delay = float(value)
        except ValueError:
            with contextlib.suppress(TypeError, ValueError, IndexError, OverflowError):
                delay = parsedate_to_datetime(value).timestamp() - time.time()
    if not math.isfinite(delay):
        delay = fallback
    return min(max(delay, 0.05), MAX_WAIT_S)


def _json(endpoint: Endpoint, what: str, answer: _Answer, *, want_object: bool = True) -> Any:
    try:
        body = json.loads(answer.body)
    except ValueError:
        raise _Failed({"type": "cloud_error", "message": f"{endpoint.name} {what}: answered HTTP {answer.status}"
                       f" that is not JSON: {_shown(endpoint, answer.body)}"}) from None  # fmt: skip
    if want_object and not isinstance(body, dict):
        raise _Failed({"type": "cloud_error", "message": f"{endpoint.name} {what}: answered a JSON "
                       f"{type(body).__name__}, not an object: {_shown(endpoint, answer.body)}"})  # fmt: skip
    return body


def _job_id(endpoint: Endpoint, body: dict[str, Any]) -> str:
    job = body.get("id")
    if isinstance(job, int) and not isinstance(job, bool):
        job = str(job)
    if not isinstance(job, str) or not JOB_ID.fullmatch(job):
        shown = jsonsafe.readable(repr(job), 80)
        raise _Failed({"type": "cloud_error", "message": f"{endpoint.name} run: answered no usable job id "
                       f"(1 to 200 letters, digits, . _ : -): {shown}"})  # fmt: skip
    return job


def _output(endpoint: Endpoint, output: Any) -> Any:
    """The endpoint's output, if strict JSON can carry it (NaN, 1e400 or a lone surrogate fail the task
    `invalid_output`, naming where: stored, they would be served as null or refused by PostgreSQL)."""
    where = jsonsafe.problem(output, "output")
    if where is not None:
        raise _Failed(jsonsafe.invalid_output(*where, f" (answered by {endpoint.name})"))
    return output


def _run_seconds(execution_ms: Any, wall_s: float, limit_s: float) -> float:
    """What a job is billed for: RunPod's `executionTime` (ms) where it is a believable duration (a number, not
    negative, no longer than the job's time limit or the time it has been out), else the time since it was sent."""
    if isinstance(execution_ms, bool) or not isinstance(execution_ms, int | float):
        return wall_s
    seconds = execution_ms / 1000.0
    return seconds if math.isfinite(seconds) and 0 <= seconds <= max(wall_s, limit_s) else wall_s


def _shown(endpoint: Endpoint, raw: bytes | str) -> str:
    """The start of an answer, for an error: printable, 300 characters, the key blanked before it is cut (a cut
    key would be kept in part)."""
    text = raw[:65536].decode("utf-8", "replace") if isinstance(raw, bytes) else raw[:65536]
    return jsonsafe.readable(_secret_out(endpoint, text), 300)


def _secret_out(endpoint: Endpoint, text: str) -> str:
    """`text` with the endpoint's key blanked: an endpoint (or a proxy) may echo its request's headers back."""
    return text.replace(endpoint.api_key, "***") if endpoint.api_key else text


def _http_error(endpoint: Endpoint, what: str, answer: _Answer) -> dict[str, Any]:
    return {
        "type": "cloud_error",
        "message": f"{endpoint.name} {what}: HTTP {answer.status}: {_shown(endpoint, answer.body)}",
    }
