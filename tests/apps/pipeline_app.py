"""A worker app for pipeline tests: small stages whose outputs show what input each stage received."""

from __future__ import annotations

import os
import time
from typing import Any

from turnout import Context, WorkerApplication

app = WorkerApplication("pipeline-tests")


@app.capability("split", cpu=0.1)
def split(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    time.sleep(float(data.get("split_sleep", 0)))
    return {"words": str(data["text"]).split(), "split_saw": sorted(data)}


@app.capability("count", cpu=0.1)
def count_cpu(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    time.sleep(float(data.get("count_sleep", 0)))
    return {"n": len(data["words"]), "count_on": ctx.device, "count_saw": sorted(data)}


@app.capability("count", gpu=1, cpu=0.1)
def count_gpu(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    time.sleep(float(data.get("count_sleep", 0)))
    return {"n": len(data["words"]), "count_on": ctx.device, "count_saw": sorted(data)}


@app.capability("tally", cpu=0.1, max_batch_size=8, max_batch_wait_ms=20)
def tally(ctx: Context, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A batched stage: a list of inputs in, a list of outputs out, whether it was leased or chained."""
    return [{"n": len(item["words"]), "tally_batch": len(items)} for item in items]


@app.capability("report", cpu=0.1)
def report(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    return {"summary": f"{data['n']} words", "report_saw": sorted(data), "pid": os.getpid()}


@app.capability("explode", cpu=0.1)
def explode(ctx: Context, data: dict[str, Any]) -> None:
    raise ValueError(f"cannot handle {len(data['words'])} words")


@app.capability("nap", cpu=0.1)
def nap(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    """Sleeps `nap_s` (writing its pid to `pidfile` first, where given): a stage that is in flight for a while."""
    if data.get("pidfile"):
        part = f"{data['pidfile']}.part"  # written whole, then renamed: a reader never sees it empty
        with open(part, "w") as fh:
            fh.write(str(os.getpid()))
        os.replace(part, data["pidfile"])
    time.sleep(float(data.get("nap_s", 0)))
    return {"napped_s": data.get("nap_s", 0)}


@app.capability("noop", cpu=0.1)
def noop(ctx: Context, data: Any) -> dict[str, Any]:
    return {}
