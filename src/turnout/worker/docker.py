"""Running a preset's `docker_image`: whether a Docker engine answers here, and the `docker run` line.

Values of the environment are not written on the command line (`ps` would show them to every user of the
host): the line names each variable with `-e KEY` and the docker client passes the value from its own
environment. The container sees only the contract's variables and the preset's, never the worker's own.
"""

from __future__ import annotations

import functools
import re
import secrets
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

CONTAINER_MODELS_DIR = "/models"
_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_.-]+")


@functools.cache
def engine_answers(docker: str = "docker") -> bool:
    """`docker info` succeeds. Checked once per worker and cached: a preset's runtime must not flap."""
    try:
        return subprocess.run([docker, "info"], capture_output=True, timeout=15).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def container_name(model: str) -> str:
    """Unique per process, so a killed task's container can be removed by name."""
    return f"turnout-{_NAME_UNSAFE.sub('-', model)}-{secrets.token_hex(4)}"


def container_env(env: Mapping[str, str], model: str, gpu_count: int) -> dict[str, str]:
    """The contract's env as seen inside the container: the model under the read-only mount, GPUs renumbered."""
    out = dict(env)
    out["MODEL_PATH"] = f"{CONTAINER_MODELS_DIR}/{model}"
    # `--gpus` shows the container its granted GPUs as 0..n-1
    out["GPU_DEVICE"] = ",".join(str(i) for i in range(gpu_count))
    return out


def docker_argv(
    image: str,
    *,
    name: str,
    env_keys: Sequence[str],
    gpu_uuids: Sequence[str],
    models_dir: Path,
    docker: str = "docker",
) -> list[str]:
    """`docker run --rm -i` for one process of a preset; the docker client must carry `env_keys` in its env."""
    argv = [docker, "run", "--rm", "-i", "--init", "--name", name]
    if gpu_uuids:
        # docker parses --gpus as CSV: the quotes keep "device=a,b" one field (the docs' '"device=0,1"')
        argv += ["--gpus", f'"device={",".join(gpu_uuids)}"']
    for key in sorted(env_keys):
        argv += ["-e", key]
    argv += ["-v", f"{models_dir}:{CONTAINER_MODELS_DIR}:ro", image]
    return argv


def remove_argv(name: str, docker: str = "docker") -> list[str]:
    """Stops a container whose client was killed: killing `docker run` does not stop the container."""
    return [docker, "rm", "-f", name]
