"""`WorkerApplication` and `Context`: how users declare capabilities and their CPU and GPU variants.

One definition serves CPU hosts and GPU hosts alike: a variant that asks for `gpu` or `gpu_memory` is a GPU
variant, any other a CPU variant, and each worker offers the variants its hardware can run.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from turnout.errors import InvalidInput
from turnout.jsonsafe import problem
from turnout.models import Device, Variant, check_capability_name
from turnout.resources import Resources, parse_resources
from turnout.worker.reports import PROTOCOL_EVENTS, TASK_TAG, InvalidOutput, event_name_problem

Handler = Callable[["Context", Any], Any]


@dataclass(frozen=True)
class PoolSettings:
    min_processes: int = 0
    max_processes: int | None = None  # None: as many as the worker's resources allow
    idle_timeout_s: float = 60.0


@dataclass(frozen=True)
class HandlerVariant:
    variant: Variant
    handler: Handler
    pool: PoolSettings = field(default_factory=PoolSettings)
    setup: Callable[[str], None] | None = None  # once per warm process of this variant (a model load)

    @property
    def key(self) -> str:
        return f"{self.variant.capability}:{self.variant.device.value}"


class WorkerApplication:
    """A named set of capabilities. Decorate functions with `@app.capability(...)` and `@app.setup`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.variants: dict[str, HandlerVariant] = {}
        self.setup_fn: Callable[[str], None] | None = None

    def setup(self, fn: Callable[[str], None]) -> Callable[[str], None]:
        """Runs once per warm process, before its first task, with the device ("cuda:0" or "cpu")."""
        self.setup_fn = fn
        return fn

    def capability(
        self,
        name: str,
        *,
        cpu: float = 1.0,
        memory: str | int | None = None,
        gpu: float | None = None,
        gpu_memory: str | int | None = None,
        gpu_model: str | list[str] | None = None,
        min_compute_capability: str | None = None,
        min_processes: int = 0,
        max_processes: int | None = None,
        idle_timeout_s: float = 60.0,
        max_batch_size: int = 1,
        max_batch_wait_ms: float = 0.0,
        setup: Callable[[str], None] | None = None,
    ) -> Callable[[Handler], Handler]:
        """Declare a variant. Pools: `min_processes` warm processes kept, at most `max_processes`, idle ones above
        the minimum exit after `idle_timeout_s`. Batching: with `max_batch_size` > 1 the handler receives a list
        of inputs (up to that many, gathered for at most `max_batch_wait_ms`) and returns a list of outputs.
        `setup(device)` runs once per warm process of this variant, after the app's `@app.setup`: load this
        variant's model there, and its time counts as the cold start, not as any task's run."""
        check_capability_name(name, "capability")
        spec: dict[str, Any] = {"cpu": cpu}
        for key, value in (("memory", memory), ("gpu", gpu), ("gpu_memory", gpu_memory), ("gpu_model", gpu_model),
                           ("min_compute_capability", min_compute_capability)):  # fmt: skip
            if value is not None:
                spec[key] = value
        resources = parse_resources(spec, f"{name}.resources")
        device = Device.GPU if resources.wants_gpu else Device.CPU
        if min_processes < 0 or (max_processes is not None and max_processes < max(1, min_processes)):
            raise InvalidInput(f"{name}: need 0 <= min_processes <= max_processes", field="max_processes")
        if idle_timeout_s < 0:
            raise InvalidInput(f"{name}: idle_timeout_s must be >= 0", field="idle_timeout_s")
        if not 1 <= max_batch_size <= 4096 or max_batch_wait_ms < 0:
            raise InvalidInput(f"{name}: need 1 <= max_batch_size <= 4096 and max_batch_wait_ms >= 0",
                               field="max_batch_size")  # fmt: skip

        def register(fn: Handler) -> Handler:
            hv = HandlerVariant(Variant(name, device, resources, max_batch_size, float(max_batch_wait_ms)), fn,
                                PoolSettings(min_processes, max_processes, idle_timeout_s), setup)  # fmt: skip
            if hv.key in self.variants:
                raise InvalidInput(
                    f"{name}: a {device.value} variant is already defined in app {self.name}",
                    field="capability",
                )
            self.variants[hv.key] = hv
            return fn

        return register


class Context:
    """What a handler sees of its task. `emit` streams events to whoever follows the task; `path(ref)` is
    the local path of an input file (`{"$file": ID}` in its input); files written under `output_dir` come
    back in its output as references."""

    def __init__(
        self,
        *,
        task_id: str,
        attempt: int,
        device: str,
        gpus: list[str],
        sink: IO[str] | None = None,
        lock: threading.Lock | None = None,
        files: dict[str, str] | None = None,
        output_dir: str | None = None,
        tag: int | None = None,
    ) -> None:
        self.task_id = task_id
        self.attempt = attempt
        self.device = device
        self.gpus = gpus
        self._sink = sink
        self._lock = lock or threading.Lock()
        self._files = files or {}
        self._output_dir = output_dir
        self._output_made = False
        self._tag = tag  # the task's number in its process: each line it writes says it (TASK_TAG)
        self._ended = False  # its handler returned: later events belong to no task and are dropped

    def path(self, ref: Any) -> Path:
        """The local path of an input file, by its reference (`{"$file": ID}`, as in the input) or its id."""
        from turnout.files import ref_id

        file_id = ref_id(ref) or (ref if isinstance(ref, str) else None)
        if file_id is None or file_id not in self._files:
            raise InvalidInput(f"ctx.path: {ref!r} is not a file reference in this task's input", field="ref")
        return Path(self._files[file_id])

    @property
    def output_dir(self) -> Path:
        """An empty directory of this attempt's own: what the handler writes here is sent back as files.

        The worker names it (a new name under its own 0700 directory) and it is made here, at its first use:
        a task that writes no file costs the worker no change to the file system."""
        if self._output_dir is None:
            raise InvalidInput("ctx.output_dir: this task was not started by a worker that collects files, or "
                               "it runs in a batch (a batch's handler has no output directory)",
                               field="output_dir")  # fmt: skip
        path = Path(self._output_dir)
        if not self._output_made:
            path.mkdir(mode=0o700, exist_ok=True)
            self._output_made = True
        return path

    def emit(self, event: str, **fields: Any) -> None:
        """Stream one event. A value strict JSON cannot carry (NaN, a set, a lone surrogate) raises
        `InvalidOutput` here, in the handler that made it, naming the field (`events.progress.done`): the
        task fails `invalid_output` unless the handler catches it; nothing is silently turned into a string.

        `event` is a short identifier (`progress`, `text_delta`); `result` and `finish` are the protocol's own
        (the handler's return value is its result) and are refused with `InvalidInput`, as is any other name.
        An event emitted after the handler returned (from a thread it left running) is dropped."""
        why = event_name_problem(event)
        if why is None and event in PROTOCOL_EVENTS:
            why = f"{event!r} is written by Turnout when the handler returns (return the output instead)"
        if why is None and TASK_TAG in fields:
            why = f"{TASK_TAG!r} is a field the protocol uses"
        if why is not None:
            raise InvalidInput(f"ctx.emit: {why}", field="event")
        body = {"event": event, **fields}
        found = problem(fields, f"events.{event}")
        if found:
            raise InvalidOutput(*found)
        if self._sink is None:
            return
        line = json.dumps({TASK_TAG: self._tag, **body} if self._tag is not None else body, allow_nan=False)
        with self._lock:
            if self._ended:
                return
            self._sink.write(line + "\n")
            self._sink.flush()

    def _end(self) -> None:
        """The handler returned: from now on `emit` drops what it is given (called by the runner)."""
        with self._lock:
            self._ended = True

    def progress(self, done: float, total: float | None = None) -> None:
        self.emit("progress", done=done, total=total)


class BatchContext(Context):
    """What a batched handler sees: one context for the batch. `emit` goes to every task's stream;
    `emit_for(i, ...)` to the i-th input's task only. `task_ids[i]` is the i-th input's task."""

    task_ids: list[str]

    def emit_for(self, item: int, event: str, **fields: Any) -> None:
        self.emit(event, item=item, **fields)


def load_app(ref: str) -> WorkerApplication:
    """`package.module:app` -> the WorkerApplication object (errors name the reference)."""
    import importlib

    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise InvalidInput(f"app: {ref!r} should look like MODULE:APP, e.g. myproject.tasks:app", field="app")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidInput(f"app: cannot import {module_name!r}: {exc}", field="app") from None
    app = getattr(module, attr, None)
    if not isinstance(app, WorkerApplication):
        raise InvalidInput(f"app: {ref!r} is not a turnout.WorkerApplication", field="app")
    return app


def describe(resources: Resources) -> str:
    return ", ".join(f"{k}={v}" for k, v in resources.to_dict().items())
