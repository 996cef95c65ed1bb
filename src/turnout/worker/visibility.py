"""What a task's process is allowed to see of the GPUs: the environment that pins it to its grant.

`CUDA_VISIBLE_DEVICES=""` hides every GPU (a CPU task must not grab one by accident); unset would show all.
"""

from __future__ import annotations


def gpu_env(key: tuple[str, ...]) -> dict[str, str]:
    """Env for a process started for `key` = (uuids, indices, shared memory limit, unit memory) or ()."""
    if not key:
        return {"CUDA_VISIBLE_DEVICES": "", "NVIDIA_VISIBLE_DEVICES": "void", "GPU_DEVICE": ""}
    uuids, indices, limit, unit_memory = [*key, "", "", "", ""][:4]
    env = {"CUDA_VISIBLE_DEVICES": uuids, "NVIDIA_VISIBLE_DEVICES": uuids, "GPU_DEVICE": indices}
    if limit:
        env["TURNOUT_GPU_MEMORY_LIMIT"] = limit
        if unit_memory:
            env["TURNOUT_GPU_MEMORY_FRACTION"] = f"{int(limit) / int(unit_memory):.6f}"
    return env
