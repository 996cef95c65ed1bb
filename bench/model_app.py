"""The demo's classify_text handler under the pool and batch settings the pipeline bench compares."""

from __future__ import annotations

from typing import Any

from turnout import Context, WorkerApplication
from turnout.demo import _classify, load_sentiment_model

app = WorkerApplication("bench-model")


@app.capability("classify_warm", cpu=1, max_processes=1, setup=load_sentiment_model)
def classify_warm(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    return _classify(ctx, [data])[0]


@app.capability("classify_cold", cpu=1, max_processes=1, idle_timeout_s=0, setup=load_sentiment_model)
def classify_cold(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    return _classify(ctx, [data])[0]


@app.capability("classify_batched", cpu=1, max_processes=1, max_batch_size=32, max_batch_wait_ms=50,
                setup=load_sentiment_model)  # fmt: skip
def classify_batched(ctx: Context, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return _classify(ctx, items)


@app.capability("noop", cpu=0.1)
def noop(ctx: Context, data: Any) -> dict[str, Any]:
    return {}
