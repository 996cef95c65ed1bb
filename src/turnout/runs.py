"""Pipeline runs, orchestrated: start a run, queue each next stage, finish or fail the run, cancel it.

The controller calls `advance` in the same call (so the same database transaction) that records a stage's
result, so the next stage is queued in that commit, with no client round trip between stages. A periodic
`sweep` catches stages that ended any other way (timed out, lost their worker for good, cancelled, never
placeable) and runs whose controller died between commits: a run survives a controller restart because its
state is only ever what the database says.

Chained stages: a stage's lease lists the stages after it that may start on the same worker the moment it
succeeds there (`chain_hints`: only stages that routing sends to a CPU whatever else is queued, see
`pipelines.chain_route`). The worker starts such a stage at once, before its task exists, under an id it makes,
and the result of the stage before names it (`Completion.chain`). In the commit that records that result,
`advance` creates the named task already leased to that worker, after checking again what the hint assumed
(the run still going, the worker healthy with room, the route unchanged); or it queues the stage as usual and
the worker, told the chain was refused, stops what it started. Consecutive stages thus cost one local hand-off
each instead of a round trip to the controller and a commit before each starts, and nothing is recorded that
the controller did not decide: a chained stage's task, events and result exist only once its chain is accepted.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from turnout import placement
from turnout.errors import Conflict, InvalidInput, NotFound
from turnout.models import (
    TASK_ID,
    Allocation,
    ChainStep,
    Completion,
    Device,
    GpuMode,
    Lease,
    Routing,
    Task,
    TaskSpec,
    TaskState,
    Worker,
    WorkerState,
    new_id,
)
from turnout.pipelines import (
    Pipeline,
    PipelineRun,
    RunState,
    Stage,
    Step,
    chain_route,
    next_step,
    oversized_input,
    stage_gpu,
    stage_input,
)
from turnout.routing import Route
from turnout.store.base import RunRecords

if TYPE_CHECKING:
    from turnout.controller import Controller

MAX_NOTED = 1024  # stage tasks `take_queued` remembers between calls (sweeps may queue many with no call)
RUNS_KEPT = 1024  # runs whose stages `chain_hints` knows without a read


@dataclass
class Chains:
    """What became of the chained stages a worker's results named (`advance`)."""

    claimed: dict[str, str] = field(default_factory=dict)  # stage task id -> the next stage's id it started
    started_at: dict[str, float] = field(default_factory=dict)  # next stage's id -> its start (worker clock)
    created: dict[str, Task] = field(default_factory=dict)  # the accepted ones' tasks, as inserted
    accepted: list[str] = field(default_factory=list)  # created, leased to that worker
    reports: dict[str, Completion] = field(default_factory=dict)  # every result of the report, by task id
    settled: set[str] = field(default_factory=set)  # accepted ones created already ended, with their result
    # of the ids the report's results name as chained, those already in use
    taken: set[str] = field(default_factory=set)

    def claim(self, task: Task, result: Completion, values: Mapping[str, Any]) -> None:
        """Note the stage `result` says its worker started after `task` (which `values` end) as it succeeded."""
        if result.chain and task.pipeline_run_id:
            self.claimed[task.id] = result.chain
            started, run_s = values.get("started_at"), values.get("run_s")
            if started is not None and run_s is not None:  # it ended, and the next one began, then
                self.started_at[result.chain] = started + run_s

    def success_of(self, stage_id: str) -> Completion | None:
        """The report's success of the chained stage `stage_id`, at its first attempt (a chained stage's only
        one), if the report carries it: that stage ran here and ended, and is created with its result."""
        report = self.reports.get(stage_id)
        return report if report is not None and report.succeeded and report.attempt == 1 else None

    @property
    def refused(self) -> list[str]:
        return [child for child in self.claimed.values() if child not in set(self.accepted)]


RunView = tuple[PipelineRun, list[Task | None]]  # a run and its task per stage (None: not started)


class PipelineRuns:
    def __init__(self, controller: Controller) -> None:
        self.ctrl = controller
        self.store: RunRecords = controller.store.runs
        # stage tasks queued since last asked (`take_queued`): lease polls should wake
        self.stages_queued: list[Task] = []
        # runs started, read or moved on here: their stages and gpu never change (`chain_hints`); the rest is
        # checked where it is written (`advance_runs`)
        self._kept: collections.OrderedDict[str, PipelineRun] = collections.OrderedDict()

    def pipeline(self, name: str) -> Pipeline:
        found = self.ctrl.settings.pipelines.get(name)
        if found is None:
            known = ", ".join(sorted(self.ctrl.settings.pipelines)) or "none; add pipelines: to turnout.yaml"
            raise NotFound(f"pipeline {name!r} is not configured (configured: {known})", field="name")
        return found

    def start(
        self, tenant: str, name: str, run_input: Any, gpu: GpuMode | None = None, *, run_id: str | None = None
    ) -> tuple[PipelineRun, Task]:
        """Create the run and queue its first stage, in one commit; returns the run and that stage's task. Every
        stage's capability must be known now: a typo in the config fails the run's start, not its third stage an
        hour later. `run_id`: the id to give it (a caller may watch for its end before it exists)."""
        pipeline = self.pipeline(name)
        if run_input is None:
            run_input = {}
        if not isinstance(run_input, Mapping):
            raise InvalidInput("input: a pipeline run's input is a JSON object (stages add their outputs to it)",
                               field="input")  # fmt: skip
        for i, stage in enumerate(pipeline.stages):
            self.ctrl.check_known(stage.capability, f"pipelines.{name}.stages.{i}.capability", tenant)
        self.ctrl.check_files(tenant, [("", run_input)])  # every stage's input holds the run's
        now = self.ctrl.clock()
        run = PipelineRun(id=run_id or new_id("r_"), tenant=tenant, pipeline=name, state=RunState.RUNNING,
                          input=dict(run_input), gpu=gpu, stages=pipeline.stages, task_ids=(), created_at=now)  # fmt: skip
        first = self._stage_task(run, 0, [], now)
        run = replace(run, task_ids=(first.id,))
        self.store.insert_run(run)
        self._keep(run)
        self._queue(first, noted=False)  # the caller wakes the lease polls for it (`Service.tasks_queued`)
        return run, first

    def _queue(self, task: Task, *, noted: bool = True) -> None:
        """Queue a stage's task. Not a client's submission (the run was, once): no submit rate; its tenant's
        max_gpus and GPU allocation rate hold it at lease time, as they hold any task. `noted`: kept for
        `take_queued`, whose caller wakes the lease polls."""
        self.ctrl.store.insert_tasks([task])
        self.ctrl.queued_for(task.tenant)
        # past MAX_NOTED, a caller sees some not leased yet: it wakes all
        if noted and len(self.stages_queued) < MAX_NOTED:
            self.stages_queued.append(task)

    def _stage_task(self, run: PipelineRun, index: int, done: list[Task], now: float) -> Task:
        stage: Stage = run.stages[index]
        data = stage_input(run.input, [(run.stages[i].capability, t.output) for i, t in enumerate(done)])
        spec = TaskSpec(capability=stage.capability, input=data, gpu=stage_gpu(stage, run.gpu),
                        gpu_wait_s=stage.gpu_wait_s, timeout_s=stage.timeout_s,
                        placement_timeout_s=stage.placement_timeout_s, max_retries=stage.retries,
                        labels={"pipeline": run.pipeline, "stage": str(index)})  # fmt: skip
        return Task(id=new_id("t_"), tenant=run.tenant, spec=spec, state=TaskState.QUEUED, created_at=now,
                    queued_at=now, pipeline_run_id=run.id)  # fmt: skip

    def _keep(self, run: PipelineRun) -> None:
        self._kept[run.id] = run
        if len(self._kept) > RUNS_KEPT:
            self._kept.popitem(last=False)

    def forget_kept(self) -> None:
        """Drop the runs kept (a transaction that started some was lost)."""
        self._kept.clear()

    def get(self, tenant: str | None, run_id: str) -> PipelineRun:
        run = self.store.get_run(run_id)
        if run is None or (tenant is not None and run.tenant != tenant):
            raise NotFound(f"pipeline run {run_id} not found", field="id")
        return run

    def tasks_of(self, run: PipelineRun, *, bare: bool = False) -> list[Task | None]:
        """The run's task per stage, in stage order; None for stages not started. `bare`: without their inputs
        and outputs (`Store.get_tasks`), for an answer that shows neither (each holds every output before it)."""
        by_id = {t.id: t for t in self.ctrl.store.get_tasks(run.task_ids, bare=bare)}
        found: list[Task | None] = [by_id.get(tid) for tid in run.task_ids]
        return found + [None] * (len(run.stages) - len(found))

    def list(self, tenant: str | None, **filters: Any) -> list[PipelineRun]:
        return self.store.list_runs(tenant=tenant, **filters)

    def cancel(self, tenant: str | None, run_id: str, *, by: str | None = None) -> PipelineRun:
        """Cancel the stage in flight (its process is killed) and those not started (they never will be).
        `tenant`: the caller's scope (another tenant's run is not found); `by`: the token, for the audit."""
        run = self.get(tenant, run_id)
        if run.state.terminal:
            raise Conflict(f"pipeline run {run_id} already {run.state.value}", field="id")
        error = {"type": "cancelled", "message": "cancelled by request"}
        while True:  # each turn the run ended, or another controller moved it on by a stage: it ends
            self._cancel_stages(run, by)  # advances this run to cancelled as its stage ends
            run = self.get(tenant, run_id)
            if run.state.terminal:
                return run
            # its stage had just ended between our reads (another controller queued the next): end it here,
            # and cancel the stage that was queued, which would otherwise run for a cancelled run
            if self.store.update_run(run.id, len(run.task_ids), {"state": RunState.CANCELLED, "error": error,
                                                                 "finished_at": self.ctrl.clock()}):  # fmt: skip
                self._cancel_stages(run, by)
                return self.get(tenant, run_id)

    def _cancel_stages(self, run: PipelineRun, by: str | None) -> None:
        """Cancel the run's stages not ended as read; one that ended since (another controller recorded its
        result) is left as it ended, not a Conflict: the run's cancel goes on."""
        for task in self.tasks_of(run):
            if task is not None and not task.state.terminal:
                with contextlib.suppress(Conflict):
                    self.ctrl.cancel(run.tenant, task.id, by=by)

    # ---- moving runs on ----------------------------------------------------------------------

    def advance(self, task_ids: Iterable[str]) -> int:
        """Move on the runs of these tasks (which just changed state); returns how many runs changed."""
        run_ids = {t.pipeline_run_id for t in self.ctrl.store.get_tasks(list(task_ids)) if t.pipeline_run_id}
        return len(self.advance_runs(run_ids))

    def advance_runs(
        self, run_ids: Iterable[str], chains: Chains | None = None, known: Mapping[str, Task] | None = None
    ) -> Sequence[RunView]:
        """Move on these runs (a stage of each just ended); returns each run that changed, as it stands now.
        `chains`: the next stages the workers already started after some of them (see the module docstring);
        `known`: tasks as this transaction just wrote them, not read again.

        A run kept here since this controller started or moved it on is moved on from that copy, unread: the
        write (`update_run`) takes effect only while the run is still running with as many stages as the copy
        has, so a copy that fell behind (a cancel, the sweep, another controller) changes nothing, and the run
        is then read and moved on from what the database says. Nothing before that write is kept when it fails.
        """
        views: list[RunView] = []
        unread: list[str] = []
        for rid in sorted(set(run_ids)):
            kept = self._kept.get(rid)
            if kept is not None and kept.state.terminal:
                continue  # an ended run never changes again
            view = self._advance(kept, chains, known) if kept is not None else None
            if view is not None:
                views.append(view)
            else:
                unread.append(rid)  # not kept, or its copy fell behind or had nothing to do
        for run in self.store.get_runs(unread) if unread else ():
            if not run.state.terminal and (view := self._advance(run, chains, known)) is not None:
                views.append(view)
        return views

    def sweep(self) -> bool:
        """Move on every running run whose stage ended by other means than a worker's result."""
        return any([self._advance(run) is not None for run in self.store.runs_to_move_on()])

    def take_queued(self) -> Sequence[Task]:
        """The stage tasks queued since the last call (empty: none); MAX_NOTED of them at most (more were
        queued: the caller cannot tell which, and wakes every poll)."""
        queued, self.stages_queued = self.stages_queued, []
        return queued

    def _advance(
        self, run: PipelineRun, chains: Chains | None = None, known: Mapping[str, Task] | None = None
    ) -> RunView | None:
        """Queue the run's next stage, or end the run; returns the run as it stands then (None: unchanged). A
        stage its worker chained is created leased to it; and where that stage's own successful result is in
        the same report, it is created with it, already succeeded, and the run goes on from there: a report of
        a run's chained stages is settled in one pass."""
        by_id = {tid: known[tid] for tid in run.task_ids if known and tid in known}
        if len(by_id) < len(run.task_ids):
            by_id.update(
                (t.id, t) for t in self.ctrl.store.get_tasks(t for t in run.task_ids if t not in by_id)
            )
        started = [by_id[tid] for tid in run.task_ids if tid in by_id]
        if len(started) != len(run.task_ids):
            return None  # a task not visible yet (another controller's commit): next sweep
        step = next_step(run.stages, started)
        now = self.ctrl.clock()
        new: list[Task] = []  # the stages this step creates, in order; only the last may be unfinished
        active: dict[
            str, Sequence[Task]
        ] = {}  # each worker's active tasks: unchanged until this step's insert
        while step.next_stage is not None:
            task = self._stage_task(run, step.next_stage, started, now)
            limits = self.ctrl.settings.request_limits
            if (
                too_large := oversized_input(run.stages, step.next_stage, task.spec.input, limits)
            ) is not None:
                step = Step(RunState.FAILED, error=too_large)  # a stage it chained is refused: never created
                break
            chained = self._chain_of(task, started[-1], chains, now, active) if chains else None
            report = chains.success_of(chained.id) if chains and chained else None
            if chained is None or report is None:
                new.append(chained or task)
                break
            ended = self.ctrl.result_values(chained, report, now)
            done = replace(chained, **ended)
            if chains:
                chains.claim(done, report, ended)
            new.append(done)
            started.append(done)
            step = next_step(run.stages, started)
        values: dict[str, Any] = {"task_ids": [*run.task_ids, *(t.id for t in new)]} if new else {}
        # a run whose last stage ended here ends with it; the step before the loop may have ended it too
        if step.next_stage is None and step.state.terminal:
            values.update(state=step.state, finished_at=now, error=step.error)
            if step.state is RunState.SUCCEEDED:
                values["output"] = started[-1].output
        if not values or not self.store.update_run(run.id, len(run.task_ids), values):
            return None  # nothing to do, or someone else moved it on
        claimed = set(chains.claimed.values()) if chains else set()
        if chains is not None and (ran_on := [t for t in new if t.id in claimed]):
            self.ctrl.store.insert_tasks(ran_on)  # one insert for the stages a report ran back to back
            for t in ran_on:
                chains.accepted.append(t.id)
                chains.created[t.id] = t
                if t.state.terminal:
                    chains.settled.add(t.id)
        for t in new:
            if t.id not in claimed:
                self._queue(t)
        now_run = replace(run, **{**values, "task_ids": tuple(values.get("task_ids", run.task_ids))})
        if now_run.state.terminal:
            self._kept.pop(run.id, None)
        else:
            self._keep(now_run)
        by_id.update((t.id, t) for t in (*started, *new))
        tasks: list[Task | None] = [by_id.get(tid) for tid in now_run.task_ids]
        return now_run, tasks + [None] * (len(run.stages) - len(tasks))

    def _chain_of(
        self, task: Task, parent: Task, chains: Chains, now: float, active: dict[str, Sequence[Task]]
    ) -> Task | None:
        """The next stage as the chained task the parent's worker started, if it named one that can stand."""
        child = chains.claimed.get(parent.id)
        if child is None:
            return None
        if child in chains.taken:
            return None  # the id is taken (never by chance: 48 random bits per millisecond)
        since = min(now, max(parent.created_at, chains.started_at.get(child, now)))
        return self._chained(task, parent, child, since, active, ended=chains.success_of(child) is not None)

    # ---- chained stages ----------------------------------------------------------------------

    def chain_hints(self, worker: Worker, leases: Sequence[Lease]) -> Sequence[Lease]:
        """These leases, each pipeline stage's with the stages after it that may start right after it on this
        worker (`Lease.chain`, in order; it stops at the first that may not). A batch is never chained."""
        staged = {le.task.id: str(le.task.pipeline_run_id) for le in leases
                  if le.task.pipeline_run_id and le.batch is None}  # fmt: skip
        if not staged or worker.state is not WorkerState.HEALTHY:
            return leases
        # a stage's lease means its run was running as the lease was made; a run kept here since its start
        # may have been cancelled since, which the stage's settling finds (its chain is then refused)
        wanted = sorted(set(staged.values()))
        runs = {rid: self._kept[rid] for rid in wanted if rid in self._kept}
        for read in (
            self.store.get_runs([rid for rid in wanted if rid not in runs]) if len(runs) < len(wanted) else ()
        ):
            runs[read.id] = read
            self._keep(read)
        healthy = self._healthy()
        now = self.ctrl.clock()
        out = []
        for le in leases:
            run = runs.get(staged[le.task.id]) if le.task.id in staged else None
            index = _stage_index(le.task)
            steps: list[ChainStep] = []
            if run is not None and not run.state.terminal and index is not None:
                for i in range(index + 1, len(run.stages)):
                    probe = self._stage_task(run, i, [], now)
                    cpu_res = placement.needs(worker.offers(probe.spec.capability).get(Device.CPU), probe)
                    fits = (
                        cpu_res is not None
                        and cpu_res.cpu <= worker.cpu
                        and cpu_res.memory_bytes <= worker.memory_bytes
                    )
                    if self._route(probe, fits, healthy) is None:
                        break
                    steps.append(
                        ChainStep(i, probe.spec.capability, probe.spec.timeout_s, dict(probe.spec.labels))
                    )
            out.append(replace(le, chain=tuple(steps)) if steps else le)
        return out

    def _chained(
        self,
        task: Task,
        parent: Task,
        child_id: str,
        since: float,
        active: dict[str, Sequence[Task]],
        *,
        ended: bool = False,
    ) -> Task | None:
        """`task` (the next stage, as it would be queued) as the chained task `child_id` that the parent's
        worker started at `since`, leased to it; None where the chain cannot stand and the stage is queued
        instead. Its task is created as of when it started, so its queue time is the hand-off's, not negative.
        `active`: the workers' active tasks as read so far in this step (a stage chained after one settled in
        the same report takes the room that one left, and the step inserts them together at its end).
        `ended`: the stage's own success is in the same report; it ran and holds no room on the worker now, so
        the worker's room is not read (the route is still checked: a stage that must go to a GPU is refused)."""
        worker = self.ctrl._fleet().get(parent.worker_id or "")
        if worker is None or worker.state is not WorkerState.HEALTHY or not TASK_ID.match(child_id):
            return None
        cpu_res = placement.needs(worker.offers(task.spec.capability).get(Device.CPU), task)
        if cpu_res is None:
            return None
        if ended:
            fits = True
        else:
            if worker.id not in active:
                active[worker.id] = self.ctrl.store.active_tasks([worker.id], inputs=False)
            fits = placement.fits(placement.room_of(worker, active[worker.id]), cpu_res)
        decided = self._route(task, fits, self._healthy())
        if decided is None:
            return None
        routing = Routing(requested=task.spec.gpu.value, device=Device.CPU.value,
                          reason=f"chained after stage {_stage_index(parent)} on {worker.id}; {decided.reason}")  # fmt: skip
        return replace(task, id=child_id, state=TaskState.LEASED, worker_id=worker.id, device=Device.CPU,
                       routing=routing, created_at=since, queued_at=since, leased_at=since, attempts=1,
                       alloc=Allocation(cpu=cpu_res.cpu, memory=cpu_res.memory_bytes))  # fmt: skip

    def _route(self, task: Task, cpu_fits: bool, healthy: Sequence[Worker]) -> Route | None:
        theirs = placement.serving(healthy, self.ctrl.serves_of(healthy), task.tenant)
        return chain_route(
            task.spec.gpu, task.spec.gpu_wait_s, cpu_fits, placement.cluster_view(theirs, task)
        )

    def _healthy(self) -> Sequence[Worker]:
        return [w for w in self.ctrl._fleet().values() if w.state is WorkerState.HEALTHY]


def _stage_index(task: Task) -> int | None:
    stage = (task.spec.labels or {}).get("stage")
    return int(stage) if stage is not None and stage.isdigit() else None
