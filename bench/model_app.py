"""The demo's classify_text handler under the pool and batch settings the pipeline bench compares.

Each model capability has a CPU and a GPU variant of one definition: `gpu: never` (the default bench, on this
CPU) runs the first, `gpu: require` (`--gpu`, on a host with a real NVIDIA GPU) the second, on `cuda`.
"""

from __future__ import annotations

from typing import Any

from turnout import Context, WorkerApplication
from turnout.demo import _classify, load_sentiment_model

app = WorkerApplication("bench-model")
# the CPU variant, and a share of a GPU (the runner hands torch its memory fraction)
DEVICES: tuple[dict[str, Any], ...] = ({"cpu": 1}, {"gpu_memory": "4Gi", "cpu": 1})


def _one(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    return _classify(ctx, [data])[0]


def _many(ctx: Context, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return _classify(ctx, items)


for device in DEVICES:
    app.capability("classify_warm", max_processes=1, setup=load_sentiment_model, **device)(_one)
    app.capability("classify_cold", max_processes=1, idle_timeout_s=0, setup=load_sentiment_model,
                   **device)(_one)  # fmt: skip
    app.capability("classify_batched", max_processes=1, max_batch_size=32, max_batch_wait_ms=50,
                   setup=load_sentiment_model, **device)(_many)  # fmt: skip


@app.capability("noop", cpu=0.1)
def noop(ctx: Context, data: Any) -> dict[str, Any]:
    return {}
