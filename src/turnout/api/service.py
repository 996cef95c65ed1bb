"""The asynchronous shell around the synchronous controller: one database thread, wake-ups, the sweep.

Every controller call runs on a single thread, so SQLite sees one writer and the controller's methods
never interleave. Long polls (lease, result, events) wait on `Signal`s that fire when something they
care about changes in this process; they also re-check every second, which is what makes several
controllers on one PostgreSQL database converge without a message bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from turnout.auth import TokenBook
from turnout.controller import Controller

log = logging.getLogger("turnout.api")
R = TypeVar("R")
POLL_S = 1.0


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


class Service:
    def __init__(self, controller: Controller, tokens: TokenBook, *, auth: bool = True) -> None:
        self.controller = controller
        self.tokens = tokens
        self.auth = auth
        self._db = ThreadPoolExecutor(max_workers=1, thread_name_prefix="turnout-db")
        self.queue_changed = Signal()  # new tasks, freed capacity, cancellations
        self.tasks_changed = Signal()  # some task reached a terminal state or changed worker
        self.events_added = Signal()
        self._reaper: asyncio.Task[None] | None = None

    async def call(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._db, functools.partial(fn, *args, **kwargs))

    def changed(self) -> None:
        self.queue_changed.notify()
        self.tasks_changed.notify()

    async def start(self) -> None:
        self._reaper = asyncio.create_task(self._sweep_forever())

    async def stop(self) -> None:
        if self._reaper:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        self._db.shutdown(wait=True)
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
