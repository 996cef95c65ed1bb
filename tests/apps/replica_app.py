"""A worker app for the replica tests: a no-op that appends its task id to a log once it has run."""

from __future__ import annotations

from typing import Any

from turnout import Context, WorkerApplication

app = WorkerApplication("replicas")


@app.capability("tick", cpu=0.25)
def tick(ctx: Context, data: dict[str, Any]) -> None:
    with open(data["log"], "a") as fh:  # O_APPEND: one short line per run, written whole
        fh.write(f"{ctx.task_id}\n")
