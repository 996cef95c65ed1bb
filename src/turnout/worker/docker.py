"""Running a preset's `docker_image`: whether a Docker engine answers here, and the `docker run` line.

Values of the environment are not written on the command line (`ps` would show them to every user of the
host): the line names each variable with `-e KEY` and the docker client passes the value from its own
environment. The container sees only the contract's variables and the preset's, never the worker's own.

Killing `docker run` does not stop its container, and a SIGKILLed worker cannot remove it. So each
container is labelled with its worker (`turnout.worker=<worker tag>`, see `containment.worker_tag`) and
host (`turnout.host`), and a worker that starts removes the containers of this host's workers that are
gone. A timed-out or cancelled task's container is removed by name (`remove_argv`).
"""

from __future__ import annotations

import functools
import logging
import re
import secrets
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from turnout.worker import containment

log = logging.getLogger("turnout.worker")

CONTAINER_MODELS_DIR = "/models"
WORKER_LABEL = "turnout.worker"
HOST_LABEL = "turnout.host"
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
    labels: Mapping[str, str] | None = None,
) -> list[str]:
    """`docker run --rm -i` for one process of a preset; the docker client must carry `env_keys` in its env.

    `labels` (default: `owner_labels()`) let a later worker find the container if this one dies.
    """
    argv = [docker, "run", "--rm", "-i", "--init", "--name", name]
    for key, value in sorted((owner_labels() if labels is None else labels).items()):
        argv += ["--label", f"{key}={value}"]
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


def owner_labels() -> dict[str, str]:
    """The labels that tie a container to this worker process and host."""
    return {WORKER_LABEL: containment.worker_tag(), HOST_LABEL: socket.gethostname()}


def stale_containers(
    listing: str, alive: Callable[[str], bool | None] = containment.owner_alive
) -> list[str]:
    """Ids from `docker ps --format '{{.ID}} {{.Label "turnout.worker"}}'` lines whose worker is gone."""
    out = []
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) == 2 and alive(parts[1]) is False:
            out.append(parts[0])
    return out


def remove_stale_containers(docker: str = "docker", timeout_s: float = 60.0) -> list[str]:
    """Remove the containers this host's dead workers left running; call as a worker starts, where
    `docker info` answers. Returns the ids removed; a failing engine costs a warning, never the worker."""
    listing = [docker, "ps", "-a", "--no-trunc", "--filter", f"label={HOST_LABEL}={socket.gethostname()}",
               "--format", f'{{{{.ID}}}} {{{{.Label "{WORKER_LABEL}"}}}}']  # fmt: skip
    try:
        found = subprocess.run(listing, capture_output=True, text=True, timeout=timeout_s)
        stale = stale_containers(found.stdout) if found.returncode == 0 else []
        if (
            stale
            and subprocess.run(
                [docker, "rm", "-f", *stale], capture_output=True, timeout=timeout_s
            ).returncode
        ):
            log.warning("could not remove the containers %s left by workers that died", " ".join(stale))
            return []
        if stale:
            log.info("removed %d containers left by workers of this host that died", len(stale))
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("could not look for stale containers: %s", exc)
        return []
    return stale
