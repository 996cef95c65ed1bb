"""The vocabulary: task states, routing modes, and the frozen records the controller passes around.

Records here are what the store returns and the controller decides on; the wire format (pydantic) lives
in `api/schemas.py` and translates to and from these in one place.
"""

from __future__ import annotations

import enum
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from turnout.errors import InvalidInput
from turnout.gpu.allocation import GpuGrant
from turnout.resources import Resources

CAPABILITY_NAME = re.compile(r"^[a-z][a-z0-9_.-]{0,63}$")
TASK_ID = re.compile(
    r"^t_[0-9a-f]{24}$"
)  # what `new_id("t_")` makes: a worker naming a chained stage must match it


def new_id(prefix: str) -> str:
    """Time-ordered ids: listing newest first is ordering by id. Workers make the ids of the pipeline stages
    they chain (`Completion.chain`), so this lives here, below both the controller and the worker."""
    return f"{prefix}{int(time.time() * 1000):012x}{secrets.token_hex(6)}"


def check_capability_name(name: Any, field_name: str = "capability") -> str:
    if not isinstance(name, str) or not CAPABILITY_NAME.match(name):
        raise InvalidInput(
            f"{field_name}: {name!r} is not a capability name (lowercase letter first, then a-z 0-9 _ . -, at most 64)",
            field=field_name,
        )
    return name


class TaskState(str, enum.Enum):
    QUEUED = "queued"
    LEASED = "leased"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({TaskState.SUCCEEDED, TaskState.FAILED, TaskState.CANCELLED})
ACTIVE_STATES = frozenset({TaskState.LEASED, TaskState.RUNNING})


class GpuMode(str, enum.Enum):
    """The `gpu` field of a task: how much it wants a GPU."""

    PREFER = "prefer"
    NEVER = "never"
    REQUIRE = "require"
    AUTO = "auto"

    @classmethod
    def parse(cls, value: Any, field_name: str = "gpu") -> GpuMode:
        if value is True:
            return cls.PREFER
        if value is False:
            return cls.NEVER
        if value is None:
            return cls.AUTO
        try:
            return cls(value)
        except ValueError:
            raise InvalidInput(
                f"{field_name}: expected one of prefer, never, require, auto, true, false; got {value!r}",
                field=field_name,
            ) from None


class Device(str, enum.Enum):
    CPU = "cpu"
    GPU = "gpu"


class WorkerState(str, enum.Enum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"
    GONE = "gone"


class Role(str, enum.Enum):
    ADMIN = "admin"
    SUBMIT = "submit"
    WORKER = "worker"
    READ = "read"


@dataclass(frozen=True)
class Variant:
    """One implementation of a capability for a device class, as a worker registers it."""

    capability: str
    device: Device
    resources: Resources
    max_batch_size: int = 1  # > 1: the controller leases up to this many of its tasks together, on one grant
    max_batch_wait_ms: float = 0.0  # how long a batch may wait to fill before it is leased part full

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "capability": self.capability,
            "device": self.device.value,
            "resources": self.resources.to_dict(),
        }
        if self.max_batch_size > 1:
            out.update(max_batch_size=self.max_batch_size, max_batch_wait_ms=self.max_batch_wait_ms)
        return out


@dataclass(frozen=True)
class TaskSpec:
    """A validated submission, before it has an id."""

    capability: str
    input: Any
    gpu: GpuMode = GpuMode.AUTO
    gpu_wait_s: float = 10.0
    resources: Resources | None = None
    resource_keys: frozenset[str] = frozenset()  # which keys the task set itself
    priority: int = 0
    timeout_s: float | None = None
    placement_timeout_s: float = 60.0
    max_retries: int = 2
    idempotency_key: str | None = None
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Routing:
    """Where a task's last lease sent it and why, and what a new lease carries on (`carried`): the GPUs to
    avoid, the last error, the leases that never reached a worker. An escalated task also names its endpoint
    and the job there. Stored as a JSON object of the keys that are set (`to_dict`), decoded once per row."""

    requested: str | None = None  # the task's `gpu` mode when it was routed
    device: str | None = None  # cpu, gpu, or cloud:NAME
    reason: str | None = None
    avoid_gpus: tuple[str, ...] = ()
    last_error: dict[str, Any] | None = None
    undelivered: int = 0  # leases whose answer never reached the worker (they do not count as retries)
    cloud: str | None = None  # the escalation endpoint that runs it
    cloud_job: str | None = None  # its job id there

    def carried(self) -> Routing:
        """The history a new lease keeps; the rest is that lease's own."""
        return Routing(avoid_gpus=self.avoid_gpus, last_error=self.last_error, undelivered=self.undelivered)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in ("requested", "device", "reason", "last_error", "cloud", "cloud_job"):
            if (value := getattr(self, name)) is not None:
                out[name] = value
        if self.avoid_gpus:
            out["avoid_gpus"] = list(self.avoid_gpus)
        if self.undelivered:
            out["undelivered"] = self.undelivered
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Routing | None:
        if d is None:
            return None
        return cls(requested=d.get("requested"), device=d.get("device"), reason=d.get("reason"),
                   avoid_gpus=tuple(d.get("avoid_gpus") or ()), last_error=d.get("last_error"),
                   undelivered=int(d.get("undelivered") or 0), cloud=d.get("cloud"), cloud_job=d.get("cloud_job"))  # fmt: skip


@dataclass(frozen=True)
class Allocation:
    """What a leased or running task holds on its worker. A batch's rider holds no CPU or memory of its own
    (its leader's process runs it): it names the batch (its leader's id) and the leader's attempt, whose GPU
    allocation it shares."""

    cpu: float = 0.0
    memory: int = 0
    gpu_share: float | None = None  # of the GPU it holds; None without a GPU
    batch: str | None = None  # the batch it is in, leader or rider
    batch_attempt: int | None = None  # a rider's: its leader's attempt
    # leased ahead of a free slot (the worker's `prefetch`): it waits on the worker until room frees there, and
    # its timeout counts from when it starts, not from its lease
    ahead: bool = False
    # a GPU task held ahead: the task on whose GPU share it waits, and whose CPU it takes when that one ends
    # (`placement.Followers`)
    after: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"cpu": self.cpu, "memory": self.memory}
        for name in ("gpu_share", "batch", "batch_attempt", "after"):
            if (value := getattr(self, name)) is not None:
                out[name] = value
        if self.ahead:
            out["ahead"] = True
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Allocation | None:
        if d is None:
            return None
        share, attempt = d.get("gpu_share"), d.get("batch_attempt")
        return cls(cpu=float(d.get("cpu") or 0), memory=int(d.get("memory") or 0),
                   gpu_share=None if share is None else float(share), batch=d.get("batch"),
                   batch_attempt=None if attempt is None else int(attempt), ahead=bool(d.get("ahead")),
                   after=d.get("after"))  # fmt: skip


@dataclass(frozen=True)
class Task:
    """A task as stored. Times are epoch seconds (UTC); the API renders them as ISO 8601."""

    id: str
    tenant: str
    spec: TaskSpec
    state: TaskState
    created_at: float
    attempts: int = 0
    output: Any = None
    error: dict[str, Any] | None = None
    worker_id: str | None = None
    device: Device | None = None
    gpus: GpuGrant | None = None  # held while it runs, kept after for the record
    gpu_model: str | None = None
    routing: Routing | None = None
    queued_at: float | None = None
    leased_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    run_s: float | None = None
    cost_usd: float | None = None
    cold_start_s: float | None = None  # process start and setup paid by this task (no warm process was ready)
    usage: dict[str, Any] | None = None  # what it used: peak_rss_bytes, peak_gpu_memory_bytes, batch_size
    unservable_since: float | None = None
    pipeline_run_id: str | None = None
    alloc: Allocation | None = None  # CPU, memory and GPU share held while leased or running
    # what held and confined its processes, as its worker reported: containment keys (worker/containment.py)
    # and, for a sandboxed command, the sandbox's (worker/sandbox.py)
    isolation: dict[str, Any] | None = None


@dataclass(frozen=True)
class Worker:
    id: str
    name: str
    host: str
    state: WorkerState
    variants: tuple[Variant, ...]
    cpu: float
    memory_bytes: int
    gpus: tuple[dict[str, Any], ...]  # GpuDevice dicts, as discovered
    strategy: str
    registered_at: float
    last_heartbeat: float
    heartbeat_s: float
    metrics: dict[str, Any] = field(default_factory=dict)  # live readings from the last heartbeat
    quarantined: dict[str, str] = field(default_factory=dict)  # GPU uuid -> reason

    def offers(self, capability: str) -> dict[Device, Variant]:
        return {v.device: v for v in self.variants if v.capability == capability}


@dataclass(frozen=True)
class Lease:
    """What a worker receives for one task: everything it needs to run it."""

    task: Task
    device: Device
    resources: Resources
    grant: GpuGrant | None
    batch: str | None = None  # the leader's task id, for every task leased in a batch (batching.py)
    chain: tuple[ChainStep, ...] = ()  # the pipeline stages after this one that may run right after it, here
    ahead: bool = False  # leased ahead of a free slot: it waits on the worker for room (Allocation.ahead)
    after: str | None = None  # a GPU task held ahead: it starts when this task, whose share it takes, ends


@dataclass(frozen=True)
class ChainStep:
    """A pipeline stage a worker may start as soon as the stage before it succeeds there, without waiting for
    the controller (runs.py, "chained stages"): what the worker needs to run it before its task exists."""

    stage: int
    capability: str
    timeout_s: float | None
    labels: dict[str, str]


@dataclass(frozen=True)
class Completion:
    """A worker's report that one attempt of a task ended."""

    task_id: str
    attempt: int
    succeeded: bool
    output: Any = None
    error: dict[str, Any] | None = None
    run_s: float | None = None
    started_at: float | None = None
    isolation: dict[str, Any] | None = None  # e.g. {"pdeathsig": true, "mode": "sandbox", ...}
    cold_start_s: float | None = None  # process start and setup this attempt waited for
    usage: dict[str, Any] | None = None  # peak_rss_bytes, peak_gpu_memory_bytes, batch_size
    chain: str | None = None  # the id of the next pipeline stage's task, which this worker started at once
