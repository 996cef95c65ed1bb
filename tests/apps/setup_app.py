"""A worker app whose one variant's setup always fails (a model file missing, say), beside one that works."""

from __future__ import annotations

import os
from typing import Any

from turnout import Context, WorkerApplication

app = WorkerApplication("setup-tests")


def _missing_model(device: str) -> None:
    raise FileNotFoundError(f"no weights at /models/absent.bin for {device}")


@app.capability("unloadable", cpu=0.5, setup=_missing_model)
def unloadable(ctx: Context, data: Any) -> dict[str, Any]:
    return {"ran": True}  # never: its process fails before it serves


@app.capability("fine", cpu=0.5)
def fine(ctx: Context, data: Any) -> dict[str, Any]:
    return {"pid": os.getpid()}
