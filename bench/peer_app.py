"""The Turnout apps of the peer bench: the same no-op work the Celery and Ray peers run, in equal slots.

`cpu_app` gives exactly two execution slots on a `--cpus 2` worker: the variant asks `cpu=1`, and its pool
keeps two warm handler processes (Celery's prefork -c 2, Ray's two prestarted workers on `num_cpus=2`).
`gpu_app` is the quarter-GPU case: each task holds 0.25 of a (fake) GPU and 0.25 of a core, so a worker with
`--gpus fake:2x80Gi --cpus 2` runs eight at once, as Ray does with `num_gpus=0.25, num_cpus=0.25` tasks on
`num_gpus=2, num_cpus=2`; eight warm processes serve them, as Ray's workers are reused once warm.
"""

from __future__ import annotations

from typing import Any

from turnout import Context, WorkerApplication

cpu_app = WorkerApplication("peers-cpu")
gpu_app = WorkerApplication("peers-gpu")
SLOTS = 2
QUARTER_SLOTS = 8


@cpu_app.capability("noop", cpu=1, min_processes=SLOTS, max_processes=SLOTS)
def noop(ctx: Context, data: Any) -> None:
    return None


@gpu_app.capability(
    "noop_quarter", gpu=0.25, cpu=0.25, min_processes=QUARTER_SLOTS, max_processes=QUARTER_SLOTS
)
def noop_quarter(ctx: Context, data: Any) -> dict[str, Any]:
    """Answers the GPU share it was given, so the bench can check that every task really held one."""
    return {"gpus": len(ctx.gpus)}
