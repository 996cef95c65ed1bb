"""Pools of warm processes, and what a variant of this worker runs on: its pool and how a task is written.

A `ProcessPool` keeps one variant's live processes, keyed by the GPUs each was started with (a process's GPUs
are fixed), and never holds more than `max_processes` of them, starting ones included: at the cap a task
waits for a process to be released (or takes the place of an idle one started for other GPUs). A
`OneOffPool` starts a fresh process per task instead. The processes themselves are `processes.py`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from turnout.models import Variant
from turnout.worker.processes import ProtocolProcess


@dataclass
class Runnable:
    """A variant this worker runs: its pool of processes and how one task's (or one batch's) line is written."""

    variant: Variant
    pool: ProcessPool
    task_line: Callable[[dict[str, Any]], str]
    batch_line: Callable[[list[dict[str, Any]]], str] | None = None  # variants with max_batch_size > 1
    # the program makes a task's output directory at its first use (the Python runner's `ctx.output_dir`);
    # a command or a container is given one made ahead
    makes_output_dir: bool = False


ProcessFactory = Callable[[tuple[str, ...]], ProtocolProcess]


class ProcessPool:
    """Warm processes of one variant, keyed by the GPUs they were started with (a process's GPUs are fixed).

    Idle processes above `min_processes` exit after `idle_timeout_s`, freeing the memory their model held.
    """

    def __init__(
        self,
        factory: ProcessFactory,
        *,
        min_processes: int = 0,
        idle_timeout_s: float = 60.0,
        max_processes: int | None = None,
    ) -> None:
        self.factory = factory
        self.min_processes = min_processes
        self.max_processes = max_processes  # None: as many as the tasks leased here need
        self.idle_timeout_s = idle_timeout_s
        self.idle: dict[tuple[str, ...], list[ProtocolProcess]] = {}
        self.busy: set[ProtocolProcess] = set()
        self._starting = 0
        self._freed = asyncio.Event()  # replaced on each release: take it before looking, then wait on it
        self.started_total = 0  # processes ever started: a cold start each

    @property
    def size(self) -> int:
        return sum(len(v) for v in self.idle.values()) + len(self.busy) + self._starting

    def loaded(self) -> int:
        """Live processes past their start, busy or idle: the model is loaded in each."""
        return self.warm() + sum(1 for p in self.busy if p.alive)

    def warm(self) -> int:
        """Idle live processes: a task for this variant would start at once, model loaded."""
        return sum(1 for v in self.idle.values() for p in v if p.alive)

    async def acquire(
        self, key: tuple[str, ...], task_id: str | None = None, env: dict[str, str] | None = None
    ) -> ProtocolProcess:
        """A warm process for `key`, else a new one; at `max_processes`, wait for one to be released.

        The pool grows only here, so only while a task waits for a process. `env` is for processes started
        per task (`OneOffPool`); a warm process was started before the task, so it gets the task's files
        from its input line instead."""
        while True:
            freed = self._freed
            stack = self.idle.get(key, [])
            while stack:
                proc = stack.pop()
                if proc.alive and not proc.out_of_step:  # one that wrote between tasks was killed for it
                    self.busy.add(proc)
                    return proc
            if self.max_processes is None or self.size < self.max_processes:
                break
            if self._evict_other_key(key):
                continue
            await freed.wait()
        self._starting += 1
        try:
            proc = self.factory(key)
            await proc.start()
        finally:
            self._starting -= 1
        self.started_total += 1
        self.busy.add(proc)
        return proc

    def _evict_other_key(self, key: tuple[str, ...]) -> bool:
        """At the cap, an idle process started for other GPUs makes room for this task's."""
        for other, stack in self.idle.items():
            if other != key and stack:
                stack.pop().kill()
                return True
        return False

    def release(self, proc: ProtocolProcess, key: tuple[str, ...], reusable: bool) -> None:
        self.busy.discard(proc)
        if reusable and proc.alive and not proc.out_of_step:
            self.idle.setdefault(key, []).append(proc)
        else:
            proc.kill()
        self._freed.set()
        self._freed = asyncio.Event()

    async def prewarm(self, key: tuple[str, ...] = ()) -> None:
        while sum(len(v) for v in self.idle.values()) + len(self.busy) < self.min_processes:
            proc = self.factory(key)
            await proc.start()
            self.idle.setdefault(key, []).append(proc)

    async def reap_idle(self) -> None:
        now = time.monotonic()
        total = sum(len(v) for v in self.idle.values()) + len(self.busy)
        for stack in list(self.idle.values()):  # a close below awaits: the dict may change meanwhile
            for proc in list(stack):
                if not proc.alive or proc.out_of_step:
                    stack.remove(proc)
                    total -= 1
                    proc.kill()
                elif now - proc.last_used > self.idle_timeout_s and total > self.min_processes:
                    stack.remove(proc)
                    total -= 1
                    await proc.close()

    async def close_idle_on(self, uuids: set[str]) -> None:
        """Close the idle processes started on any of these GPUs (they hold the last tenant's memory)."""
        for key, stack in list(self.idle.items()):
            if key and set(key[0].split(",")) & uuids:
                procs, stack[:] = list(stack), []
                for proc in procs:
                    await proc.close()

    def pids(self) -> list[int]:
        procs = [*self.busy, *(p for v in self.idle.values() for p in v)]
        return [p.pid for p in procs if p.pid is not None and p.alive]

    async def close(self) -> None:
        for proc in [*self.busy, *(p for v in self.idle.values() for p in v)]:
            await proc.close()
        self.idle.clear()
        self.busy.clear()


OneOffFactory = Callable[[tuple[str, ...], str | None], ProtocolProcess]


class OneOffPool(ProcessPool):
    """A fresh process per task, started knowing the task's id, and killed with its group when the task ends."""

    def __init__(self, factory: OneOffFactory) -> None:
        super().__init__(lambda key: factory(key, None))
        self.one_off_factory = factory

    async def acquire(
        self, key: tuple[str, ...], task_id: str | None = None, env: dict[str, str] | None = None
    ) -> ProtocolProcess:
        proc = self.one_off_factory(key, task_id)
        if env:
            proc.env = {**proc.env, **env}
        self.busy.add(proc)
        try:
            await proc.start()
        except BaseException:
            self.busy.discard(proc)
            raise
        return proc

    def release(self, proc: ProtocolProcess, key: tuple[str, ...], reusable: bool) -> None:
        self.busy.discard(proc)
        proc.kill()

    async def prewarm(self, key: tuple[str, ...] = ()) -> None:
        return None
