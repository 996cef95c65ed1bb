"""Pipelines as pure decisions: what a pipeline is, what a stage gets as input, what a run cost.

A pipeline is a named list of stages; each stage is a capability with its own `gpu`, `timeout_s` and
`retries`. A run makes one task per stage, one after another. Stage N's input is the run's input updated with
the outputs of stages 1..N-1 (an output that is not an object is kept under its stage's capability name).

Nothing here does I/O: `runs.py` reads tasks from the store, asks these functions, and writes the outcome.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from turnout.config import Prices, RequestLimits, describe_bytes
from turnout.errors import InvalidInput, number
from turnout.models import Device, GpuMode, Task, TaskState, check_capability_name
from turnout.routing import ClusterView, Route, WorkerOffer, route

STAGE_KEYS = ("capability", "gpu", "timeout_s", "retries", "gpu_wait_s", "placement_timeout_s")
PIPELINE_KEYS = ("stages",)


class RunState(str, enum.Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self is not RunState.RUNNING


@dataclass(frozen=True)
class Stage:
    """One stage: a capability and how its task is routed and bounded."""

    capability: str
    gpu: GpuMode | None = None  # None: the run's gpu, else auto
    timeout_s: float | None = None
    retries: int = 2
    gpu_wait_s: float = 10.0
    placement_timeout_s: float = 60.0

    def to_dict(self) -> dict[str, Any]:
        return {"capability": self.capability, "gpu": self.gpu.value if self.gpu else None,
                "timeout_s": self.timeout_s, "retries": self.retries, "gpu_wait_s": self.gpu_wait_s,
                "placement_timeout_s": self.placement_timeout_s}  # fmt: skip

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Stage:
        return cls(d["capability"], GpuMode(d["gpu"]) if d.get("gpu") else None, d.get("timeout_s"),
                   int(d.get("retries", 2)), float(d.get("gpu_wait_s", 10.0)),
                   float(d.get("placement_timeout_s", 60.0)))  # fmt: skip


@dataclass(frozen=True)
class Pipeline:
    name: str
    stages: tuple[Stage, ...]


def parse_pipelines(raw: Any, source: str = "pipelines") -> dict[str, Pipeline]:
    """`{name: {stages: [{capability, gpu?, timeout_s?, retries?}, ...]}}` -> Pipelines; errors name the key."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise InvalidInput(f"{source}: expected a mapping of pipeline names to pipelines", field=source)
    out: dict[str, Pipeline] = {}
    for name, body in raw.items():
        at = f"{source}.{name}"
        check_capability_name(name, at)  # the same shape of name: it is a path segment
        if not isinstance(body, Mapping):
            raise InvalidInput(f"{at}: expected a mapping with stages", field=at)
        unknown = sorted(set(body) - set(PIPELINE_KEYS))
        if unknown:
            raise InvalidInput(f"{at}.{unknown[0]}: unknown key (known: stages)", field=f"{at}.{unknown[0]}")
        stages = body.get("stages")
        if not isinstance(stages, list) or not stages:
            raise InvalidInput(f"{at}.stages: expected a non-empty list of stages", field=f"{at}.stages")
        out[str(name)] = Pipeline(
            str(name), tuple(_stage(s, f"{at}.stages.{i}") for i, s in enumerate(stages))
        )
    return out


def _stage(raw: Any, at: str) -> Stage:
    if not isinstance(raw, Mapping):
        raise InvalidInput(f"{at}: expected a mapping with a capability", field=at)
    unknown = sorted(set(raw) - set(STAGE_KEYS))
    if unknown:
        raise InvalidInput(f"{at}.{unknown[0]}: unknown key (known: {', '.join(STAGE_KEYS)})",
                           field=f"{at}.{unknown[0]}")  # fmt: skip
    if "capability" not in raw:
        raise InvalidInput(f"{at}.capability: missing", field=f"{at}.capability")
    capability = check_capability_name(raw["capability"], f"{at}.capability")
    gpu = GpuMode.parse(raw["gpu"], f"{at}.gpu") if "gpu" in raw else None
    retries = raw.get("retries", 2)
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 100:
        raise InvalidInput(
            f"{at}.retries: expected a whole number 0..100, got {retries!r}", field=f"{at}.retries"
        )
    return Stage(capability, gpu, _seconds(raw.get("timeout_s"), f"{at}.timeout_s"), retries,
                 _wait(raw.get("gpu_wait_s"), f"{at}.gpu_wait_s", 10.0, zero_ok=True),
                 _wait(raw.get("placement_timeout_s"), f"{at}.placement_timeout_s", 60.0))  # fmt: skip


def _seconds(value: Any, at: str) -> float | None:
    """A number of seconds > 0, or None where none is given."""
    if value is None:
        return None
    return number(value, at, "a number of seconds > 0", lambda v: v > 0)


def _wait(value: Any, at: str, default: float, *, zero_ok: bool = False) -> float:
    """A wait in seconds, `default` where none is given; 0 where `zero_ok` (a task's `gpu_wait_s` may be 0:
    fall back to the CPU at once)."""
    if value is None:
        return default
    if zero_ok:
        return number(value, at, "a number of seconds >= 0", lambda v: v >= 0)
    return number(value, at, "a number of seconds > 0", lambda v: v > 0)


def stage_input(run_input: Mapping[str, Any], outputs: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """The run's input updated with each earlier stage's output, in order: later keys win.

    `outputs` is (capability, output) per finished stage. An object output is merged key by key; any other
    output (a list, a number, None) is kept under its capability's name, so nothing a stage returns is lost.
    """
    data = dict(run_input)
    for capability, output in outputs:
        if isinstance(output, Mapping):
            data.update(output)
        elif output is not None:
            data[capability] = output
    return data


def oversized_input(
    stages: Sequence[Stage], index: int, data: Any, limits: RequestLimits
) -> dict[str, Any] | None:
    """The run's error where stage `index`'s input (the run's input and every output before it) is over
    `max_input_bytes`, as a client's task input over it is refused; None where it fits. Unbounded, each stage's
    input holds all the outputs before it, and its row a copy: eight stages passing 30 MB each took a
    controller to 4 GB, its heartbeat answers late, and a 210 MB lease to the last stage's worker."""
    size = len(json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
    if size <= limits.max_input_bytes:
        return None
    capability = stages[index].capability
    return {"type": "payload_too_large", "stage": index, "capability": capability,
            "message": f"stage {index} ({capability}) input: {describe_bytes(size)} of JSON (the run's input and the "
                       f"outputs before it); {limits.describe('max_input_bytes')} (pass large data between stages "
                       'as files: {"$file": ID})'}  # fmt: skip


def stage_gpu(stage: Stage, run_gpu: GpuMode | None) -> GpuMode:
    """A stage's own gpu wins; the run's applies to stages that set none; else auto."""
    return stage.gpu or run_gpu or GpuMode.AUTO


def chain_route(mode: GpuMode, gpu_wait_s: float, cpu_fits: bool, cluster: ClusterView) -> Route | None:
    """Whether a stage may start on the worker that ran the stage before it, at once and on its CPU variant,
    instead of being queued: only where routing would send it to a CPU whatever else is queued or free
    (`never`; `prefer` or `auto` when no healthy worker could ever run its GPU variant, or `gpu_wait_s` is 0).
    `auto` with a GPU possible anywhere is never chained: its choice weighs the queues, which are not here.
    `cpu_fits`: the worker offers the CPU variant and has room for it once the stage before it ended."""
    if mode is GpuMode.AUTO and cluster.gpu_possible:
        return None
    offer = WorkerOffer(cpu_variant=cpu_fits, gpu_variant=False, cpu_fits=cpu_fits, gpu_fits=False)
    decided = route(mode, 0.0, gpu_wait_s, offer, cluster)
    return decided if decided is not None and decided.device is Device.CPU else None


@dataclass(frozen=True)
class Step:
    """What to do with a run now that one of its stages changed."""

    state: RunState
    next_stage: int | None = None  # queue this stage next
    error: dict[str, Any] | None = None


def next_step(stages: Sequence[Stage], tasks: Sequence[Task | None]) -> Step:
    """Given the run's tasks so far (one per started stage, in order), what happens next.

    A failed stage fails the run and names the stage; a cancelled stage cancels it; after the last stage
    succeeds the run has succeeded; otherwise the next stage is queued once the current one succeeded.
    """
    for i, task in enumerate(tasks):
        if task is None or not task.state.terminal:
            return Step(RunState.RUNNING)
        if task.state is TaskState.FAILED:
            error = task.error or {}
            return Step(RunState.FAILED, error={
                "type": "stage_failed", "stage": i, "capability": stages[i].capability, "task_id": task.id,
                "cause": error.get("type"),
                "message": f"stage {i} ({stages[i].capability}) failed: {error.get('type', 'error')}: "
                           f"{error.get('message', '')}".rstrip(": "),
            })  # fmt: skip
        if task.state is TaskState.CANCELLED:
            return Step(RunState.CANCELLED, error={"type": "cancelled", "stage": i, "capability": stages[i].capability,
                                                   "message": f"stage {i} ({stages[i].capability}) was cancelled"})  # fmt: skip
    if len(tasks) >= len(stages):
        return Step(RunState.SUCCEEDED)
    return Step(RunState.RUNNING, next_stage=len(tasks))


# ---- cost ----------------------------------------------------------------------------------------------


def billable_s(task: Task) -> float:
    """The seconds a task is billed for: its cold start (process start and model load) and its run."""
    return (task.cold_start_s or 0.0) + (task.run_s or 0.0)


def task_cost(prices: Prices, device: str, gpu_model: str | None, seconds: float | None,
              share: float = 1.0) -> float | None:  # fmt: skip
    """Seconds at the price of the device class and GPU model, times the share of the GPU held; None unpriced."""
    if seconds is None:
        return None
    price = prices.per_second(device, gpu_model)
    return None if price is None else round(seconds * price * share, 10)


def run_costs(prices: Prices, tasks: Sequence[Task | None]) -> tuple[float | None, float | None]:
    """(cost_usd, gpu_only_cost_usd) of a run's stages.

    gpu_only prices every stage's seconds as the GPU that ran the run's GPU stage (the first stage that ran on a
    GPU; the plain `gpu` price when none did), so a mixed pipeline's saving shows on every run. A stage that ran
    on a GPU counts as it was billed (its share of that GPU) in both totals. A stage that ran on a device the
    prices leave out makes cost_usd None: a partial sum bills its seconds as free (all CPU: "$0, 100% saved").
    """
    done = [t for t in tasks if t is not None]
    unpriced = any(t.cost_usd is None and t.device is not None and (t.run_s is not None or t.cold_start_s is not None)
                   and prices.per_second(t.device.value, t.gpu_model) is None for t in done)  # fmt: skip
    model = next((t.gpu_model for t in done if t.device is not None and t.device.value == "gpu"), None)
    total = 0.0
    gpu_total = 0.0
    priced = False
    for t in done:
        if t.cost_usd is not None:
            total += t.cost_usd
            priced = True
        if t.device is not None and t.device.value == "gpu" and t.cost_usd is not None:
            gpu_total += t.cost_usd
        elif t.run_s is not None or t.cold_start_s is not None:
            gpu_cost = task_cost(prices, "gpu", model, billable_s(t))
            if gpu_cost is not None:
                gpu_total += gpu_cost
                priced = True
    if not priced:
        return None, None
    gpu_priced = prices.per_second("gpu", model) is not None
    return (None if unpriced else round(total, 10)), (round(gpu_total, 10) if gpu_priced else None)


@dataclass(frozen=True)
class PipelineRun:
    """A run as stored: the stages as they were when it started, and the task of each stage started so far."""

    id: str
    tenant: str
    pipeline: str
    state: RunState
    input: dict[str, Any]
    gpu: GpuMode | None
    stages: tuple[Stage, ...]
    task_ids: tuple[str, ...]
    created_at: float
    output: Any = None
    error: dict[str, Any] | None = None
    finished_at: float | None = None
