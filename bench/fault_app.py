"""The worker app of the fault bench: a task that sleeps and logs when each run starts and ends.

The log (one `start|end TASK_ID PID EPOCH_S` line per event, appended with O_APPEND) is the ground truth
for "ran exactly once": a run that was killed has a start and no end.
"""

from __future__ import annotations

import time
from typing import Any

from bench.common import log_run
from turnout import Context, WorkerApplication

app = WorkerApplication("fault-bench")


@app.capability("sleep", cpu=1)
def sleep(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    log_run(data["log"], "start", ctx.task_id)
    time.sleep(float(data["seconds"]))
    log_run(data["log"], "end", ctx.task_id)
    return {"n": data.get("n")}


@app.capability("sleep", gpu_memory="4Gi", cpu=1)
def sleep_gpu(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    """The GPU variant: the same work, holding a 4 GiB share of a GPU while it runs."""
    return sleep(ctx, data)
