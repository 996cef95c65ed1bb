"""The asynchronous shell around the synchronous controller: one database thread, wake-ups, the sweep.

Every controller call runs on a single thread, so SQLite sees one writer and the controller's methods
never interleave. That thread commits in groups: it takes every call that queued up while the last
commit was on disk, runs each in its own savepoint, and commits them together, so a burst of requests
costs one fsync, and no caller hears back before its change is durable.

Long polls (lease, result, events) wait on `Signal`s that fire when something they care about changes
in this process; they also re-check every second, which is what makes several controllers on one
PostgreSQL database converge without a message bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from turnout.auth import TokenBook, WorkerKeys
from turnout.controller import Controller
from turnout.models import GpuMode, TaskSpec
from turnout.tenancy import TenantBuckets, admit_submission, gpu_allocation_rule, submit_rule

log = logging.getLogger("turnout.api")
R = TypeVar("R")
POLL_S = 1.0
MAX_GROUP = 512  # calls committed together at most


@dataclass
class _Job(Generic[R]):
    fn: Callable[[], R]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[R]
    result: Any = None
    error: BaseException | None = None

    def settle(self) -> None:
        if self.future.cancelled():
            return
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            self.future.set_result(self.result)


class Signal:
    """A broadcast wake-up: take `current()` before checking, then `wait()` on it; no wake-up is lost."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def current(self) -> asyncio.Event:
        return self._event

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    @staticmethod
    async def wait(event: asyncio.Event, timeout_s: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), timeout=max(0.0, timeout_s))

    @staticmethod
    async def wait_any(events: list[asyncio.Event], timeout_s: float) -> None:
        waiters = [asyncio.ensure_future(e.wait()) for e in events]
        try:
            await asyncio.wait(waiters, timeout=max(0.0, timeout_s), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()


class Service:
    def __init__(self, controller: Controller, tokens: TokenBook, *, auth: bool = True) -> None:
        self.controller = controller
        self.tokens = tokens
        self.workers = WorkerKeys(controller.store)
        self.auth = auth
        limits = controller.settings.tenant_limits
        self.submissions = TenantBuckets(submit_rule(limits))
        self.gpu_submissions = TenantBuckets(gpu_allocation_rule(limits))  # GPU-only tasks, at the door
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._db = threading.Thread(target=self._run_jobs, name="turnout-db", daemon=True)
        self._db.start()
        self._readers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="turnout-read")
        self.queue_changed = Signal()  # new tasks, freed capacity, cancellations
        self.changes = Signal()  # cancellations, timeouts, workers coming and going: what `changed()` says
        self.tasks_changed = Signal()  # some task reached a terminal state or changed worker
        self.events_added = Signal()
        self._worker_signals: dict[
            str, Signal
        ] = {}  # capacity freed on one worker: wakes only its lease poll
        self._reaper: asyncio.Task[None] | None = None

    async def read(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """Run a read-only `fn` beside the writer: it sees committed state and waits for no commit."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._readers, functools.partial(fn, *args, **kwargs))

    async def call(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """Run `fn` on the database thread; returns once its writes are committed."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._jobs.put(_Job(functools.partial(fn, *args, **kwargs), loop, future))
        return await future

    def _run_jobs(self) -> None:
        store = self.controller.store
        while True:
            first = self._jobs.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < MAX_GROUP:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self._jobs.put(None)
                    break
                batch.append(job)
            try:
                with store.group() as conn:
                    for job in batch:
                        try:
                            with conn.begin_nested():  # a failing call undoes only its own writes
                                job.result = job.fn()
                        except BaseException as exc:
                            job.error = exc
            except Exception as exc:  # the commit itself failed: nobody's change is durable
                log.exception("commit failed")
                for job in batch:
                    job.error = job.error or exc
            for job in batch:
                job.loop.call_soon_threadsafe(job.settle)

    def admit(self, tenant: str, specs: list[TaskSpec]) -> None:
        """Rate limits at the door, before the database: see `tenancy.admit_submission`."""
        gpu_only = sum(1 for s in specs if s.gpu is GpuMode.REQUIRE)
        admit_submission(self.submissions, self.gpu_submissions, tenant, len(specs), gpu_only)

    def worker_signal(self, worker_id: str) -> Signal:
        signal = self._worker_signals.get(worker_id)
        if signal is None:
            signal = self._worker_signals[worker_id] = Signal()
        return signal

    def changed(self) -> None:
        self.changes.notify()
        self.queue_changed.notify()
        self.tasks_changed.notify()

    async def start(self) -> None:
        self._reaper = asyncio.create_task(self._sweep_forever())

    async def stop(self) -> None:
        if self._reaper:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        self._jobs.put(None)
        await asyncio.get_running_loop().run_in_executor(None, self._db.join)
        self._readers.shutdown(wait=True)
        self.controller.store.close()

    async def _sweep_forever(self) -> None:
        interval = self.controller.settings.reap_interval_s
        while True:
            try:
                if await self.call(self.controller.reap):
                    self.changed()
            except Exception:  # the sweep must outlive a bad moment (a locked db, a dropped connection)
                log.exception("sweep failed; retrying")
            await asyncio.sleep(interval)
