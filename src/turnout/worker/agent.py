"""The worker agent: registers what this host can run, leases work that fits, runs it, reports back.

Four loops share one HTTP client: heartbeat (liveness and GPU metrics), lease (a long poll that also
names the tasks still running here, so the controller can tell us which to stop), and two senders that
batch completions and events, so a chatty task or a burst of tiny ones costs few requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import psutil

from turnout.access import WORKER_SECRET_HEADER
from turnout.errors import InvalidInput
from turnout.gpu.allocation import GpuRequest, fits_ever
from turnout.gpu.devices import GpuDevice, units_of
from turnout.gpu.provider import Discovery, discover
from turnout.models import Device, Variant
from turnout.worker.app import HandlerVariant, WorkerApplication
from turnout.worker.gpuwatch import GpuWatch, SharedTask, memory_over_limit, process_tree
from turnout.worker.processes import Outcome, ProcessPool, ProtocolProcess
from turnout.worker.visibility import gpu_env

log = logging.getLogger("turnout.worker")
PROCESS_FAULTS = frozenset({"timeout", "process_exited", "setup_failed", "gpu_memory_exceeded"})


@dataclass(frozen=True)
class AgentSettings:
    controller_url: str
    token: str | None
    name: str = field(default_factory=socket.gethostname)
    gpus: str = "auto"
    strategy: str = "pack"
    cpus: float | None = None  # default: this host's cores
    memory_bytes: int | None = None  # default: this host's memory
    heartbeat_s: float = 5.0
    max_lease: int = 64
    drain_grace_s: float = 30.0
    canary_command: list[str] | None = None  # re-admits a quarantined GPU when it exits 0
    canary_backoff_s: float = 30.0  # first wait before a quarantined GPU's canary; doubles on failure


@dataclass
class Runnable:
    """A variant this worker runs: its pool of processes and how one task's line is written."""

    variant: Variant
    pool: ProcessPool
    task_line: Callable[[dict[str, Any]], str]


def python_runnables(app_ref: str, app: WorkerApplication, base_env: dict[str, str]) -> list[Runnable]:
    """Warm `turnout.worker.runner` pools for each variant of a Python app."""
    out = []
    for hv in app.variants.values():
        out.append(Runnable(hv.variant, _python_pool(app_ref, hv, base_env), _wrapped_line))
    return out


def _python_pool(app_ref: str, hv: HandlerVariant, base_env: dict[str, str]) -> ProcessPool:
    def factory(key: tuple[str, ...]) -> ProtocolProcess:
        argv = [
            sys.executable,
            "-m",
            "turnout.worker.runner",
            app_ref,
            hv.variant.capability,
            hv.variant.device.value,
        ]
        return ProtocolProcess(argv, {**base_env, **gpu_env(key)}, lifeline_arg=True)

    return ProcessPool(factory, min_processes=hv.pool.min_processes, idle_timeout_s=hv.pool.idle_timeout_s)


def _wrapped_line(lease: dict[str, Any]) -> str:
    return json.dumps({"task_id": lease["id"], "attempt": lease["attempt"], "input": lease["input"],
                       "gpus": list((lease.get("gpus") or {}).get("uuids", []))})  # fmt: skip


def grant_key(grant: dict[str, Any] | None) -> tuple[str, ...]:
    """The GPUs (and shared-memory limit) a process is started with; () for a CPU process."""
    if not grant:
        return ()
    limit = "" if grant.get("exclusive") else str(grant.get("memory_bytes") or "")
    return (",".join(grant.get("uuids", [])), ",".join(str(i) for i in grant.get("indices", [])), limit,
            str(grant.get("unit_memory_bytes") or ""))  # fmt: skip


class Agent:
    def __init__(
        self, settings: AgentSettings, runnables: list[Runnable], discovery: Discovery | None = None
    ) -> None:
        self.settings = settings
        self.discovery = discovery or discover(settings.gpus)
        self.devices: list[GpuDevice] = list(self.discovery.devices)
        self.runnables = {
            f"{r.variant.capability}:{r.variant.device.value}": r for r in self.offered(runnables)
        }
        self.watch = GpuWatch(
            self.discovery.provider,
            [d.uuid for d in self.devices],
            canary_command=settings.canary_command,
            canary_backoff_s=settings.canary_backoff_s,
        )
        self._shared: dict[str, SharedTask] = {}  # running tasks that hold a share of a GPU's memory
        self._stop_reason: dict[str, dict[str, Any]] = {}  # why the worker itself stopped a task
        headers = {"Authorization": f"Bearer {settings.token}"} if settings.token else {}
        self.http = httpx.AsyncClient(base_url=settings.controller_url.rstrip("/"), headers=headers,
                                      timeout=httpx.Timeout(10.0, read=90.0))  # fmt: skip
        self.worker_id: str | None = None
        self.running: dict[str, asyncio.Task[None]] = {}
        self._completions: list[dict[str, Any]] = []
        self._events: list[dict[str, Any]] = []
        self._completions_ready = asyncio.Event()
        self._events_ready = asyncio.Event()
        self._events_lock = asyncio.Lock()  # one sender at a time, so events are stored once and in order
        self._leasing = True
        self._registered = asyncio.Event()

    def offered(self, runnables: list[Runnable]) -> list[Runnable]:
        """The variants this host's hardware can run: GPU variants only where some GPU could ever fit them."""
        units = units_of(self.devices)
        out = []
        for r in runnables:
            if r.variant.device is Device.GPU and not fits_ever(
                GpuRequest.from_resources(r.variant.resources), units
            ):
                log.info("not offering %s on gpu: no GPU here fits it", r.variant.capability)
                continue
            out.append(r)
        return out

    # ---- lifecycle -----------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        await self.register()
        loops = [asyncio.create_task(c) for c in (self._heartbeat_loop(), self._lease_loop(), self._send_completions(),
                                                   self._send_events(), self._reap_idle_loop())]  # fmt: skip
        for r in self.runnables.values():
            with contextlib.suppress(Exception):
                await r.pool.prewarm()
        try:
            await stop.wait()
        finally:
            await self.shutdown(loops)

    async def shutdown(self, loops: list[asyncio.Task[Any]]) -> None:
        """Stop leasing, let running tasks finish (up to the grace), report them, and leave."""
        self._leasing = False
        if self.running:
            await asyncio.wait(list(self.running.values()), timeout=self.settings.drain_grace_s)
        for t in list(self.running.values()):
            t.cancel()
        with contextlib.suppress(asyncio.TimeoutError):  # a controller that is gone too must not hold us
            await asyncio.wait_for(self._flush(), timeout=5.0)
        for loop in loops:
            loop.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        if self.worker_id:
            with contextlib.suppress(httpx.HTTPError):
                await self.http.post(f"/v1/workers/{self.worker_id}/leave", timeout=5)
        for r in self.runnables.values():
            await r.pool.close()
        await self.http.aclose()

    async def register(self) -> None:
        body = {
            "name": self.settings.name, "host": socket.gethostname(),
            "variants": [{"capability": r.variant.capability, "device": r.variant.device.value,
                          "resources": r.variant.resources.to_dict()} for r in self.runnables.values()],
            "cpu": self.settings.cpus or float(os.cpu_count() or 1),
            "memory": self.settings.memory_bytes or int(psutil.virtual_memory().total),
            "gpus": [d.to_dict() for d in self.devices], "strategy": self.settings.strategy,
            "heartbeat_s": self.settings.heartbeat_s,
        }  # fmt: skip
        if self.worker_id:
            body["worker_id"] = self.worker_id
        delay = 0.2
        while True:
            try:
                resp = await self.http.post("/v1/workers/register", json=body)
                if resp.status_code in (401, 403, 422):
                    raise InvalidInput(f"controller refused registration: {resp.text}", field="worker")
                resp.raise_for_status()
                answer = resp.json()
                self.worker_id = answer["id"]
                # who we are, on every later call (registering again included): our token and this secret
                self.http.headers[WORKER_SECRET_HEADER] = answer["secret"]
                self._registered.set()
                log.info(
                    "registered as %s with %d variants, %d GPUs",
                    self.worker_id,
                    len(self.runnables),
                    len(self.devices),
                )
                return
            except httpx.HTTPError as exc:
                log.warning(
                    "controller not reachable at %s (%s); retrying", self.settings.controller_url, exc
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    # ---- loops ---------------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            try:
                metrics = await asyncio.get_running_loop().run_in_executor(None, self._metrics)
                self._enforce_memory_limits()
                resp = await self.http.post(f"/v1/workers/{self.worker_id}/heartbeat",
                                            json={"metrics": metrics, "quarantined": self.watch.quarantined()})  # fmt: skip
                if resp.status_code == 404:
                    await self.register()
            except httpx.HTTPError as exc:
                log.warning("heartbeat failed: %s", exc)

    def _metrics(self) -> dict[str, Any]:
        gpus = [asdict(m) for m in self.watch.sample()] if self.devices else []
        return {
            "gpus": gpus,
            "cpu_pct": psutil.cpu_percent(),
            "running": len(self.running),
            "ts": time.time(),
        }

    def _enforce_memory_limits(self) -> None:
        """Stop each task measured above its share of GPU memory, with `gpu_memory_exceeded`."""
        if not self._shared or not self.watch.last:
            return
        tasks = list(self._shared.values())
        over = memory_over_limit(tasks, self.watch.last, process_tree(t.pid for t in tasks))
        for task_id, used in over.items():
            limit = self._shared[task_id].limit_bytes
            self._stop(task_id, {"type": "gpu_memory_exceeded",
                                 "message": f"used {used} bytes of GPU memory, over its share of {limit} bytes"})  # fmt: skip

    def _stop(self, task_id: str, error: dict[str, Any]) -> None:
        running = self.running.get(task_id)
        if running is not None:
            log.warning("stopping task %s: %s", task_id, error["message"])
            self._stop_reason[task_id] = error
            running.cancel()

    async def _lease_loop(self) -> None:
        delay = 0.2
        while True:
            if not self._leasing:
                return
            try:
                resp = await self.http.post(
                    f"/v1/workers/{self.worker_id}/lease",
                    json={"max_tasks": self.settings.max_lease, "wait_s": 20, "running": list(self.running)},
                )
                if resp.status_code == 404:
                    await self.register()
                    continue
                resp.raise_for_status()
                delay = 0.2
            except httpx.HTTPError as exc:
                log.warning("lease failed: %s", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            body = resp.json()
            for task_id in body.get("cancel", []):
                running = self.running.get(task_id)
                if running is not None:
                    log.info("stopping task %s: the controller no longer assigns it here", task_id)
                    running.cancel()
            for lease in body.get("tasks", []):
                self.running[lease["id"]] = asyncio.create_task(self._execute(lease))

    async def _execute(self, lease: dict[str, Any]) -> None:
        task_id, attempt = lease["id"], lease["attempt"]
        runnable = self.runnables.get(f"{lease['capability']}:{lease['device']}")

        def sink(event: dict[str, Any]) -> None:
            self._events.append({"task_id": task_id, "attempt": attempt, "event": event})
            self._events_ready.set()

        try:
            if runnable is None:
                outcome = Outcome(
                    False,
                    error={
                        "type": "not_served",
                        "message": f"{lease['capability']} on {lease['device']} is not served here",
                    },
                )
            else:
                key = grant_key(lease.get("gpus"))
                proc = await runnable.pool.acquire(key, task_id)
                reusable = False
                grant = lease.get("gpus") or {}
                if grant and not grant.get("exclusive") and proc.pid:
                    self._shared[task_id] = SharedTask(task_id, proc.pid, tuple(grant.get("uuids", [])),
                                                       int(grant.get("memory_bytes", 0)))  # fmt: skip
                try:
                    outcome = await proc.run(runnable.task_line(lease), sink, lease.get("timeout_s"))
                    # a failure the program reported itself leaves it warm; a timeout or a crash does not
                    reusable = proc.alive and (outcome.error or {}).get("type") not in PROCESS_FAULTS
                finally:
                    self._shared.pop(task_id, None)
                    runnable.pool.release(proc, key, reusable)
        except asyncio.CancelledError:
            self.running.pop(task_id, None)
            reason = self._stop_reason.pop(task_id, None)
            if reason is None:
                return  # the controller asked us to stop: it already knows
            outcome = Outcome(False, error=reason)
        except Exception as exc:
            log.exception("task %s could not run", task_id)
            outcome = Outcome(
                False, error={"type": "worker_error", "message": f"{type(exc).__name__}: {exc}"}
            )
        self.running.pop(task_id, None)
        self._completions.append({
            "task_id": task_id, "attempt": attempt, "status": "succeeded" if outcome.succeeded else "failed",
            "output": outcome.output, "error": outcome.error, "run_s": outcome.run_s, "started_at": outcome.started_at,
        })  # fmt: skip
        self._completions_ready.set()

    async def _send_completions(self) -> None:
        await self._drain_forever(self._completions_ready, self._post_completions)

    async def _send_events(self) -> None:
        await self._drain_forever(self._events_ready, self._post_events)

    async def _drain_forever(self, ready: asyncio.Event, post: Callable[[], Awaitable[None]]) -> None:
        """Send whatever accumulated while the previous request was in flight: natural batching."""
        while True:
            await ready.wait()
            ready.clear()
            await post()

    async def _post_events(self) -> None:
        async with self._events_lock:
            await self._post_batch(self._events, "events", "events")

    async def _post_completions(self) -> None:
        # A task's events are stored before its completion: a stream that ends when the task does misses none.
        await self._post_events()
        await self._post_batch(self._completions, "complete", "results")

    async def _post_batch(self, buf: list[dict[str, Any]], path: str, key: str) -> None:
        while buf:
            batch = buf[:5000]
            try:
                resp = await self.http.post(
                    f"/v1/workers/{self.worker_id}/{path}", json={key: batch}, timeout=30
                )
                resp.raise_for_status()
                del buf[: len(batch)]
            except httpx.HTTPError as exc:
                log.warning("sending %s failed (%s); retrying", path, exc)
                await asyncio.sleep(0.5)

    async def _flush(self) -> None:
        await self._post_completions()

    async def _reap_idle_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            for r in self.runnables.values():
                await r.pool.reap_idle()

    def handler_pids(self) -> list[int]:
        return [pid for r in self.runnables.values() for pid in r.pool.pids()]
