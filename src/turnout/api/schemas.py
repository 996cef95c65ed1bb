"""Wire formats (pydantic) and the translators between them and the frozen records inside.

Unknown fields are refused everywhere (extra="forbid"), so a typo is a 422 naming the field, not a
silently ignored option.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from turnout.errors import InvalidInput
from turnout.models import GpuMode, Task, TaskSpec, Worker, check_capability_name
from turnout.resources import parse_resources


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TaskIn(Strict):
    capability: str
    input: Any = None
    gpu: Any = "auto"  # validated by GpuMode.parse, for a message that lists the values
    gpu_wait_s: float = Field(10.0, ge=0, le=86_400)
    resources: dict[str, Any] | None = None
    priority: int = Field(0, ge=-1000, le=1000)
    timeout_s: float | None = Field(None, gt=0)
    placement_timeout_s: float = Field(60.0, gt=0)
    max_retries: int = Field(2, ge=0, le=100)
    idempotency_key: str | None = Field(None, min_length=1, max_length=200)
    labels: dict[str, str] = Field(default_factory=dict)

    def to_spec(self, prefix: str = "") -> TaskSpec:
        check_capability_name(self.capability, f"{prefix}capability")
        resources = parse_resources(self.resources, f"{prefix}resources") if self.resources else None
        return TaskSpec(
            capability=self.capability, input=self.input, gpu=GpuMode.parse(self.gpu, f"{prefix}gpu"),
            gpu_wait_s=self.gpu_wait_s, resources=resources, resource_keys=frozenset(self.resources or ()),
            priority=self.priority, timeout_s=self.timeout_s, placement_timeout_s=self.placement_timeout_s,
            max_retries=self.max_retries, idempotency_key=self.idempotency_key, labels=dict(self.labels),
        )  # fmt: skip


class TaskBatchIn(Strict):
    tasks: list[TaskIn] = Field(min_length=1, max_length=1000)

    def to_specs(self) -> list[TaskSpec]:
        return [t.to_spec(f"tasks.{i}.") for i, t in enumerate(self.tasks)]


class VariantIn(Strict):
    capability: str
    device: Literal["cpu", "gpu"]
    resources: dict[str, Any] = Field(default_factory=dict)


class RegisterIn(Strict):
    name: str = Field(min_length=1, max_length=128)
    host: str = Field(min_length=1, max_length=256)
    variants: list[VariantIn]
    cpu: float = Field(gt=0)
    memory: int = Field(ge=0)
    gpus: list[dict[str, Any]] = Field(default_factory=list)
    strategy: Literal["pack", "spread"] = "pack"
    heartbeat_s: float | None = Field(None, gt=0, le=300)
    worker_id: str | None = Field(None, max_length=40)


class HeartbeatIn(Strict):
    metrics: dict[str, Any] | None = None
    quarantined: dict[str, str] | None = None


class LeaseIn(Strict):
    max_tasks: int = Field(16, ge=0, le=1000)
    wait_s: float = Field(20.0, ge=0, le=60)
    running: list[str] = Field(default_factory=list)


class ResultIn(Strict):
    task_id: str
    attempt: int = Field(ge=1)
    status: Literal["succeeded", "failed"]
    output: Any = None
    error: dict[str, Any] | None = None
    run_s: float | None = Field(None, ge=0)
    started_at: float | None = None


class CompleteIn(Strict):
    results: list[ResultIn] = Field(max_length=10_000)


MAX_EVENTS_PER_POST = 100_000


def parse_events(body: Any) -> list[tuple[str, int, dict[str, Any]]]:
    """`{"events": [{task_id, attempt, event}, ...]}` -> tuples, checked by hand: a chatty task sends
    tens of thousands per second, and a model per event would cost more than storing it."""
    if not isinstance(body, dict) or set(body) != {"events"} or not isinstance(body["events"], list):
        raise InvalidInput(
            'body: expected {"events": [{"task_id", "attempt", "event"}, ...]}', field="events"
        )
    items = body["events"]
    if len(items) > MAX_EVENTS_PER_POST:
        raise InvalidInput(f"events: at most {MAX_EVENTS_PER_POST} per request", field="events")
    out = []
    for i, e in enumerate(items):
        if not isinstance(e, dict) or e.keys() != {"task_id", "attempt", "event"}:
            raise InvalidInput(
                f"events.{i}: expected exactly task_id, attempt and event", field=f"events.{i}"
            )
        task_id, attempt, event = e["task_id"], e["attempt"], e["event"]
        if (
            not isinstance(task_id, str)
            or type(attempt) is not int
            or attempt < 1
            or not isinstance(event, dict)
        ):
            raise InvalidInput(f"events.{i}: task_id must be a string, attempt an integer >= 1, event an object",
                               field=f"events.{i}")  # fmt: skip
        out.append((task_id, attempt, event))
    return out


class TokenIn(Strict):
    role: str
    tenant: str | None = None  # default: the caller's own tenant ("default" for the operator)


def iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def task_out(t: Task) -> dict[str, Any]:
    finished = t.finished_at
    started = t.started_at
    queue_end = started or t.leased_at or finished
    queue_s = (queue_end - t.created_at) if queue_end else None
    gpus = list((t.gpus or {}).get("uuids", [])) if t.gpus else []
    return {
        "id": t.id, "tenant": t.tenant, "capability": t.spec.capability, "state": t.state.value,
        "input": t.spec.input, "output": t.output, "error": t.error,
        "device": t.device.value if t.device else None, "gpu_model": t.gpu_model, "worker": t.worker_id,
        "gpus": gpus, "attempts": t.attempts, "routing": _public_routing(t.routing), "gpu": t.spec.gpu.value,
        "priority": t.spec.priority, "labels": t.spec.labels, "timeout_s": t.spec.timeout_s,
        "max_retries": t.spec.max_retries, "idempotency_key": t.spec.idempotency_key,
        "queue_s": round(queue_s, 6) if queue_s is not None else None,
        "run_s": round(t.run_s, 6) if t.run_s is not None else None, "cost_usd": t.cost_usd,
        "created_at": iso(t.created_at), "started_at": iso(started), "finished_at": iso(finished),
    }  # fmt: skip


def _public_routing(routing: dict[str, Any] | None) -> dict[str, Any] | None:
    if routing is None:
        return None
    return {k: v for k, v in routing.items() if k in ("requested", "device", "reason", "avoid_gpus")}


def worker_out(w: Worker, active: int = 0) -> dict[str, Any]:
    metrics = w.metrics or {}
    live = {m.get("uuid"): m for m in metrics.get("gpus", [])}
    gpus = []
    for g in w.gpus:
        gpus.append(
            {**g, "metrics": live.get(g.get("uuid")), "quarantined": w.quarantined.get(g.get("uuid", ""))}
        )
    return {
        "id": w.id, "name": w.name, "host": w.host, "state": w.state.value,
        "capabilities": sorted({v.capability for v in w.variants}),
        "variants": [v.to_dict() for v in w.variants],
        "resources": {"cpu": w.cpu, "memory": w.memory_bytes, "gpus": len(w.gpus)},
        "gpus": gpus, "strategy": w.strategy, "active_tasks": active,
        "registered_at": iso(w.registered_at), "last_heartbeat": iso(w.last_heartbeat), "heartbeat_s": w.heartbeat_s,
    }  # fmt: skip


def field_of(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts)


def require(cond: bool, message: str, field: str) -> None:
    if not cond:
        raise InvalidInput(message, field=field)
