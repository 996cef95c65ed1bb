"""Wire formats (pydantic) and the translators between them and the frozen records inside.

Unknown fields are refused everywhere (extra="forbid"), so a typo is a 422 naming the field, not a
silently ignored option. Bodies arrive parsed by `strictjson` (no NaN, Infinity or lone surrogates
anywhere); floats here refuse non-finite values too, for bodies built in-process. Sizes past the
`RequestLimits` are 413s naming the limit.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime, timezone
from typing import Annotated, Any, ClassVar, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator
from starlette.responses import Response

from turnout.config import RequestLimits, describe_bytes
from turnout.controller import LeaseAsk, LeaseResult
from turnout.errors import InvalidInput, PayloadTooLarge
from turnout.gpu.devices import GpuDevice, GpuMetrics, MigDevice
from turnout.models import (
    CAPABILITY_NAME,
    Completion,
    Device,
    GpuMode,
    Lease,
    Routing,
    Task,
    TaskSpec,
    Variant,
    Worker,
    check_capability_name,
)
from turnout.resources import parse_resources

MAX_INT = 2**53  # integers beyond what every JSON reader keeps exact, and beyond SQL's BIGINT
MAX_INT32 = 2**31 - 1  # SQL INTEGER columns (attempts, event seq): more fails as a parameter in PostgreSQL
MAX_RUN_S = 10 * 365 * 86_400.0
MAX_WAIT_S = 3600.0  # the longest `?wait=` a route holds a client for (a task's result, a run)
MAX_EPOCH_S = 253_402_300_799.0  # 9999-12-31T23:59:59Z, the last second ISO 8601 writes in four digits
_NO_NUL = r"^[^\x00]*$"  # PostgreSQL text cannot hold NUL: an id or name with one is refused, never stored
_VERSION = r"^[0-9]{1,4}\.[0-9]{1,4}$"
TaskId = Annotated[str, Field(max_length=64, pattern=_NO_NUL)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


_QUANTITY = {"anyOf": [{"type": "string", "examples": ["512Mi", "4Gi"]}, {"type": "integer", "minimum": 0}]}
# What the OpenAPI document shows for fields checked by hand (for messages that list the values)
GPU_SCHEMA = WithJsonSchema({"anyOf": [{"type": "string", "enum": [m.value for m in GpuMode]}, {"type": "boolean"}],
                             "default": "auto"})  # fmt: skip
RESOURCES_SCHEMA = WithJsonSchema({"anyOf": [{"type": "null"}, {
    "type": "object", "additionalProperties": False,
    "properties": {
        "cpu": {"type": "number", "minimum": 0}, "memory": _QUANTITY, "gpu": {"type": "number", "minimum": 0},
        "gpu_memory": _QUANTITY, "min_compute_capability": {"type": "string", "examples": ["8.0"]},
        "gpu_model": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    },
}]})  # fmt: skip
# POST /v1/workers/{id}/events is parsed by hand (parse_events); this is its body for the OpenAPI document
EVENTS_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["events"], "additionalProperties": False,
    "properties": {"events": {"type": "array", "items": {
        "type": "object", "required": ["task_id", "attempt", "event"], "additionalProperties": False,
        "properties": {"task_id": {"type": "string"}, "attempt": {"type": "integer", "minimum": 1},
                       "event": {"type": "object", "properties": {"event": {"type": "string"}}}},
    }}},
}}}}}  # fmt: skip


class TaskIn(Strict):
    capability: str = Field(json_schema_extra={"pattern": CAPABILITY_NAME.pattern})
    input: Any = None
    gpu: Annotated[Any, GPU_SCHEMA] = (
        "auto"  # validated by GpuMode.parse, for a message that lists the values
    )
    gpu_wait_s: float = Field(10.0, ge=0, le=86_400)
    resources: Annotated[dict[str, Any] | None, RESOURCES_SCHEMA] = None
    priority: int = Field(0, ge=-1000, le=1000)
    timeout_s: float | None = Field(None, gt=0)
    placement_timeout_s: float = Field(60.0, gt=0)
    max_retries: int = Field(2, ge=0, le=100)
    idempotency_key: str | None = Field(None, min_length=1, max_length=200, pattern=_NO_NUL)
    labels: dict[str, str] = Field(default_factory=dict)

    @property
    def waits_for_capacity(self) -> bool:
        """The client set placement_timeout_s itself: it means to wait for workers that may not exist yet."""
        return "placement_timeout_s" in self.model_fields_set

    def to_spec(self, limits: RequestLimits, prefix: str = "") -> TaskSpec:
        check_capability_name(self.capability, f"{prefix}capability")
        check_task_size(self.input, self.labels, limits, prefix)
        resources = parse_resources(self.resources, f"{prefix}resources") if self.resources else None
        return TaskSpec(
            capability=self.capability, input=self.input, gpu=GpuMode.parse(self.gpu, f"{prefix}gpu"),
            gpu_wait_s=self.gpu_wait_s, resources=resources, resource_keys=frozenset(self.resources or ()),
            priority=self.priority, timeout_s=self.timeout_s, placement_timeout_s=self.placement_timeout_s,
            max_retries=self.max_retries, idempotency_key=self.idempotency_key, labels=dict(self.labels),
        )  # fmt: skip


class TaskBatchIn(Strict):
    tasks: list[TaskIn] = Field(min_length=1, max_length=1000)

    def to_specs(self, limits: RequestLimits) -> list[TaskSpec]:
        return [t.to_spec(limits, f"tasks.{i}.") for i, t in enumerate(self.tasks)]


def check_task_size(input: Any, labels: dict[str, str], limits: RequestLimits, prefix: str = "") -> None:
    """A task's input and labels within their limits (413 naming the limit and the field): rows stay small
    enough to list, lease and serve back, however large the body that carried them may be."""
    if input is not None:
        size = len(json.dumps(input, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
        if size > limits.max_input_bytes:
            raise PayloadTooLarge(
                f"{prefix}input: {describe_bytes(size)} of JSON; {limits.describe('max_input_bytes')} "
                '(put large data in a file and pass {"$file": ID})',
                field=f"{prefix}input",
            )
    if len(labels) > limits.max_labels:
        raise PayloadTooLarge(
            f"{prefix}labels: {len(labels)} labels; {limits.describe('max_labels')}", field=f"{prefix}labels"
        )
    for key, value in labels.items():
        longest = max(len(key.encode("utf-8")), len(value.encode("utf-8")))
        if longest > limits.max_label_bytes:
            field = f"{prefix}labels.{key[:64]}"
            raise PayloadTooLarge(
                f"{field}: a key or value of {longest} bytes; {limits.describe('max_label_bytes')}",
                field=field,
            )


class VariantIn(Strict):
    capability: str
    device: Literal["cpu", "gpu"]
    resources: dict[str, Any] = Field(default_factory=dict)
    max_batch_size: int = Field(1, ge=1, le=4096)
    max_batch_wait_ms: float = Field(0.0, ge=0, le=600_000)

    def to_variant(self, prefix: str) -> Variant:
        check_capability_name(self.capability, f"{prefix}capability")
        resources = parse_resources(self.resources, f"{prefix}resources")
        return Variant(
            self.capability, Device(self.device), resources, self.max_batch_size, self.max_batch_wait_ms
        )


class _Facts(BaseModel):
    """GPU facts and readings a worker reports: the known fields typed, and other keys only where the
    record they become (`of`) has such a field. A worker cannot store what placement would choke on."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    of: ClassVar[type]

    @model_validator(mode="after")
    def _only_known_keys(self) -> _Facts:
        unknown = set(self.model_extra or ()) - {f.name for f in dataclasses.fields(self.of)}
        if unknown:
            raise ValueError(f"unknown field {sorted(unknown)[0]!r}")
        return self


class MigIn(_Facts):
    of: ClassVar[type] = MigDevice
    uuid: str = Field(min_length=1, max_length=128, pattern=_NO_NUL)
    profile: str = Field(max_length=64)
    memory_total_bytes: int = Field(ge=0, le=MAX_INT)
    gpu_instance_id: int | None = Field(None, ge=0, le=MAX_INT)
    compute_instance_id: int | None = Field(None, ge=0, le=MAX_INT)
    index: int = Field(0, ge=0, le=1024)


class GpuIn(_Facts):
    of: ClassVar[type] = GpuDevice
    index: int = Field(ge=0, le=1024)
    uuid: str = Field(min_length=1, max_length=128, pattern=_NO_NUL)
    name: str = Field(max_length=256)
    memory_total_bytes: int = Field(ge=0, le=MAX_INT)
    memory_free_bytes: int | None = Field(None, ge=0, le=MAX_INT)
    compute_capability: str | None = Field(None, pattern=_VERSION)
    mig_mode: bool = False
    mig_devices: list[MigIn] = Field(default_factory=list, max_length=64)


class GpuProcessIn(Strict):
    pid: int = Field(ge=0, le=MAX_INT)
    used_memory_bytes: int = Field(ge=0, le=MAX_INT)


class GpuMetricsIn(_Facts):
    of: ClassVar[type] = GpuMetrics
    uuid: str = Field(min_length=1, max_length=128)
    utilization_pct: float | None = Field(None, ge=0, le=100)
    memory_used_bytes: int | None = Field(None, ge=0, le=MAX_INT)
    temperature_c: float | None = Field(None, ge=-273, le=1000)
    power_w: float | None = Field(None, ge=0, le=1_000_000)
    ecc_uncorrected: int | None = Field(None, ge=0, le=MAX_INT)
    processes: list[GpuProcessIn] = Field(default_factory=list, max_length=10_000)
    health: str = Field("ok", max_length=1024)
    xid_errors: list[int] = Field(default_factory=list, max_length=1000)


class MetricsIn(BaseModel):
    """A heartbeat's readings: per-GPU ones typed (dashboards and placement read them); others kept as sent."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    gpus: list[GpuMetricsIn] = Field(default_factory=list, max_length=1024)
    cpu_pct: float | None = Field(None, ge=0)
    running: int | None = Field(None, ge=0, le=MAX_INT)
    ts: float | None = None


class RegisterIn(Strict):
    name: str = Field(min_length=1, max_length=128, pattern=_NO_NUL)
    host: str = Field(min_length=1, max_length=256, pattern=_NO_NUL)
    variants: list[VariantIn] = Field(max_length=1000)
    cpu: float = Field(gt=0, le=1_000_000)
    memory: int = Field(ge=0, le=MAX_INT)
    gpus: list[GpuIn] = Field(default_factory=list, max_length=1024)
    strategy: Literal["pack", "spread"] = "pack"
    heartbeat_s: float | None = Field(None, gt=0, le=300)
    worker_id: str | None = Field(None, min_length=1, max_length=40, pattern=_NO_NUL)

    def to_variants(self) -> list[Variant]:
        return [v.to_variant(f"variants.{i}.") for i, v in enumerate(self.variants)]


class HeartbeatIn(Strict):
    metrics: MetricsIn | None = None
    quarantined: dict[str, str] | None = None


# What this controller's worker protocol offers beyond the first version, named in the register answer so a
# worker uses only what its controller understands: "complete_lease": `complete` may carry `lease`; "chain":
# chained pipeline stages; "lease_if_queued": that lease may ask only for what the results themselves queue;
# "channel": leases and reports may go over the WebSocket `/v1/workers/{id}/channel` (api/channel.py);
# "prefetch": a lease may ask for tasks to hold waiting beyond what runs (`prefetch`, `waiting`);
# "prefetch_s": only tasks known short, within that many seconds of work per core (`--prefetch auto`);
# "prefetch_gpu": GPU tasks held waiting too, each leased `after` a running task whose GPU share it takes.
WORKER_FEATURES = (
    "complete_lease",
    "chain",
    "lease_if_queued",
    "channel",
    "prefetch",
    "prefetch_s",
    "prefetch_gpu",
)


class LeaseAskIn(Strict):
    """A request for work: at most `max_tasks`, and the tasks the worker holds (see `Controller.lease`)."""

    max_tasks: int = Field(16, ge=0, le=1000)
    running: list[TaskId] = Field(default_factory=list)
    prefetch: int = Field(0, ge=0, le=1000)  # tasks to hold waiting beyond what runs (`Controller.lease`)
    # only tasks known short: at most this many seconds of expected work waiting per core (`--prefetch auto`)
    prefetch_s: float | None = Field(None, gt=0, le=3600)
    waiting: list[TaskId] = Field(default_factory=list)  # of `running`, those not started yet
    # it starts a lease's `after` task only when that task ends here: GPU tasks may be held waiting too
    prefetch_gpu: bool = False

    def to_ask(self, tenant: str) -> LeaseAsk:
        """The ask of a worker that serves `tenant` (its credential's, never the body's)."""
        return LeaseAsk(self.max_tasks, tuple(self.running), tenant, prefetch=self.prefetch,
                        prefetch_s=self.prefetch_s, waiting=tuple(self.waiting),
                        prefetch_gpu=self.prefetch_gpu)  # fmt: skip


class CompleteLeaseIn(LeaseAskIn):
    """The lease a completion carries; `if_queued`: only for work these results queue themselves (a pipeline's
    next stage, a retry), which the worker cannot know before the controller settles them."""

    if_queued: bool = False

    def to_ask(self, tenant: str) -> LeaseAsk:
        return dataclasses.replace(super().to_ask(tenant), if_queued=self.if_queued)


class LeaseIn(LeaseAskIn):
    wait_s: float = Field(20.0, ge=0, le=60)  # a long poll: answered at once when there is work
    # the `since` of this worker's last poll answer: nothing it could take has changed since, park at once
    since: str | None = Field(None, max_length=64)


class ResultIn(Strict):
    task_id: TaskId
    attempt: int = Field(ge=1, le=MAX_INT32)
    status: Literal["succeeded", "failed"]
    output: Any = None
    error: dict[str, Any] | None = None
    run_s: float | None = Field(None, ge=0, le=MAX_RUN_S)  # bounded: a cost of run_s x price must be a number
    started_at: float | None = Field(None, ge=0, le=MAX_EPOCH_S)  # a time every reader can format
    # what held and confined the process that ran it: containment's {"process_group", "pdeathsig", "pid_namespace",
    # "cgroup"} (containment.py) and, for a sandboxed command, the sandbox's {"sandbox", "network", ...} (sandbox.py)
    isolation: dict[str, Any] | None = Field(None, max_length=32)
    cold_start_s: float | None = Field(None, ge=0, le=MAX_RUN_S)  # process start and setup it waited for
    usage: UsageIn | None = None
    chain: TaskId | None = None  # the next pipeline stage's task, started at once (runs.py, chained stages)

    def to_completion(self) -> Completion:
        usage = self.usage.model_dump(exclude_none=True) if self.usage else None
        return Completion(self.task_id, self.attempt, self.status == "succeeded", self.output, self.error,
                          self.run_s, self.started_at, self.isolation, self.cold_start_s, usage, self.chain)  # fmt: skip


class UsageIn(Strict):
    """What a task used, measured by its worker: for profiles (`gpu: auto`, learned gpu_memory) and cost shares."""

    peak_rss_bytes: int | None = Field(None, ge=0, le=MAX_INT)
    peak_gpu_memory_bytes: int | None = Field(None, ge=0, le=MAX_INT)
    batch_size: int | None = Field(None, ge=1, le=100_000)


class CompleteIn(Strict):
    results: list[ResultIn] = Field(max_length=10_000)
    lease: CompleteLeaseIn | None = None  # work for the room these results free, in the same answer (no wait)


class ScrubIn(Strict):
    gpu: str = Field(min_length=1, max_length=128)
    task_id: str = Field(min_length=1, max_length=40)
    tenant: str = Field(min_length=1, max_length=64)  # whose task gets the GPU next
    previous_tenant: str | None = Field(None, max_length=64)  # None: unknown (the worker had just started)
    ok: bool
    seconds: float = Field(ge=0, le=MAX_RUN_S)
    message: str = Field("", max_length=2000)


class ScrubsIn(Strict):
    scrubs: list[ScrubIn] = Field(max_length=1000)


def parse_events(body: Any, limits: RequestLimits) -> list[tuple[str, int, dict[str, Any]]]:
    """`{"events": [{task_id, attempt, event}, ...]}` -> tuples, checked by hand: a chatty task sends
    tens of thousands per second, and a model per event would cost more than storing it."""
    if not isinstance(body, dict) or set(body) != {"events"} or not isinstance(body["events"], list):
        raise InvalidInput(
            'body: expected {"events": [{"task_id", "attempt", "event"}, ...]}', field="events"
        )
    items = body["events"]
    if len(items) > limits.max_events_per_request:
        raise PayloadTooLarge(f"events: {len(items)} in one request; {limits.describe('max_events_per_request')}",
                              field="events")  # fmt: skip
    out = []
    for i, e in enumerate(items):
        if not isinstance(e, dict) or e.keys() != {"task_id", "attempt", "event"}:
            raise InvalidInput(
                f"events.{i}: expected exactly task_id, attempt and event", field=f"events.{i}"
            )
        task_id, attempt, event = e["task_id"], e["attempt"], e["event"]
        if (
            not isinstance(task_id, str)
            or "\x00" in task_id
            or type(attempt) is not int
            or not 1 <= attempt <= MAX_INT32
            or not isinstance(event, dict)
        ):
            raise InvalidInput(f"events.{i}: task_id must be a string, attempt an integer >= 1, event an object",
                               field=f"events.{i}")  # fmt: skip
        out.append((task_id, attempt, event))
    return out


class TokenIn(Strict):
    role: str
    # default: the caller's own tenant ("default" for the operator); "*" (every tenant) for the operator only
    tenant: str | None = Field(None, min_length=1, max_length=64, pattern=_NO_NUL)


def token_out(row: dict[str, Any]) -> dict[str, Any]:
    """A stored token as `GET /v1/tokens` lists it: never its hash."""
    return {"id": row["id"], "role": row["role"], "tenant": row["tenant"], "created_at": iso(row["created_at"]),
            "revoked_at": iso(row["revoked_at"])}  # fmt: skip


AUDIT_TIMES = ("start", "end", "last_heartbeat")  # epoch seconds in the record, ISO 8601 on the wire


def audit_out(r: dict[str, Any]) -> dict[str, Any]:
    """An audit record as `GET /v1/audit` answers it: its body's fields, and its envelope's."""
    body = {k: iso(v) if k in AUDIT_TIMES and isinstance(v, int | float) else v for k, v in r["body"].items()}
    return {**body, "id": r["id"], "ts": iso(r["ts"]), "kind": r["kind"], "tenant": r["tenant"]}


def lease_out(le: Lease) -> dict[str, Any]:
    """One leased task as the worker receives it."""
    t = le.task
    return {"id": t.id, "attempt": t.attempts, "capability": t.spec.capability, "device": le.device.value,
            "input": t.spec.input, "resources": le.resources.to_dict(), "gpus": le.grant.to_dict() if le.grant else None, "timeout_s": t.spec.timeout_s,
            "labels": t.spec.labels, "tenant": t.tenant, "routing": t.routing.to_dict() if t.routing else None, "batch": le.batch,
            "chain": [{"stage": c.stage, "capability": c.capability, "timeout_s": c.timeout_s, "labels": c.labels}
                      for c in le.chain], **({"ahead": True} if le.ahead else {}),
            **({"after": le.after} if le.after else {})}  # fmt: skip


def leases_out(result: LeaseResult) -> dict[str, Any]:
    """A lease's answer: `{tasks, cancel, backlog}` (backlog: work for this worker stays queued)."""
    return {
        "tasks": [lease_out(le) for le in result.leases],
        "cancel": result.cancel,
        "backlog": result.backlog,
    }


class FastJSON(Response):
    """A JSON response encoded in one step by orjson, with no model or `jsonable_encoder` pass before it: what
    the hot routes answer. Bodies are plain dicts of JSON values (stored rows were checked as they entered);
    what orjson refuses (an integer beyond 64 bits in a task's input) is written by the standard library."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        try:
            return orjson.dumps(content)
        except TypeError:  # orjson.JSONEncodeError is a TypeError
            text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
            return text.encode("utf-8")


def iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def task_out(t: Task) -> dict[str, Any]:
    finished = t.finished_at
    started = t.started_at
    queue_end = started or t.leased_at or finished
    queue_s = (queue_end - t.created_at) if queue_end else None
    gpus = list(t.gpus.uuids) if t.gpus else []
    return {
        "id": t.id, "tenant": t.tenant, "capability": t.spec.capability, "state": t.state.value,
        "input": t.spec.input, "output": t.output, "error": t.error,
        "device": device_of(t), "gpu_model": t.gpu_model, "worker": t.worker_id,
        "gpus": gpus, "attempts": t.attempts, "routing": _public_routing(t.routing), "isolation": t.isolation, "gpu": t.spec.gpu.value,
        "priority": t.spec.priority, "labels": t.spec.labels, "timeout_s": t.spec.timeout_s,
        "max_retries": t.spec.max_retries, "idempotency_key": t.spec.idempotency_key,
        "queue_s": round(queue_s, 6) if queue_s is not None else None,
        "run_s": round(t.run_s, 6) if t.run_s is not None else None, "cost_usd": t.cost_usd,
        "cold_start_s": round(t.cold_start_s, 6) if t.cold_start_s is not None else None,
        "batch_size": (t.usage or {}).get("batch_size"), "pipeline_run_id": t.pipeline_run_id,
        "created_at": iso(t.created_at), "started_at": iso(started), "finished_at": iso(finished),
    }  # fmt: skip


def device_of(t: Task) -> str | None:
    """`cpu`, `gpu`, or `cloud:NAME` for a task an escalation endpoint ran."""
    cloud = t.routing.cloud if t.routing else None
    if cloud:
        return f"cloud:{cloud}"
    return t.device.value if t.device else None


def _public_routing(routing: Routing | None) -> dict[str, Any] | None:
    if routing is None:
        return None
    return {
        k: v for k, v in routing.to_dict().items() if k in ("requested", "device", "reason", "avoid_gpus")
    }


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
        "gpus": gpus, "strategy": w.strategy, "active_tasks": active, "pools": metrics.get("pools") or {},
        "registered_at": iso(w.registered_at), "last_heartbeat": iso(w.last_heartbeat), "heartbeat_s": w.heartbeat_s,
    }  # fmt: skip


def field_of(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body", "query", "path")]
    return ".".join(parts)
