"""Running one task, or one batch of tasks, in a process of its variant's pool.

An executor prepares the tasks' files, hands the grant's GPUs over to the task's tenant (`handover.py`), takes
a process (a warm one serves one tenant only: what a task left in its memory stays with its tenant), sends the
task's line, streams its events, gives the process back (warm, unless it timed out or crashed) and collects
what the handler left in its output directory. What it does not do is the agent's: which tasks run, and what
is reported when. The Python executor is `python_runnables` (warm `runner.py` processes); command workers
and containers are `presets.py`'s, over the same pools and processes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from turnout.models import Device
from turnout.worker.app import HandlerVariant, WorkerApplication
from turnout.worker.containment import Isolation
from turnout.worker.files import TaskFileError, TaskFiles, WorkerFiles
from turnout.worker.gpuwatch import SharedTask
from turnout.worker.handover import UnfitGpu
from turnout.worker.pools import ProcessPool, Runnable
from turnout.worker.processes import EventSink, Outcome, ProtocolProcess
from turnout.worker.reports import invalid_output
from turnout.worker.visibility import gpu_env

log = logging.getLogger("turnout.worker")
PROCESS_FAULTS = frozenset({"timeout", "process_exited", "setup_failed", "gpu_memory_exceeded"})
HandOverFn = Callable[[str, dict[str, Any], str], Awaitable[None]]


# ---- the Python executor ------------------------------------------------------------------------


def python_runnables(app_ref: str, app: WorkerApplication, base_env: dict[str, str]) -> list[Runnable]:
    """Warm `turnout.worker.runner` pools for each variant of a Python app."""
    out = []
    for hv in app.variants.values():
        batch = _batch_line if hv.variant.max_batch_size > 1 else None
        pool = _python_pool(app_ref, hv, base_env)
        out.append(Runnable(hv.variant, pool, _wrapped_line, batch, makes_output_dir=True))
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
        return ProtocolProcess(argv, {**base_env, **gpu_env(key)}, lifeline_arg=True, tagged=True)

    return ProcessPool(factory, min_processes=hv.pool.min_processes, idle_timeout_s=hv.pool.idle_timeout_s,
                       max_processes=hv.pool.max_processes)  # fmt: skip


def _wrapped_line(lease: dict[str, Any]) -> str:
    return json.dumps(_envelope(lease))


def _envelope(lease: dict[str, Any]) -> dict[str, Any]:
    return {"task_id": lease["id"], "attempt": lease["attempt"], "input": lease["input"],
            "gpus": list((lease.get("gpus") or {}).get("uuids", [])),
            "files": lease.get("files") or {}, "output_dir": lease.get("output_dir")}  # fmt: skip


def _batch_line(leases: list[dict[str, Any]]) -> str:
    return json.dumps({"batch": [_envelope(lease) for lease in leases]})


# ---- pure parts of a run ------------------------------------------------------------------------


def variant_key(capability: Any, device: Any) -> str:
    """How the worker names a variant it runs (and the controller's pool metrics do): `capability:device`."""
    return f"{capability}:{device}"


def grant_key(grant: dict[str, Any] | None) -> tuple[str, ...]:
    """The GPUs (and shared-memory limit) a process is started with; () for a CPU process."""
    if not grant:
        return ()
    limit = "" if grant.get("exclusive") else str(grant.get("memory_bytes") or "")
    return (",".join(grant.get("uuids", [])), ",".join(str(i) for i in grant.get("indices", [])), limit,
            str(grant.get("unit_memory_bytes") or ""))  # fmt: skip


def groups(leases: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The lease answer's tasks as the jobs to run: one per task, one per batch. The controller batches only
    one tenant's tasks; the tenant is part of the key here too, so two tenants' inputs never meet in one
    handler call (nor one warm process's memory) even if a lease answer said otherwise."""
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for lease in leases:
        out.setdefault((str(lease.get("tenant")), lease.get("batch") or lease["id"]), []).append(lease)
    return list(out.values())


def split_cold_start(outcome: Outcome, fresh: bool, asked_at: float) -> tuple[float | None, Outcome]:
    """(cold_start_s, outcome with run_s less the setup it waited for). A task that met a fresh process pays
    the start and setup it waited for (a prewarmed one that was ready in time costs it nothing)."""
    if not fresh:
        return 0.0, outcome
    ready = outcome.ready_at if outcome.ready_at is not None else outcome.started_at
    cold = max(0.0, ready - asked_at)
    finished = outcome.started_at + outcome.run_s
    run_s = max(0.0, finished - max(outcome.started_at, ready))
    return cold, replace(outcome, run_s=run_s)


def per_task(outcome: Outcome, n: int, batched: bool) -> list[Outcome]:
    """Each task's own outcome: a batch's list of outputs is split in order; a batch that failed fails each task.

    An item the runner found JSON cannot carry (`item_errors`) fails its own task only."""
    if not batched:
        return [outcome] * n
    if not outcome.succeeded:
        return [outcome] * n
    outputs = outcome.output
    if not isinstance(outputs, list) or len(outputs) != n:
        got = f"{len(outputs)} outputs" if isinstance(outputs, list) else type(outputs).__name__
        error = invalid_output(
            "output", f"a batched handler must return a list of {n} outputs, one per input; got {got}"
        )
        return [Outcome(False, error=error)] * n
    errors = outcome.item_errors if outcome.item_errors and len(outcome.item_errors) == n else [None] * n
    return [
        Outcome(True, output=o) if e is None else Outcome(False, error=e)
        for o, e in zip(outputs, errors, strict=True)
    ]


def routed(sinks: list[EventSink], batched: bool) -> EventSink:
    """One sink for a job's process: in a batch, an event naming an `item` goes to that task's stream, any
    other to every task's."""

    def sink(event: dict[str, Any]) -> None:
        item = event.get("item") if batched else None
        if isinstance(item, int) and not isinstance(item, bool) and 0 <= item < len(sinks):
            sinks[item]({k: v for k, v in event.items() if k != "item"})
        else:
            for each in sinks:
                each(event)

    return sink


@dataclass
class Ran:
    """What one job came to: each task's outcome, in lease order, and what the tasks' reports share."""

    results: list[Outcome]  # outputs with their files collected
    outcome: Outcome  # the process's run: seconds, start, peak memory (each task gets its share)
    batched: bool
    cold_start_s: float | None = None
    isolation: Isolation | None = None  # what held the process, once it started, however its run ended
    files: list[TaskFiles] = field(default_factory=list)  # each task's scratch and output directories

    def completion(self, i: int, lease: dict[str, Any]) -> dict[str, Any]:
        """Task `i`'s result, as a worker reports it (not yet checked: `reports.checked_completion`)."""
        result, outcome, share = self.results[i], self.outcome, len(self.results)
        usage = {k: v for k, v in (("peak_rss_bytes", outcome.peak_rss_bytes),
                                   ("peak_gpu_memory_bytes", outcome.peak_gpu_memory_bytes),
                                   ("batch_size", share if self.batched else None)) if v is not None}  # fmt: skip
        return {
            "task_id": lease["id"], "attempt": lease["attempt"], "status": "succeeded" if result.succeeded else "failed",
            "output": result.output, "error": result.error, "run_s": outcome.run_s / share,
            "started_at": outcome.started_at,
            "isolation": outcome.isolation or self.isolation,  # what held and confined its process
            "cold_start_s": None if self.cold_start_s is None else self.cold_start_s / share, "usage": usage or None,
        }  # fmt: skip


class Executor:
    """Runs jobs (one task, or one batch the controller leased together: same variant, same GPUs)."""

    def __init__(self, runnables: dict[str, Runnable], files: WorkerFiles, hand_over: HandOverFn) -> None:
        self.runnables = runnables  # by `variant_key`
        self.files = files
        self.hand_over = hand_over
        self.shared: dict[str, SharedTask] = {}  # running tasks that hold a share of a GPU's memory
        # a warm process serves one tenant only: what a task left in its memory stays with its tenant
        self._proc_tenant: weakref.WeakKeyDictionary[ProtocolProcess, str] = weakref.WeakKeyDictionary()

    def runnable(self, capability: Any, device: Any = Device.CPU.value) -> Runnable | None:
        return self.runnables.get(variant_key(capability, device))

    async def run(
        self,
        leases: list[dict[str, Any]],
        sinks: list[EventSink],
        stopped: Callable[[], dict[str, Any] | None],
    ) -> Ran:
        """Run the job, streaming each task's events to its sink. A batch goes to one process as one line; the
        handler gets a list of inputs and returns a list of outputs, in order.

        A job cancelled while it runs asks `stopped()` why: None (the controller asked, and knows) removes
        the tasks' directories and raises CancelledError; an error (the worker stopped it) fails each task.
        """
        first = leases[0]
        runnable = self.runnable(first["capability"], first["device"])
        # a batched variant's process always gets a batch line, also for a task leased or chained alone: its
        # handler takes a list and returns one, and each task keeps its own item of it
        batched = runnable is not None and runnable.batch_line is not None
        sink = routed(sinks, batched)
        cold_start_s: float | None = None
        isolation: Isolation | None = None
        files: list[TaskFiles] = []
        try:
            if runnable is None:
                outcome = Outcome(False, error={"type": "not_served",
                                                "message": f"{first['capability']} on {first['device']} is not served here"})  # fmt: skip
            else:
                # a batch with one missing input fails whole: its handler takes every input
                for lease in leases:
                    files.append(await self.files.prepare(lease, make_output=not runnable.makes_output_dir))
                leases_with_files = [{**lease, "files": f.inputs, "output_dir": str(f.output_dir)}
                                     for lease, f in zip(leases, files, strict=True)]  # fmt: skip
                key = grant_key(first.get("gpus"))
                tenant = str(first.get("tenant") or "default")  # a batch is one tenant's (see `groups`)
                await self.hand_over(first["id"], first.get("gpus") or {}, tenant)
                # a cold start is the process's start and setup, not the scrub before it
                asked_at = time.time()
                env = files[0].env() if len(files) == 1 else None  # a command started for this one task
                proc = await self._acquire(runnable, key, first["id"], tenant, env=env)
                fresh = proc.tasks_served == 0
                reusable = False
                grant = first.get("gpus") or {}
                if grant and not grant.get("exclusive") and proc.pid:
                    self.shared[first["id"]] = SharedTask(first["id"], proc.pid, tuple(grant.get("uuids", [])),
                                                          int(grant.get("memory_bytes", 0)))  # fmt: skip
                if proc.pid is not None:  # it started: what holds it is known, however its run ends
                    isolation = proc.isolation
                try:
                    line = (
                        runnable.batch_line(leases_with_files)
                        if batched and runnable.batch_line
                        else runnable.task_line(leases_with_files[0])
                    )
                    outcome = await proc.run(line, sink, first.get("timeout_s"))
                    # a failure the program reported itself leaves it warm; a timeout or a crash does not
                    kind = (outcome.error or {}).get("type")
                    reusable = (
                        proc.alive
                        and not proc.out_of_step
                        and not (isinstance(kind, str) and kind in PROCESS_FAULTS)
                    )
                finally:
                    self.shared.pop(first["id"], None)
                    runnable.pool.release(proc, key, reusable)
                cold_start_s, outcome = split_cold_start(outcome, fresh, asked_at)
        except asyncio.CancelledError:
            error = stopped()
            if error is None:
                await self.clean(files)
                raise
            outcome = Outcome(False, error=error)
        except (UnfitGpu, TaskFileError) as exc:
            outcome = Outcome(False, error=exc.error)
        except Exception as exc:
            log.exception("task %s could not run", first["id"])
            outcome = Outcome(
                False, error={"type": "worker_error", "message": f"{type(exc).__name__}: {exc}"}
            )
        results = per_task(outcome, len(leases), batched)
        for i, (lease, result) in enumerate(zip(leases, results, strict=True)):
            if result.succeeded and i < len(files):  # what it left in its output directory goes back as files
                try:
                    results[i] = replace(
                        result, output=await self.files.collect(files[i], lease, result.output)
                    )
                except TaskFileError as exc:
                    results[i] = Outcome(False, error=exc.error)
        return Ran(results, outcome, batched, cold_start_s, isolation, files)

    async def _acquire(
        self,
        runnable: Runnable,
        key: tuple[str, ...],
        task_id: str,
        tenant: str,
        *,
        env: dict[str, str] | None = None,
    ) -> ProtocolProcess:
        """A process for the task; a warm one that served another tenant is closed, never reused."""
        proc = await runnable.pool.acquire(key, task_id, env=env)
        while self._proc_tenant.get(proc, tenant) != tenant:
            runnable.pool.release(proc, key, reusable=False)
            proc = await runnable.pool.acquire(key, task_id, env=env)
        self._proc_tenant[proc] = tenant
        return proc

    async def clean(self, files: list[TaskFiles]) -> None:
        """Remove the tasks' scratch and output directories (the common case: two rmdir calls, no thread)."""
        for f in files:
            if not self.files.remove_if_empty(f):
                await asyncio.get_running_loop().run_in_executor(None, self.files.cleanup, f)
