"""The built-in app `turnout up` serves: small capabilities that show routing without a model download.

`shout` has a CPU and a GPU variant, so a user can watch the same request go to a GPU worker, or fall
back to the CPU when none is healthy.
"""

from __future__ import annotations

import time
from typing import Any

from turnout.worker.app import Context, WorkerApplication

app = WorkerApplication("turnout-demo")


@app.capability("echo", cpu=0.1, memory="16Mi")
def echo(ctx: Context, data: Any) -> Any:
    return data


@app.capability("noop", cpu=0.1)
def noop(ctx: Context, data: Any) -> None:
    return None


@app.capability("shout", cpu=0.5, memory="32Mi")
def shout(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    text = str(data.get("text", ""))
    ctx.emit("text_delta", delta=text.upper())
    return {"text": text.upper(), "device": ctx.device}


@app.capability("shout", gpu=1, gpu_memory="1Gi", cpu=0.5)
def shout_gpu(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    text = str(data.get("text", ""))
    ctx.emit("text_delta", delta=text.upper())
    return {"text": text.upper(), "device": ctx.device, "gpus": ctx.gpus}


@app.capability("sleep", cpu=0.1)
def sleep(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    seconds = float((data or {}).get("seconds", 1))
    steps = max(1, int(seconds * 10))
    for i in range(steps):
        time.sleep(seconds / steps)
        if i % 10 == 0:
            ctx.progress(i + 1, steps)
    return {"slept_s": seconds}


@app.capability("fail", cpu=0.1)
def fail(ctx: Context, data: dict[str, Any]) -> None:
    raise RuntimeError(str((data or {}).get("message", "asked to fail")))
