"""Pipeline runs, orchestrated: start a run, queue each next stage, finish or fail the run, cancel it.

The controller calls `advance` in the same call (so the same database transaction) that records a stage's
result, so the next stage is queued in that commit, with no client round trip between stages. A periodic
`sweep` catches stages that ended any other way (timed out, lost their worker for good, cancelled, never
placeable) and runs whose controller died between commits: a run survives a controller restart because its
state is only ever what the database says.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from turnout.errors import Conflict, InvalidInput, NotFound
from turnout.models import GpuMode, Task, TaskSpec, TaskState
from turnout.pipelines import Pipeline, PipelineRun, RunState, Stage, next_step, stage_gpu, stage_input
from turnout.store.base import RunRecords

if TYPE_CHECKING:
    from turnout.controller import Controller

MAX_NOTED = 1024  # stage tasks `take_queued` remembers between calls (sweeps may queue many with no call)


class PipelineRuns:
    def __init__(self, controller: Controller) -> None:
        self.ctrl = controller
        self.store: RunRecords = controller.store.runs
        # stage tasks queued since last asked (`take_queued`): lease polls should wake
        self.stages_queued: list[str] = []

    def pipeline(self, name: str) -> Pipeline:
        found = self.ctrl.settings.pipelines.get(name)
        if found is None:
            known = ", ".join(sorted(self.ctrl.settings.pipelines)) or "none; add pipelines: to turnout.yaml"
            raise NotFound(f"pipeline {name!r} is not configured (configured: {known})", field="name")
        return found

    def start(self, tenant: str, name: str, run_input: Any, gpu: GpuMode | None = None) -> PipelineRun:
        """Create the run and queue its first stage, in one commit. Every stage's capability must be known now:
        a typo in the config fails the run's start, not its third stage an hour later."""
        pipeline = self.pipeline(name)
        if run_input is None:
            run_input = {}
        if not isinstance(run_input, Mapping):
            raise InvalidInput("input: a pipeline run's input is a JSON object (stages add their outputs to it)",
                               field="input")  # fmt: skip
        for i, stage in enumerate(pipeline.stages):
            self.ctrl._check_known(stage.capability, f"pipelines.{name}.stages.{i}.capability", tenant)
        from turnout.controller import new_id

        now = self.ctrl.clock()
        run = PipelineRun(id=new_id("r_"), tenant=tenant, pipeline=name, state=RunState.RUNNING,
                          input=dict(run_input), gpu=gpu, stages=pipeline.stages, task_ids=(), created_at=now)  # fmt: skip
        first = self._stage_task(run, 0, [], now)
        self.store.insert_run(replace(run, task_ids=(first.id,)))
        self._queue(first)
        return self.get(tenant, run.id)

    def _queue(self, task: Task) -> None:
        """Queue a stage's task. Not a client's submission (the run was, once): no submit rate; its tenant's
        max_gpus and GPU allocation rate hold it at lease time, as they hold any task."""
        self.ctrl.store.insert_tasks([task])
        self.ctrl.queued_for(task.tenant)
        if len(self.stages_queued) < MAX_NOTED:  # past it, a caller sees some not leased yet: it wakes all
            self.stages_queued.append(task.id)

    def _stage_task(self, run: PipelineRun, index: int, done: list[Task], now: float) -> Task:
        from turnout.controller import new_id

        stage: Stage = run.stages[index]
        data = stage_input(run.input, [(run.stages[i].capability, t.output) for i, t in enumerate(done)])
        spec = TaskSpec(capability=stage.capability, input=data, gpu=stage_gpu(stage, run.gpu),
                        gpu_wait_s=stage.gpu_wait_s, timeout_s=stage.timeout_s,
                        placement_timeout_s=stage.placement_timeout_s, max_retries=stage.retries,
                        labels={"pipeline": run.pipeline, "stage": str(index)})  # fmt: skip
        return Task(id=new_id("t_"), tenant=run.tenant, spec=spec, state=TaskState.QUEUED, created_at=now,
                    queued_at=now, pipeline_run_id=run.id)  # fmt: skip

    def get(self, tenant: str | None, run_id: str) -> PipelineRun:
        run = self.store.get_run(run_id)
        if run is None or (tenant is not None and run.tenant != tenant):
            raise NotFound(f"pipeline run {run_id} not found", field="id")
        return run

    def tasks_of(self, run: PipelineRun) -> list[Task | None]:
        """The run's task per stage, in stage order; None for stages not started."""
        by_id = {t.id: t for t in self.ctrl.store.get_tasks(run.task_ids)}
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
        for task in self.tasks_of(run):
            if task is not None and not task.state.terminal:
                self.ctrl.cancel(
                    run.tenant, task.id, by=by
                )  # advances this run to cancelled as its task ends
        run = self.get(tenant, run_id)
        if not run.state.terminal:  # its stage had just ended between our reads: cancel what is left
            error = {"type": "cancelled", "message": "cancelled by request"}
            self.store.update_run(run.id, len(run.task_ids), {"state": RunState.CANCELLED, "error": error,
                                                              "finished_at": self.ctrl.clock()})  # fmt: skip
        return self.get(tenant, run_id)

    # ---- moving runs on ----------------------------------------------------------------------

    def advance(self, task_ids: Iterable[str]) -> int:
        """Move on the runs of these tasks (which just changed state); returns how many runs changed."""
        run_ids = {t.pipeline_run_id for t in self.ctrl.store.get_tasks(list(task_ids)) if t.pipeline_run_id}
        return sum(
            self._advance(run) for run in self.store.get_runs(sorted(run_ids)) if not run.state.terminal
        )

    def sweep(self) -> bool:
        """Move on every running run whose stage ended by other means than a worker's result."""
        return sum(self._advance(run) for run in self.store.running_runs()) > 0

    def take_queued(self) -> Sequence[str]:
        """The ids of the stage tasks queued since the last call (empty: none)."""
        queued, self.stages_queued = self.stages_queued, []
        return queued

    def _advance(self, run: PipelineRun) -> bool:
        tasks = self.ctrl.store.get_tasks(run.task_ids)
        by_id = {t.id: t for t in tasks}
        started = [by_id[tid] for tid in run.task_ids if tid in by_id]
        if len(started) != len(run.task_ids):
            return False  # a task not visible yet (another controller's commit): next sweep
        step = next_step(run.stages, started)
        now = self.ctrl.clock()
        if step.next_stage is not None:
            task = self._stage_task(run, step.next_stage, started, now)
            if not self.store.update_run(run.id, len(run.task_ids), {"task_ids": [*run.task_ids, task.id]}):
                return False  # someone else queued it
            self._queue(task)
            return True
        if not step.state.terminal:
            return False
        values: dict[str, Any] = {"state": step.state, "finished_at": now, "error": step.error}
        if step.state is RunState.SUCCEEDED:
            values["output"] = started[-1].output
        return self.store.update_run(run.id, len(run.task_ids), values)
