"""A worker app for pool, batching and `auto` tests: a slow setup, a batched handler, and two speeds of one task."""

from __future__ import annotations

import os
import time
from typing import Any

from turnout import Context, WorkerApplication

app = WorkerApplication("pool-tests")


@app.setup
def load(device: str) -> None:
    time.sleep(0.3)  # a model load: paid once per warm process, as cold_start_s


@app.capability("warmable", cpu=0.1, max_processes=3, idle_timeout_s=1.0)
def warmable(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    time.sleep(float(data.get("sleep", 0)))
    return {"pid": os.getpid()}


@app.capability("batched", cpu=0.5, max_batch_size=8, max_batch_wait_ms=300)
def batched(ctx: Context, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Logs one line per call (how many inputs it got), tells each task its own progress, answers in order."""
    with open(items[0]["log"], "a") as fh:
        fh.write(f"{len(items)}\n")
    if "who_log" in items[0]:  # whose inputs met in this one call (each says whose it is)
        with open(items[0]["who_log"], "a") as fh:
            fh.write(" ".join(str(item.get("who")) for item in items) + "\n")
    for i, item in enumerate(items):
        ctx.emit_for(i, "text", content=f"item {item['i']}")  # type: ignore[attr-defined]
    return [{"i": item["i"], "n": len(items), "pid": os.getpid()} for item in items]


@app.capability("embed", cpu=0.5)
def embed_cpu(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    time.sleep(0.4)
    return {"on": "cpu"}


@app.capability("embed", gpu=1, cpu=0.1)
def embed_gpu(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    time.sleep(0.02)
    return {"on": "gpu"}


@app.capability("hold", gpu=1, cpu=0.1)
def hold(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    time.sleep(float(data.get("seconds", 1)))
    return {}
