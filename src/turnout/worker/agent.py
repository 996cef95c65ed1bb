"""The worker agent: registers what this host can run, leases work that fits, runs it, reports back.

Four loops share one controller client (`client.py`): heartbeat (liveness and GPU metrics), lease (a long
poll that also names the tasks still running here, so the controller can tell us which to stop), and two
senders that batch completions and events, so a chatty task or a burst of tiny ones costs few requests. A
completion goes out at once, and where work waits for the room it frees (a backlog, a pipeline's next stage)
it asks for that work in the same request (`complete` with `lease`): no second round trip. The long poll,
which waits for new tasks whenever there is room, takes the rest.
Every result and event is checked once as it is queued (`reports`): what JSON cannot carry fails its task
with `invalid_output`, and the senders never die, whatever the controller answers.
Running a task is the executor's (`executors.py`); the agent keeps the books: what runs here, since when,
what waits to be reported, and which pipeline stages it chained.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import psutil

from turnout.errors import InvalidInput
from turnout.gpu.allocation import GpuRequest, fits_ever
from turnout.gpu.devices import GpuDevice, units_of
from turnout.gpu.provider import Discovery, discover
from turnout.models import Device
from turnout.worker.chains import CHAIN_HOLD_S, ChainBook, chained_lease, reorder
from turnout.worker.client import ControllerClient
from turnout.worker.delivery import Refusal, Replace, deliver
from turnout.worker.executors import Executor, Ran, groups, variant_key
from turnout.worker.files import WorkerFiles
from turnout.worker.gpuwatch import GpuWatch, memory_over_limit, process_tree
from turnout.worker.handover import HandOver
from turnout.worker.pools import Runnable
from turnout.worker.reports import (
    checked_completion,
    encode,
    event_problem,
    invalid_output,
    refused_completion,
    with_event_failure,
)
from turnout.worker.slots import Slots

log = logging.getLogger("turnout.worker")
MAX_REPORT_BATCH = 5000
MAX_PREFETCH = 1000  # the lease request's limit
# `--prefetch auto` (the default): up to this many tasks held waiting, only tasks the controller has seen end in
# a short time, and only while their expected work stays within this many seconds per core
AUTO_PREFETCH = 64
AUTO_PREFETCH_S = 0.1


def prefetch_of(text: str) -> tuple[int, float | None]:
    """`--prefetch`: `auto` (tasks known short, AUTO_PREFETCH_S of work per core at most), or N tasks of any
    run time (0: none), as (prefetch, prefetch_s)."""
    if text.strip().lower() == "auto":
        return AUTO_PREFETCH, AUTO_PREFETCH_S
    try:
        return int(text), None
    except ValueError:
        raise InvalidInput(f"--prefetch: {text!r} is not auto or a number of tasks from 0 to {MAX_PREFETCH}",
                           field="prefetch") from None  # fmt: skip


# a report's ask for work: "always", or "if_queued": only for what its results queue themselves
WorkAsk = Literal["always", "if_queued"]


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
    prefetch: int = AUTO_PREFETCH  # tasks to hold waiting beyond what runs: a slot that ends starts the next
    prefetch_s: float | None = AUTO_PREFETCH_S  # only tasks known short, this much work per core (None: any)
    drain_grace_s: float = 30.0
    canary_command: list[str] | None = None  # re-admits a quarantined GPU when it exits 0
    canary_backoff_s: float = 30.0  # first wait before a quarantined GPU's canary; doubles on failure
    scrub_command: str | None = None  # run on a GPU before another tenant's task gets it ("builtin": torch)
    ca_cert: Path | None = None  # trust this CA (PEM) for an https controller, e.g. a private one
    storage: Path | None = None  # the controller's file storage, mounted here: files move without HTTP
    lease_wait_s: float = 20.0  # how long one lease request waits for work at the controller
    channel: bool = True  # leases and reports over the controller's WebSocket channel where it offers one

    def __post_init__(self) -> None:
        """Refuse what no worker could run with (a NaN or negative core count, a heartbeat of 0 s), naming the
        option, before anything starts: such values used to reach the registration or spin a loop."""
        positive = {"cpus": self.cpus, "memory_bytes": self.memory_bytes, "heartbeat_s": self.heartbeat_s,
                    "canary_backoff_s": self.canary_backoff_s, "lease_wait_s": self.lease_wait_s}  # fmt: skip
        flags = {"cpus": "--cpus", "heartbeat_s": "--heartbeat-s", "canary_backoff_s": "--canary-backoff-s"}
        for name, value in positive.items():
            if value is not None and not (math.isfinite(value) and value > 0):
                raise InvalidInput(f"{flags.get(name, name)}: {value!r} is not a positive number", field=name)
        if not (math.isfinite(self.drain_grace_s) and self.drain_grace_s >= 0):
            raise InvalidInput(f"drain_grace_s: {self.drain_grace_s!r} is not a number of seconds >= 0",
                               field="drain_grace_s")  # fmt: skip
        if self.max_lease < 1:
            raise InvalidInput(f"max_lease: {self.max_lease!r} is not 1 or more", field="max_lease")
        if not 0 <= self.prefetch <= MAX_PREFETCH:
            raise InvalidInput(f"--prefetch: {self.prefetch!r} is not a number of tasks from 0 to {MAX_PREFETCH}",
                               field="prefetch")  # fmt: skip
        ahead_s = self.prefetch_s
        if ahead_s is not None and not (math.isfinite(ahead_s) and 0 < ahead_s <= 3600):
            raise InvalidInput(f"prefetch_s: {self.prefetch_s!r} is not a number of seconds above 0, up to 3600",
                               field="prefetch_s")  # fmt: skip


def _job_cpu(leases: list[dict[str, Any]]) -> float:
    """The CPU one job holds: its first lease's (a batch's riders hold none of their own)."""
    return float((leases[0].get("resources") or {}).get("cpu") or 0.0)


def jittered(delay_s: float) -> float:
    """Half to all of `delay_s`: workers cut off together do not all come back in the same instant."""
    return delay_s * (0.5 + random.random() / 2)


class Agent:
    """One worker: its loops, and the books they share (what runs here, what waits to be reported)."""

    def __init__(
        self,
        settings: AgentSettings,
        runnables: list[Runnable],
        discovery: Discovery | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,  # tests: a stand-in controller in-process
    ) -> None:
        self.settings = settings
        self.discovery = discovery or discover(settings.gpus)
        self.devices: list[GpuDevice] = list(self.discovery.devices)
        self.runnables = {
            variant_key(r.variant.capability, r.variant.device.value): r for r in self.offered(runnables)
        }
        self.watch = GpuWatch(
            self.discovery.provider,
            [d.uuid for d in self.devices],
            canary_command=settings.canary_command,
            canary_backoff_s=settings.canary_backoff_s,
        )
        self._stop_reason: dict[str, dict[str, Any]] = {}  # why the worker itself stopped a task
        self.client = ControllerClient(settings.controller_url, settings.token, transport=transport,
                                       ca_cert=settings.ca_cert, channel=settings.channel)  # fmt: skip
        self.files = WorkerFiles(self.client.http, storage=settings.storage)
        self.hand_over = HandOver(settings.scrub_command, close_idle=self._close_idle_on,
                                  record=self._record_scrub, quarantine=self._quarantine,
                                  quarantined=self.watch.quarantined)  # fmt: skip
        self.executor = Executor(self.runnables, self.files, self.hand_over)
        self.running: dict[str, asyncio.Task[None]] = {}
        self._completions: list[dict[str, Any]] = []
        self._events: list[dict[str, Any]] = []
        self._completions_ready = asyncio.Event()
        self._events_ready = asyncio.Event()
        self._events_lock = asyncio.Lock()  # one sender at a time, so events are stored once and in order
        self._completions_lock = asyncio.Lock()  # the loop and a shutdown flush must not send one twice
        # (task_id, attempt) -> the invalid_output error of an event of that attempt that could not be carried
        self._event_failures: dict[tuple[str, int], dict[str, Any]] = {}
        self._leasing = True
        self._registered = asyncio.Event()
        self._beat_now = asyncio.Event()  # heartbeat at once (a GPU was just quarantined)
        self._scrubs: list[dict[str, Any]] = []
        self._scrubs_lock = asyncio.Lock()
        self._batch_of: dict[str, frozenset[str]] = {}  # task id -> the ids of the batch it runs in
        self._unwanted: set[str] = set()  # batch members the controller asked us to stop
        # Leases arrive by two requests that may cross (the long poll, a completion's lease): each task started
        # is numbered, and an answer's `cancel` applies only to tasks started before its request was sent.
        self._started = 0
        self._started_as: dict[str, int] = {}  # task id -> its number
        self._backlog = False  # the last lease answer said work for this worker stays queued
        # tasks whose results should ask for work (see `_wants_work`): always (True), or only for what they queue
        self._asks_work: dict[str, bool] = {}
        self._cpu_of: dict[str, float] = {}  # running task id -> the CPU its lease holds
        self.chains = ChainBook()  # pipeline stages started here before their tasks exist (chains.py)
        # with `prefetch`: the CPU held by jobs running here, and the tasks waiting for it (slots.py)
        self._slots = Slots(self._cpus()) if settings.prefetch else None
        self._waiting: set[str] = set()

    @property
    def worker_id(self) -> str | None:
        """The id the controller gave this worker (None until registered)."""
        return self.client.worker_id

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

    async def run(self, stop: asyncio.Event, stop_now: asyncio.Event | None = None) -> None:
        """Serve until `stop`, then drain: running tasks get `drain_grace_s` to finish, or until `stop_now`.
        A stop while the controller has never answered (it is down, or the URL is wrong) ends the retries:
        there is nothing to drain, and a SIGTERM must not wait for a controller that may never come."""
        registering = asyncio.ensure_future(self.register())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({registering, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not registering.done():
            registering.cancel()
            await asyncio.gather(registering, return_exceptions=True)
            log.info("stopped before the controller at %s answered", self.settings.controller_url)
            await self.shutdown([], stop_now)
            return
        registering.result()  # a refusal (a bad token) ends the worker with its message
        loops = [asyncio.create_task(c) for c in (self._heartbeat_loop(), self._lease_loop(), self._send_completions(),
                                                   self._send_events(), self._reap_idle_loop(),
                                                   self._lifeline_loop())]  # fmt: skip
        for r in self.runnables.values():
            with contextlib.suppress(Exception):
                await r.pool.prewarm()
        try:
            await stop.wait()
        finally:
            await self.shutdown(loops, stop_now)

    async def shutdown(self, loops: list[asyncio.Task[Any]], stop_now: asyncio.Event | None = None) -> None:
        """Stop leasing, let running tasks finish (up to the grace, or until `stop_now`), report them, and
        leave: what is still running then is stopped, and the controller queues it again as the worker leaves.
        Tasks waiting here for a free slot (`prefetch`) never start: they go back to the queue as it leaves."""
        self._leasing = False
        for task_id in list(self._waiting):
            job = self.running.get(task_id)
            if job is not None:
                job.cancel()
        if self.running:
            drained = asyncio.ensure_future(asyncio.wait(list(self.running.values())))
            hurried = asyncio.ensure_future((stop_now or asyncio.Event()).wait())
            await asyncio.wait({drained, hurried}, timeout=self.settings.drain_grace_s,
                               return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            drained.cancel()  # the wait only: the tasks run on until cancelled below
            hurried.cancel()
        for t in list(self.running.values()):
            t.cancel()
        try:  # a controller that is gone too must not hold us, nor a report it cannot take
            await asyncio.wait_for(self._flush(), timeout=5.0)
        except asyncio.TimeoutError:
            log.warning("leaving with %d results and %d events unsent: the controller did not take them in 5 s",
                        len(self._completions), len(self._events))  # fmt: skip
        except Exception:
            log.exception("sending the last reports failed; leaving anyway")
        for loop in loops:
            loop.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        if self.worker_id:
            await self.client.leave()
        for r in self.runnables.values():
            await r.pool.close()
        await self.client.aclose()
        self.files.close()

    async def register(self) -> None:
        body = {
            "name": self.settings.name, "host": socket.gethostname(),
            "variants": [r.variant.to_dict() for r in self.runnables.values()],
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
                await self.client.register(body)
                self.files.worker_id = self.worker_id
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
                await asyncio.sleep(jittered(delay))
                delay = min(delay * 2, 5.0)

    # ---- loops ---------------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._beat_now.wait(), self.settings.heartbeat_s)
            self._beat_now.clear()
            try:
                metrics = await asyncio.get_running_loop().run_in_executor(None, self._metrics)
                if self.files.shared is not None:  # its tasks' outputs are not the storage sweep's to take
                    await asyncio.get_running_loop().run_in_executor(None, self.files.keep_in_use)
                self._enforce_memory_limits()
                # bounded by the period: a beat stuck on a dead connection must not hold back the next ones
                known = await self.client.heartbeat(metrics, self.watch.quarantined(),
                                                    timeout_s=max(2.0, 2 * self.settings.heartbeat_s))  # fmt: skip
                if not known:
                    await self.register()
            except httpx.HTTPError as exc:
                log.warning("heartbeat failed: %s", exc)
            except Exception:  # e.g. metrics JSON cannot carry: the next beat must still happen
                log.exception("heartbeat failed")

    def _metrics(self) -> dict[str, Any]:
        gpus = [asdict(m) for m in self.watch.sample()] if self.devices else []
        return {
            "gpus": gpus,
            "cpu_pct": psutil.cpu_percent(),
            "running": len(self.running),
            "ts": time.time(),
            "pools": self.pools(),
        }

    def pools(self) -> dict[str, dict[str, int]]:
        """Per variant (`capability:device`): idle warm processes, live ones (model loaded, busy or idle), all
        (starting too), and starts so far. The controller prefers a worker with the variant's model loaded."""
        return {key: {"warm": r.pool.warm(), "loaded": r.pool.loaded(), "size": r.pool.size,
                      "started": r.pool.started_total} for key, r in self.runnables.items()}  # fmt: skip

    def _enforce_memory_limits(self) -> None:
        """Stop each task measured above its share of GPU memory, with `gpu_memory_exceeded`."""
        shared = self.executor.shared
        if not shared or not self.watch.last:
            return
        tasks = list(shared.values())
        over = memory_over_limit(tasks, self.watch.last, process_tree(t.pid for t in tasks))
        for task_id, used in over.items():
            limit = shared[task_id].limit_bytes
            self._stop(task_id, {"type": "gpu_memory_exceeded",
                                 "message": f"used {used} bytes of GPU memory, over its share of {limit} bytes"})  # fmt: skip

    def _stop(self, task_id: str, error: dict[str, Any]) -> None:
        running = self.running.get(task_id)
        if running is not None:
            log.warning("stopping task %s: %s", task_id, error["message"])
            self._stop_reason[task_id] = error
            running.cancel()

    def _ask(self) -> dict[str, Any]:
        """A request for work: how many tasks at most, what this worker holds, and with `prefetch`, how many
        it would hold waiting and which of those it holds have not started."""
        ask: dict[str, Any] = {"max_tasks": self.settings.max_lease, "running": self._held()}
        features, prefetch_s = self.client.features, self.settings.prefetch_s
        # a controller that cannot tell short tasks from long gets no `auto` prefetch: it would hold any
        knows = "prefetch" in features and (prefetch_s is None or "prefetch_s" in features)
        if self.settings.prefetch and knows:
            ask["prefetch"] = self.settings.prefetch
            ask["waiting"] = sorted(self._waiting)
            if prefetch_s is not None:
                ask["prefetch_s"] = prefetch_s
            if "prefetch_gpu" in features:
                ask["prefetch_gpu"] = True  # it starts a lease `after` a task here only once that one ended
        return ask

    def _cpus(self) -> float:
        return self.settings.cpus or float(os.cpu_count() or 1)

    def _held(self) -> list[str]:
        """What this worker holds: running, or finished with its result not yet sent. The controller re-queues
        a lease the worker does not list (its answer was lost), so a lease request lists all of these."""
        held = [*self.running, *(c["task_id"] for c in self._completions)]
        return [tid for tid in held if not self.chains.unconfirmed(tid)]  # unknown there yet: never stopped

    async def _lease_loop(self) -> None:
        delay = 0.2
        since: str | None = None  # the last answer's `since`: the next poll parks at once if nothing changed
        while True:
            if not self._leasing:
                return
            sent_as = self._started
            ask = self._ask()
            if since is not None:
                ask["since"] = since
            since = None
            try:
                answer = await self.client.lease(ask, self.settings.lease_wait_s)
                if answer is None:
                    await self.register()
                    continue
                delay = 0.2
            except httpx.HTTPError as exc:
                log.warning("lease failed: %s", exc)
                await asyncio.sleep(jittered(delay))
                delay = min(delay * 2, 5.0)
                continue
            since = answer.get("since") if isinstance(answer.get("since"), str) else None
            if self._accept(answer, sent_as):
                # the tasks it started go to their processes before the next poll goes out: a warm process
                # gets its line in their first step, and the poll's trip and the controller's look at the
                # queue are then not on their way
                await asyncio.sleep(0)

    def _accept(self, answer: dict[str, Any], sent_as: int) -> bool:
        """Act on a lease answer (`{tasks, cancel, backlog}`) to a request sent when `sent_as` tasks had been
        started: stop what it cancels, start what it leases; whether it started any."""
        self._backlog = bool(answer.get("backlog"))
        for task_id in answer.get("cancel", []):
            running = self.running.get(task_id)
            if running is None or self._started_as.get(task_id, 0) > sent_as:
                continue  # not here, or leased to us again since the request that this answers was sent
            batch = self._batch_of.get(task_id)
            if batch is not None:  # one process runs the batch: stop it only once no task in it is wanted
                self._unwanted.add(task_id)
                if not batch <= self._unwanted:
                    continue
                self._unwanted -= batch
            log.info("stopping task %s: the controller no longer assigns it here", task_id)
            running.cancel()
        leased = groups(answer.get("tasks", []))
        for group in leased:
            job = asyncio.create_task(self._execute(group))
            members = frozenset(lease["id"] for lease in group)
            self._started += 1
            for lease in group:
                self.running[lease["id"]] = job
                self._started_as[lease["id"]] = self._started
                self._cpu_of[lease["id"]] = float((lease.get("resources") or {}).get("cpu") or 0.0)
                if len(group) > 1:
                    self._batch_of[lease["id"]] = members
        return bool(leased)

    def _forget(self, task_id: str) -> None:
        """The task ended here (its result is queued, or the controller stopped it)."""
        self.running.pop(task_id, None)
        self._batch_of.pop(task_id, None)
        self._started_as.pop(task_id, None)
        self._cpu_of.pop(task_id, None)

    def _full(self) -> bool:
        """Whether the tasks held here (running, or waiting for a slot) leave no room for the smallest variant,
        as the controller counts CPU."""
        cpus = self._cpus()
        smallest = min((r.variant.resources.cpu for r in self.runnables.values()), default=0.0)
        return sum(self._cpu_of.values()) + smallest > cpus + 1e-9

    def _wants_work(self, results: list[dict[str, Any]]) -> WorkAsk | None:
        """Whether these results should ask for work: always where the last lease answer said work for this
        worker stays queued, or a result frees room the long poll was not waiting with (the worker was full,
        or the task held GPUs); only for what they queue themselves (`if_queued`) where a result may queue work
        (a pipeline's stage, a failure that may be retried). Otherwise the long poll, which waits for new tasks
        whenever there is room, takes what comes next, and the results' commit waits for no lease that would
        find nothing."""
        asks = [self._asks_work[tid] for r in results if (tid := r.get("task_id")) in self._asks_work]
        if self._backlog or any(asks):
            return "always"
        return "if_queued" if asks else None

    def _lease_ask(self, want: WorkAsk) -> tuple[bytes, int] | None:
        """The `lease` a completion carries, encoded, and how many tasks had been started; None when this worker
        leases no more (it is stopping) or its controller does not take a lease there."""
        if not self._leasing or "complete_lease" not in self.client.features:
            return None
        ask = self._ask()
        if want == "if_queued" and "lease_if_queued" in self.client.features:
            ask["if_queued"] = True
        return encode(ask), self._started

    async def _execute(self, leases: list[dict[str, Any]], handed: float | None = None) -> None:
        """Run one job (a task, or a batch: `executors.py`) and queue each task's result, in lease order.

        Each task keeps its own events, its own result, and its share of the run and cold-start seconds. With
        `prefetch`, the job first waits for room here (slots.py); `handed`: the CPU of the stage before it,
        whose room it takes over.
        """
        sinks = [self._sink_for(lease["id"], lease["attempt"]) for lease in leases]
        cpu = _job_cpu(leases)
        slots, kept = self._slots, False
        if slots is not None:
            if handed is not None:
                slots.hand_over(handed, cpu)
            elif not await self._hold(slots, leases, cpu):
                return
        try:
            ran = await self.executor.run(leases, sinks, lambda: self._stopped(leases))
        except asyncio.CancelledError:
            return  # the controller asked us to stop: it already knows
        else:
            kept = self._queue_results(leases, ran, cpu)
        finally:
            if slots is not None:  # before the report is sent: a waiting task starts first
                ids = [lease["id"] for lease in leases]
                if kept:  # a chained stage took its room: a task that follows it waits for room instead
                    slots.forsake(ids)
                else:
                    slots.release(cpu, ids)
        if not kept:  # a chained stage's result goes with the next stage's (`_hold_over`)
            self._completions_ready.set()
        # the result (and the next lease) go out first; the empty directories can go while they travel
        await asyncio.sleep(0)
        await self.executor.clean(ran.files)

    async def _hold(self, slots: Slots, leases: list[dict[str, Any]], cpu: float) -> bool:
        """Wait for room for the job here; False: it was stopped while it waited (its books are closed)."""
        ids = [lease["id"] for lease in leases]
        self._waiting.update(ids)
        leader = leases[0].get("after")  # a GPU task held ahead on the share of a task that runs here
        try:
            if isinstance(leader, str) and leader in self.running:
                await slots.follow(leader, cpu, ids)
            else:  # that one ended before this lease came: its share is free
                await slots.hold(cpu, ahead=bool(leases[0].get("ahead")))
            return True
        except asyncio.CancelledError:
            slots.forsake(ids)  # a task that follows one of these waits for room instead
            self._stopped(leases)
            return False
        finally:
            self._waiting.difference_update(ids)

    def _stopped(self, leases: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The job was cancelled: forget its tasks, and say why if the worker itself stopped one (None: the
        controller did, and expects no report; what their events lost is forgotten too)."""
        reasons = [self._stop_reason.pop(lease["id"], None) for lease in leases]
        for lease in leases:
            self._forget(lease["id"])
        if all(r is None for r in reasons):
            for lease in leases:
                self._event_failures.pop((lease["id"], lease["attempt"]), None)
            return None
        return next(r for r in reasons if r is not None)

    def _queue_results(self, leases: list[dict[str, Any]], ran: Ran, cpu: float) -> bool:
        """Queue each task's checked result (for the sender, which the caller wakes); start the pipeline stage
        it chains, if any (chains.py), which takes over the job's `cpu`: whether it did."""
        first = leases[0]
        frees_room = self._full() or bool(first.get("gpus"))  # room the long poll was not waiting with
        chained: dict[str, Any] | None = None  # the next pipeline stage, started here at once
        for i, lease in enumerate(leases):
            self._forget(lease["id"])
            checked = checked_completion(ran.completion(i, lease))
            if checked["status"] == "succeeded" and len(leases) == 1:  # a batch of one chains as a task does
                chained = self._chain_after(lease, checked["output"], cpu)
                if chained is not None:
                    checked["chain"] = chained["id"]
            if frees_room:
                self._asks_work[lease["id"]] = True
            elif checked["status"] != "succeeded" or (
                "pipeline" in (lease.get("labels") or {}) and chained is None
            ):
                self._asks_work[lease["id"]] = False  # it may queue work: a retry, the run's next stage
            self._completions.append(checked)
        if chained is not None:  # its result waits a moment for the next stage's, to go in one report
            self._start_chained(first["id"], chained, cpu)
            asyncio.get_running_loop().call_later(CHAIN_HOLD_S, self._hold_over, first["id"])
            return True
        return False

    def _hold_over(self, task_id: str) -> None:
        """A result held for the stage chained after it waited its `CHAIN_HOLD_S`: send it, if it is still here.
        A hold that ended long ago (its result went with the stage's) wakes no sender: that wake-up would send
        the first result of a later run alone, and split its report in two."""
        if any(c.get("task_id") == task_id for c in self._completions):
            self._completions_ready.set()

    def _chain_after(self, lease: dict[str, Any], output: Any, held: float) -> dict[str, Any] | None:
        """The lease of the pipeline stage to start here right after `lease` succeeded, if the controller listed
        one, this worker serves it, is not stopping, and has room for it (chains.py): with `prefetch`, the room
        the stage before it `held` and passes on."""
        steps = lease.get("chain")
        if not steps or not self._leasing or "chain" not in self.client.features:
            return None
        runnable = self.executor.runnable(steps[0].get("capability"), Device.CPU.value)
        if runnable is None:
            return None
        need = runnable.variant.resources.cpu
        running = self._slots.used - held if self._slots is not None else sum(self._cpu_of.values())
        if running + need > self._cpus() + 1e-9:
            return None
        try:
            return chained_lease(lease, output, runnable.variant.resources.to_dict())
        except (ValueError, TypeError, KeyError, AttributeError):
            log.exception("task %s: could not chain the stage after it; it is queued instead", lease["id"])
            return None

    def _start_chained(self, parent: str, lease: dict[str, Any], held: float) -> None:
        """Run the chained stage now, in the room its parent `held`; it stays unconfirmed until the parent's
        result is answered."""
        self.chains.start(parent, lease["id"])
        self.running[lease["id"]] = asyncio.create_task(self._execute([lease], handed=held))
        self._cpu_of[lease["id"]] = float(lease["resources"].get("cpu") or 0.0)

    def _settle_chains(self, answer: dict[str, Any]) -> None:
        """A report's answer decided the stages chained after its results: go on with some, stop the others."""
        confirmed, refused = self.chains.settle(answer)
        for task_id in confirmed:
            if task_id in self.running:  # from now on a lease answer may stop it, like any task leased here
                self._started += 1
                self._started_as[task_id] = self._started
        for task_id in refused:
            log.info(
                "task %s: the controller queued this stage instead of chaining it here; stopping it", task_id
            )
            job = self.running.get(task_id)
            if job is not None:
                job.cancel()
        if confirmed or refused:  # their reports may go (or be dropped) now
            self._events_ready.set()
            self._completions_ready.set()

    def _sink_for(self, task_id: str, attempt: int) -> Callable[[dict[str, Any]], None]:
        emitted = 0

        def sink(event: dict[str, Any]) -> None:
            nonlocal emitted
            emitted += 1
            where = event_problem(event, emitted)
            if where is not None:
                self._event_not_carried(task_id, attempt, invalid_output(*where))
                return
            self._events.append({"task_id": task_id, "attempt": attempt, "event": event})
            self._events_ready.set()

        return sink

    def _event_not_carried(self, task_id: str, attempt: int, error: dict[str, Any]) -> None:
        """An event of this attempt is dropped, and its task will fail `invalid_output` (see `with_event_failure`).

        Only the first bad event of an attempt is reported (a progress loop may emit NaN a million times);
        followers of the stream see a `log` event saying what was dropped, where the event would have been.
        """
        key = (task_id, attempt)
        if key in self._event_failures:
            return
        self._event_failures[key] = error
        log.warning("task %s: an event was dropped: %s", task_id, error["message"])
        note = {"event": "log", "stream": "turnout", "line": f"event dropped: {error['message']}"}
        self._events.append({"task_id": task_id, "attempt": attempt, "event": note})
        self._events_ready.set()

    async def _record_scrub(self, record: dict[str, Any]) -> None:
        """Queue one scrub's record (the audit of a hand-over) and deliver what is queued."""
        self._scrubs.append(record)
        await self._post_scrubs()

    async def _post_scrubs(self) -> None:
        """Deliver the queued scrub records; returns once each is settled."""
        async with self._scrubs_lock:  # concurrent hand-overs on other GPUs: each record is posted once
            await self._post_batch(self._scrubs, "scrubs", "scrubs", lambda _item, _refusal: None)

    def _quarantine(self, uuid: str, reason: str) -> None:
        self.watch.quarantine(uuid, reason)
        self._beat_now.set()  # the controller hears of it now, not at the next beat

    async def _close_idle_on(self, uuids: set[str]) -> None:
        for r in self.runnables.values():
            await r.pool.close_idle_on(uuids)

    async def _send_completions(self) -> None:
        await self._drain_forever(self._completions_ready, self._post_completions)

    async def _send_events(self) -> None:
        await self._drain_forever(self._events_ready, self._post_events)

    async def _drain_forever(self, ready: asyncio.Event, post: Callable[[], Awaitable[None]]) -> None:
        """Send whatever accumulated while the previous request was in flight: natural batching.

        Never returns: a sender that died would leave every later result of this worker in memory and its
        tasks `running` while it heartbeats. `post` handles what it expects; anything else is logged here.
        """
        while True:
            await ready.wait()
            ready.clear()
            try:
                await post()
            except Exception:
                log.exception("sending reports failed; trying again in 1 s")
                ready.set()
                await asyncio.sleep(1.0)

    async def _post_events(self) -> None:
        async with self._events_lock:
            _, events = self.chains.sendable([], self._events)
            count = reorder(self._events, events, self.chains.dropped)  # an unconfirmed stage's wait
            await self._post_batch(self._events, "events", "events", self._refused_event, limit=count)

    async def _post_completions(self) -> None:
        # A task's events are stored (or refused) before its completion: a stream that ends when the task does
        # misses none, and a completion is sent only once its events' fate is known. A task queues its events
        # before its completion, so the completions counted here have all their events in what is posted next.
        async with self._completions_lock:
            results, _ = self.chains.sendable(self._completions, self._events)
            count = reorder(self._completions, results, self.chains.dropped)
            self.chains.forget_dropped([*self.running, *(c["task_id"] for c in self._completions),
                                        *(e["task_id"] for e in self._events)])  # fmt: skip
            await self._post_events()
            self._apply_event_failures(count)
            await self._post_batch(self._completions, "complete", "results", self._refused_completion,
                                   limit=count, lease=True)  # fmt: skip

    def _apply_event_failures(self, count: int) -> None:
        """Fail each of the first `count` queued successes whose stream lost an event; forget the rest.

        What is left belongs to attempts still running or queued later, or to attempts that are over with
        no completion to fail (the controller stopped them): those are forgotten.
        """
        for i in range(count):
            completion = self._completions[i]
            error = self._event_failures.pop((completion["task_id"], completion["attempt"]), None)
            self._completions[i] = with_event_failure(completion, error)
        queued = {(c["task_id"], c["attempt"]) for c in self._completions}  # some came in after `count`
        for key in [k for k in self._event_failures if k[0] not in self.running and k not in queued]:
            del self._event_failures[key]

    @staticmethod
    def _refused_completion(item: dict[str, Any], refusal: Refusal) -> dict[str, Any] | None:
        return refused_completion(item, refusal.status, refusal.message, refusal.field)

    def _refused_event(self, item: dict[str, Any], refusal: Refusal) -> dict[str, Any] | None:
        """An event the controller refused is dropped, and its task fails like one JSON could not carry."""
        where = (
            f"event {item.get('event', {}).get('event')!r}"
            if isinstance(item.get("event"), dict)
            else "an event"
        )
        error = invalid_output(
            "events", f"the controller refused {where} of this task ({refusal.describe()})"
        )
        if isinstance(item.get("task_id"), str) and isinstance(item.get("attempt"), int):
            self._event_failures.setdefault((item["task_id"], item["attempt"]), error)
        return None

    async def _post_batch(self, buf: list[dict[str, Any]], path: str, key: str, replace: Replace,
                          limit: int | None = None, *, lease: bool = False) -> None:  # fmt: skip
        """Deliver the first `limit` items of `buf` (all: None) in batches; each batch leaves `buf` only once
        every item in it is settled (stored, replaced or dropped), so a cancelled send loses nothing.

        `lease`: results that free room where work waits (`_wants_work`) also ask for work (`_lease_ask`, fresh
        on every try, so its list of what runs here is never stale), and the tasks in the answer start at once."""

        def poster(want: WorkAsk | None) -> Callable[[bytes], Awaitable[httpx.Response]]:
            async def post(body: bytes) -> httpx.Response:
                ask = self._lease_ask(want) if want else None
                if ask is not None:  # `body` is a JSON object: the lease goes in as one more member
                    body = b'%s,"lease":%s}' % (body[:-1], ask[0])
                resp = await self.client.report(path, body)
                chains = lease and bool(self.chains.child_of)
                if (ask is not None or chains) and resp.is_success:
                    try:
                        answer = resp.json()
                        if chains:
                            self._settle_chains(answer)
                        if ask is not None:
                            self._accept(answer, ask[1])
                    except Exception:  # the results are in; a lease not read is taken back after a while
                        log.exception("could not read the work a completion's answer leased")
                return resp

            return post

        left = len(buf) if limit is None else limit
        while left > 0 and buf:
            batch = buf[: min(left, MAX_REPORT_BATCH)]
            want = self._wants_work(batch) if lease else None
            await deliver(poster(want), key, batch, replace, f"{path} reports")
            del buf[: len(batch)]
            left -= len(batch)
            if lease:
                for c in batch:
                    self._asks_work.pop(str(c.get("task_id")), None)

    async def _flush(self) -> None:
        while self._completions or self._events:
            await self._post_completions()

    async def _reap_idle_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            for r in self.runnables.values():
                await r.pool.reap_idle()

    async def _lifeline_loop(self) -> None:
        """Hold the lifeline (`client.hold_lifeline`) for as long as this process lives, reopening it at once.

        If this process dies, however it dies, the kernel closes the connection and the controller re-queues
        its tasks within a second or two instead of three heartbeats. The controller sends a byte every few
        seconds; none for `client.LIFELINE_READ_S` means the connection is dead, and a new one is opened.
        """
        clock = asyncio.get_running_loop().time
        delay_s = 0.0
        while True:
            await self._registered.wait()
            opened_at = clock()
            held = await self.client.hold_lifeline()
            # one that was up a while is reopened at once (within the controller's reconnect grace); one that
            # cannot be opened, or drops straight away, is retried with backoff
            delay_s = 0.0 if held and clock() - opened_at > 1.0 else min(max(delay_s * 2, 0.1), 2.0)
            await asyncio.sleep(jittered(delay_s))
