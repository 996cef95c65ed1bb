"""A worker app for tests: handlers that count their runs, sleep, spawn children, or fail on purpose."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from turnout import Context, WorkerApplication

app = WorkerApplication("tests")


def _record(data: dict[str, Any], ctx: Context) -> None:
    log = data.get("log")
    if log:
        with open(log, "a") as fh:  # O_APPEND: one line per run, atomic for short lines
            fh.write(f"{ctx.task_id} {os.getpid()} {ctx.device}\n")


@app.capability("count", cpu=0.1)
def count(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    _record(data, ctx)
    time.sleep(float(data.get("sleep", 0)))
    if ctx.attempt == 1:
        time.sleep(float(data.get("sleep_first_attempt", 0)))
    return {"n": data.get("n"), "pid": os.getpid()}


@app.capability("work", cpu=0.5)
def work_cpu(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    _record(data, ctx)
    time.sleep(float(data.get("sleep", 0)))
    return {"device": ctx.device, "gpus": ctx.gpus, "env": os.environ.get("CUDA_VISIBLE_DEVICES")}


@app.capability("work", gpu=1, cpu=0.5)
def work_gpu(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    _record(data, ctx)
    time.sleep(float(data.get("sleep", 0)))
    return {"device": ctx.device, "gpus": ctx.gpus, "env": os.environ.get("CUDA_VISIBLE_DEVICES")}


@app.capability("gpuonly", gpu=1, cpu=0.1)
def gpu_only(ctx: Context, data: Any) -> dict[str, Any]:
    return {"device": ctx.device, "pid": os.getpid()}


@app.capability("spawn", cpu=0.1)
def spawn(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    """Starts a grandchild that would outlive us, writes its pid, then sleeps."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    pidfile = Path(data["pidfile"])  # written whole, then renamed: a reader never sees it empty
    pidfile.with_suffix(".part").write_text(f"{os.getpid()} {child.pid}\n")
    os.replace(pidfile.with_suffix(".part"), pidfile)
    time.sleep(float(data.get("sleep", 600)))
    return {}


@app.capability("boom", cpu=0.1)
def boom(ctx: Context, data: Any) -> None:
    raise ValueError("boom")


@app.capability("oom", cpu=0.1)
def oom_cpu(ctx: Context, data: Any) -> dict[str, Any]:
    return {"device": ctx.device}


@app.capability("oom", gpu_memory="8Gi", cpu=0.1)
def oom_gpu(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    """Runs out of GPU memory on its first attempt, like a batch that was too large for that GPU."""
    if ctx.attempt == 1:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return {
        "device": ctx.device,
        "gpus": ctx.gpus,
        "limit": os.environ.get("TURNOUT_GPU_MEMORY_LIMIT"),
        "fraction": os.environ.get("TURNOUT_GPU_MEMORY_FRACTION"),
    }


@app.capability("hog", gpu_memory="4Gi", cpu=0.1)
def hog(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    """Reports (through the fake GPU's state file) that it uses more memory than its share, then waits."""
    from turnout.gpu.fake import write_fake_state

    write_fake_state(
        Path(data["state"]), ctx.gpus[0], processes=[{"pid": os.getpid(), "used_memory_bytes": data["bytes"]}]
    )
    time.sleep(float(data.get("sleep", 30)))
    return {}


@app.capability("share", gpu_memory="4Gi", cpu=0.1)
def share(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    time.sleep(float(data.get("sleep", 0)))
    return {"gpus": ctx.gpus}


class Opaque:
    """A value of a class json knows nothing about."""


BAD_OUTPUTS: dict[str, Any] = {
    "nan": {"x": float("nan")},
    "infinity": {"scores": [0.5, float("inf")]},
    "surrogate": {"text": "caf\ud800"},
    "set": {"tags": {"a", "b"}},
    "bytes": {"blob": b"\x00\x01"},
    "object": {"model": Opaque()},
    "huge_int": {"n": 10**5000},
}


@app.capability("bad_output", cpu=0.1)
def bad_output(ctx: Context, data: dict[str, Any]) -> Any:
    """Returns what JSON cannot carry (`data["kind"]`, a key of BAD_OUTPUTS), after `sleep` seconds."""
    time.sleep(float(data.get("sleep", 0)))
    return BAD_OUTPUTS[data["kind"]]


@app.capability("bad_event", cpu=0.1)
def bad_event(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    """Emits a good event, then one with NaN in it (refused at the emit), then would emit another."""
    ctx.emit("text_delta", delta="before ")
    ctx.emit("progress", done=float("nan"), total=1)
    ctx.emit("text_delta", delta="after")
    return {"ok": True}


@app.capability("logged_sleep", cpu=0.1)
def logged_sleep(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    """Logs a `start` and an `end` line per run in `bench.fault_app`'s format (read by tests/faults'
    `read_runs`), so a run that was killed shows a start without an end; sleeps `seconds` in between, and
    `first_attempt_s` more on the first attempt (a run to kill, then a quick one to count)."""
    from bench.common import log_run

    seconds = float(data.get("seconds", 0))
    if ctx.attempt == 1:
        seconds += float(data.get("first_attempt_s", 0))
    log_run(data["log"], "start", ctx.task_id)
    time.sleep(seconds)
    log_run(data["log"], "end", ctx.task_id)
    return {"n": data.get("n")}


@app.capability("logged_share", gpu=0.25, cpu=0.1)
def logged_share(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    """A quarter of a GPU: logs its run as `logged_sleep` does, and answers the GPUs it was given."""
    from bench.common import log_run

    log_run(data["log"], "start", ctx.task_id)
    time.sleep(float(data.get("seconds", 0)))
    log_run(data["log"], "end", ctx.task_id)
    return {"gpus": ctx.gpus}
