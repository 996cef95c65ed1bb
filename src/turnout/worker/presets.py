"""Model presets: a YAML file whose models a worker serves as capabilities, run as commands or containers.

    models:
      llama:
        inference:
          command: ["python", "/app/worker.py"]   # or a string, split like a shell would
          docker_image: "loading-worker:latest"   # used where a Docker engine answers
          env_vars: {QUANT: "q4"}
          resources: {gpu: 1, gpu_memory: 8Gi}   # no gpu key: a CPU variant
          mode: one-off                           # or session: one warm process serves many tasks
          timeout_s: 600                          # for tasks that set no timeout
          min_processes: 0                        # session mode: warm processes kept
          max_processes: 2                        # session mode: at most this many (default: as tasks need)
          idle_timeout_s: 60                      # session mode: idle processes above the minimum exit
          isolation: sandbox                      # or none; default: the worker's --isolation
          network: false                          # a sandbox has no network unless this is true

The file is validated whole before anything starts; each error names the key (`models.llama.inference.
resources.gpu_memory: ...`) and the file. The program gets the task's input as one JSON line on stdin
and the contract's env (DESIGN.md, "Command workers and model presets"); it runs under `guard.py`, so its
whole process tree dies with the worker. With `isolation: sandbox` it runs in bubblewrap (`sandboxed.py`);
where no bubblewrap works, its tasks fail with `sandbox_unavailable`: it never runs unsandboxed instead.
"""

from __future__ import annotations

import enum
import json
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from turnout.errors import InvalidInput, number, read_user_file
from turnout.files import with_paths
from turnout.models import Device, Variant, check_capability_name
from turnout.resources import parse_resources
from turnout.worker import docker
from turnout.worker.guard import guarded_argv
from turnout.worker.limits import Limits
from turnout.worker.pools import OneOffPool, ProcessPool, Runnable
from turnout.worker.processes import ProtocolProcess, RefusedProcess
from turnout.worker.sandbox import ENV_KEPT, Isolation, find_bwrap
from turnout.worker.sandboxed import SandboxedProcess, SandboxHost, SandboxOptions, sandbox_host
from turnout.worker.visibility import gpu_env

DEFAULT_MODELS_DIR = Path("~/.turnout/models")
INFERENCE_KEYS = ("command", "docker_image", "env_vars", "resources", "mode", "timeout_s", "min_processes",
                  "max_processes", "idle_timeout_s", "isolation", "network")  # fmt: skip
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class Mode(str, enum.Enum):
    ONE_OFF = "one-off"  # a fresh process per task: nothing leaks from one task to the next
    SESSION = "session"  # one process serves many tasks and keeps its model loaded


@dataclass(frozen=True)
class Preset:
    name: str
    variant: Variant
    command: tuple[str, ...] | None
    docker_image: str | None
    env_vars: tuple[tuple[str, str], ...]
    mode: Mode
    timeout_s: float | None
    min_processes: int = 0
    idle_timeout_s: float = 60.0
    isolation: Isolation | None = None  # None: the worker's default
    network: bool | None = None  # None: not said (a sandbox then has none)
    max_processes: int | None = None  # session mode: the pool's cap (None: as tasks need)


# ---- parsing ---------------------------------------------------------------------------------------


def load_presets(path: Path) -> list[Preset]:
    """Read and validate a presets file; every error is `InvalidInput` naming the key and the file."""
    text = read_user_file(path, "--presets")
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidInput(f"presets file {path}: not valid YAML ({exc})", field="presets") from None
    try:
        return parse_presets(doc)
    except InvalidInput as exc:
        raise InvalidInput(f"{exc.message} (in {path})", field=exc.field) from None


def parse_presets(doc: Any) -> list[Preset]:
    """The models that have an `inference` section; others (e.g. only `training`) are not served here."""
    if not isinstance(doc, dict) or not isinstance(doc.get("models"), dict) or not doc["models"]:
        raise _bad("models", "expected a mapping of model names to their sections")
    presets = []
    for name, sections in doc["models"].items():
        check_capability_name(name, f"models.{name}")
        if not isinstance(sections, dict):
            raise _bad(f"models.{name}", "expected a mapping of sections (inference: ...)")
        if "inference" in sections:
            presets.append(_parse_inference(name, sections["inference"], f"models.{name}.inference"))
    if not presets:
        raise _bad("models", "no model has an inference section, so there is nothing to serve")
    return presets


def _parse_inference(name: str, spec: Any, at: str) -> Preset:
    if not isinstance(spec, dict):
        raise _bad(at, "expected a mapping (command, docker_image, resources, ...)")
    unknown = sorted(set(spec) - set(INFERENCE_KEYS))
    if unknown:
        raise _bad(f"{at}.{unknown[0]}", f"unknown key (known: {', '.join(INFERENCE_KEYS)})")
    command = _command(spec.get("command"), f"{at}.command")
    image = spec.get("docker_image")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        raise _bad(f"{at}.docker_image", f"expected an image name, got {image!r}")
    if command is None and image is None:
        raise _bad(at, "needs a command, a docker_image, or both")
    resources = parse_resources(spec.get("resources"), f"{at}.resources")
    mode_text = spec.get("mode", Mode.ONE_OFF.value)
    if mode_text not in {m.value for m in Mode}:
        raise _bad(f"{at}.mode", f"expected one-off or session, got {mode_text!r}")
    mode = Mode(mode_text)
    timeout_s = (
        _number(spec.get("timeout_s"), f"{at}.timeout_s") if spec.get("timeout_s") is not None else None
    )
    min_processes = spec.get("min_processes", 0)
    if isinstance(min_processes, bool) or not isinstance(min_processes, int) or min_processes < 0:
        raise _bad(f"{at}.min_processes", f"expected a whole number >= 0, got {min_processes!r}")
    if min_processes and mode is Mode.ONE_OFF:
        raise _bad(f"{at}.min_processes", "only a session keeps warm processes; one-off starts one per task")
    idle_timeout_s = _number(spec.get("idle_timeout_s", 60.0), f"{at}.idle_timeout_s")
    max_processes = spec.get("max_processes")
    if max_processes is not None and (isinstance(max_processes, bool) or not isinstance(max_processes, int)
                                      or max_processes < max(1, min_processes)):  # fmt: skip
        raise _bad(
            f"{at}.max_processes", f"expected a whole number >= max(1, min_processes), got {max_processes!r}"
        )
    if max_processes is not None and mode is Mode.ONE_OFF:
        raise _bad(f"{at}.max_processes", "only a session keeps a pool; one-off starts one process per task")
    isolation = spec.get("isolation")
    if isolation is not None and isolation not in {i.value for i in Isolation}:
        raise _bad(f"{at}.isolation", f"expected none or sandbox, got {isolation!r}")
    network = spec.get("network")
    if network is not None and not isinstance(network, bool):
        raise _bad(f"{at}.network", f"expected true or false, got {network!r}")
    if network is False and isolation == Isolation.NONE.value:
        raise _bad(f"{at}.network", "only a sandbox can take the network away: set isolation: sandbox")
    device = Device.GPU if resources.wants_gpu else Device.CPU
    return Preset(name, Variant(name, device, resources), command, image, _env_vars(spec.get("env_vars"), f"{at}.env_vars"),
                  mode, timeout_s, min_processes, idle_timeout_s, Isolation(isolation) if isolation else None,
                  network, max_processes)  # fmt: skip


def _command(value: Any, at: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    try:
        argv = shlex.split(value) if isinstance(value, str) else value
    except ValueError as exc:
        raise _bad(at, f"cannot split {value!r} ({exc})") from None
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) and a for a in argv):
        raise _bad(at, f"expected a non-empty list of strings (or one string), got {value!r}")
    return tuple(argv)


def _env_vars(value: Any, at: str) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise _bad(at, f"expected a mapping of names to values, got {value!r}")
    out = []
    for key, val in value.items():
        if not isinstance(key, str) or not _ENV_NAME.match(key):
            raise _bad(f"{at}.{key}", "not an environment variable name")
        if val is None or isinstance(val, dict | list):
            raise _bad(f"{at}.{key}", f"expected a string or a number, got {val!r}")
        out.append((key, json.dumps(val) if isinstance(val, bool) else str(val)))
    return tuple(out)


def _number(value: Any, at: str) -> float:
    return number(value, at, "a number of seconds > 0", lambda v: v > 0)


def _bad(at: str, why: str) -> InvalidInput:
    return InvalidInput(f"{at}: {why}", field=at)


# ---- running ---------------------------------------------------------------------------------------


def preset_runnables(
    path: Path,
    base_env: dict[str, str],
    *,
    models_dir: Path | None = None,
    engine_answers: Callable[[], bool] = docker.engine_answers,
    sandbox: SandboxOptions | None = None,
) -> list[Runnable]:
    """One Runnable per preset: a pool of guarded commands or containers speaking the event protocol."""
    root = Path(models_dir or DEFAULT_MODELS_DIR).expanduser()
    options = sandbox or SandboxOptions()
    presets = load_presets(path)
    for p in presets:
        if p.network is False and (p.isolation or options.default) is Isolation.NONE:
            raise InvalidInput(f"models.{p.name}.inference.network: only a sandbox can take the network away, and "
                               f"this worker's isolation is none: set isolation: sandbox (in {path})",
                               field=f"models.{p.name}.inference.network")  # fmt: skip
    docker_ok = any(p.docker_image for p in presets) and engine_answers()  # asked once, before serving
    if docker_ok:
        docker.remove_stale_containers()  # what this host's dead workers left running
    host: SandboxHost | str | None = None
    if any((p.isolation or options.default) is Isolation.SANDBOX for p in presets):
        found = find_bwrap()  # probed once, before serving: a sandbox that cannot start fails its tasks
        host = found if isinstance(found, str) else sandbox_host(options, found)
    return [_runnable(p, base_env, root, docker_ok, options, host) for p in presets]


def _runnable(preset: Preset, base_env: dict[str, str], models_dir: Path, docker_ok: bool,
              options: SandboxOptions, host: SandboxHost | str | None) -> Runnable:  # fmt: skip
    sandboxed = (preset.isolation or options.default) is Isolation.SANDBOX

    def launch(key: tuple[str, ...], task_id: str | None) -> ProtocolProcess:
        return preset_process(
            preset, key, task_id, base_env, models_dir, docker_ok, host if sandboxed else None
        )

    pool: ProcessPool
    if preset.mode is Mode.ONE_OFF:
        pool = OneOffPool(launch)
    else:
        pool = ProcessPool(lambda key: launch(key, None), min_processes=preset.min_processes,
                           idle_timeout_s=preset.idle_timeout_s, max_processes=preset.max_processes)  # fmt: skip
    return Runnable(preset.variant, pool, raw_input_line)


def raw_input_line(lease: dict[str, Any]) -> str:
    """A command worker reads the task's input itself, not turnout's envelope; each file reference in it
    carries the file's local path (`{"$file": ID, "path": ...}`)."""
    files = lease.get("files")
    return json.dumps(with_paths(lease.get("input"), files) if files else lease.get("input"))


def child_env(preset: Preset, key: tuple[str, ...], task_id: str | None, models_dir: Path) -> dict[str, str]:
    """The contract's env; the GPU variables come last, so a preset cannot widen what its process sees."""
    env = {"MODEL_NAME": preset.name, "MODEL_PATH": str(models_dir / preset.name), "PYTHONUNBUFFERED": "1",
           **dict(preset.env_vars), **gpu_env(key)}  # fmt: skip
    if task_id:
        env["TURNOUT_TASK_ID"] = task_id
    return env


def preset_process(
    preset: Preset,
    key: tuple[str, ...],
    task_id: str | None,
    base_env: Mapping[str, str],
    models_dir: Path,
    docker_ok: bool,
    sandbox: SandboxHost | str | None = None,
) -> ProtocolProcess:
    """The process for one task (one-off) or many (session): a container where an engine answers, else the command.

    `sandbox`: run the command in bubblewrap on this host, or (a string) why that cannot be done here.
    """
    env = child_env(preset, key, task_id, models_dir)
    options: dict[str, Any] = {"lifeline_arg": True, "default_timeout_s": preset.timeout_s,
                               "one_task": preset.mode is Mode.ONE_OFF}  # fmt: skip
    if preset.docker_image and (docker_ok or preset.command is None):
        if not docker_ok:
            return RefusedProcess({"type": "docker_unavailable",
                                   "message": f"model {preset.name!r} runs only as the Docker image {preset.docker_image!r}, "
                                              "but no Docker engine answers on this worker (`docker info` failed) "
                                              "and its preset has no command"})  # fmt: skip
        uuids = [u for u in (key[0].split(",") if key else []) if u]
        inside = docker.container_env(env, preset.name, len(uuids))
        name = docker.container_name(preset.name)
        argv = docker.docker_argv(preset.docker_image, name=name, env_keys=list(inside), gpu_uuids=uuids,
                                  models_dir=models_dir)  # fmt: skip
        proc = ProtocolProcess(
            guarded_argv(argv), {**base_env, **inside}, cleanup_argv=docker.remove_argv(name), **options
        )
        proc.isolation = {"mode": "docker", "image": preset.docker_image}
        return proc
    command = list(preset.command or ())  # parse_presets guarantees a command where there is no image
    if isinstance(sandbox, str):
        return RefusedProcess({"type": "sandbox_unavailable",
                               "message": f"model {preset.name!r} must run sandboxed (isolation: sandbox), but no "
                                          f"sandbox can start on this worker: {sandbox}"})  # fmt: skip
    if sandbox is not None:
        res = preset.variant.resources
        indices = [int(i) for i in (key[1].split(",") if len(key) > 1 and key[1] else [])]
        kept = {k: base_env[k] for k in ENV_KEPT if k in base_env}
        return SandboxedProcess(sandbox, command, {**kept, **env}, gpu_indices=indices,
                                network=bool(preset.network), limits=Limits(res.memory_bytes, res.cpu),
                                read_only=[str(models_dir / preset.name)], **options)  # fmt: skip
    proc = ProtocolProcess(guarded_argv(command), {**base_env, **env}, **options)
    proc.isolation = {"mode": Isolation.NONE.value}
    return proc
