"""Handlers for `bench.gpu_check`: what a task's process really gets of a real NVIDIA GPU.

Each handler imports torch inside its call (no `setup`), as many users' handlers do: the runner must hand a
shared task's memory share to torch even then.
"""

from __future__ import annotations

import math
import os
from typing import Any

from turnout import Context, WorkerApplication

app = WorkerApplication("gpu-check")
SHARE = "4Gi"


@app.capability("cuda_probe", gpu=1, cpu=1)
def cuda_probe(ctx: Context, data: Any) -> dict[str, Any]:
    """An exclusive GPU: which devices the process sees, and a matrix product on the one it holds."""
    import torch

    x = torch.randn(2048, 2048, device="cuda")
    total = float((x @ x).sum().item())
    return {"device_count": torch.cuda.device_count(), "name": torch.cuda.get_device_name(0),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "ctx_device": ctx.device, "gpus": ctx.gpus,
            "finite": math.isfinite(total)}  # fmt: skip


@app.capability("cuda_share", gpu_memory=SHARE, cpu=1)
def cuda_share(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    """A share of a GPU: allocate `gib` GiB; more than the share must fail `gpu_oom`, not take the GPU."""
    import torch

    block = torch.empty(int(float(data["gib"]) * 2**30), dtype=torch.uint8, device="cuda")
    block.fill_(1)
    torch.cuda.synchronize()
    return {"allocated_bytes": int(block.numel()), "fraction": os.environ.get("TURNOUT_GPU_MEMORY_FRACTION"),
            "limit": os.environ.get("TURNOUT_GPU_MEMORY_LIMIT"), "peak": int(torch.cuda.max_memory_allocated())}  # fmt: skip
