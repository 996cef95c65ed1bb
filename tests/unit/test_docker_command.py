"""The `docker run` line built for a preset's image. No engine runs here: the line itself is the contract."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from turnout.worker import docker
from turnout.worker.presets import parse_presets, preset_process

PRESET_DOC = {
    "models": {
        "llama": {
            "inference": {
                "docker_image": "loading-worker:latest",
                "env_vars": {"SECRET": "s3cr3t"},
                "resources": {"gpu": 2},
            }
        }
    }
}
GPU_KEY = ("GPU-aaa,GPU-bbb", "1,3", "", "")


def built(key: tuple[str, ...], tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    (preset,) = parse_presets(PRESET_DOC)
    proc = preset_process(
        preset, key, "task-1", {"PATH": "/usr/bin", "WORKER_ONLY": "x"}, tmp_path, docker_ok=True
    )
    return proc.argv, proc.env


def docker_part(argv: list[str]) -> list[str]:
    """The guard wraps the docker client: `python -m turnout.worker.guard docker run ...`."""
    return argv[argv.index("docker") :]


# `docker run` options the line may carry that take a value; `--label` is for bookkeeping labels.
VALUED = {"--name", "--gpus", "-e", "-v", "--label"}
NAME = re.compile(r"turnout-llama-[0-9a-f]{8}")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # a name alone: `-e KEY=value` would show the value in `ps`


@dataclass(frozen=True)
class DockerRun:
    """A `docker run` line taken apart: bare flags, each valued option's values in order, image and command."""

    flags: list[str]
    options: dict[str, list[str]]
    image: str
    command: list[str]


def parsed(line: list[str]) -> DockerRun:
    assert line[:2] == ["docker", "run"], line
    flags: list[str] = []
    options: dict[str, list[str]] = {}
    rest = line[2:]
    while rest and rest[0].startswith("-"):
        arg = rest.pop(0)
        if arg.startswith("--") and "=" in arg:  # --label=k=v is the same option as --label k=v
            key, _, val = arg.partition("=")
            options.setdefault(key, []).append(val)
        elif arg in VALUED:
            options.setdefault(arg, []).append(rest.pop(0))
        else:
            flags.append(arg)
    assert rest, f"no image on {line}"
    return DockerRun(flags, options, rest[0], rest[1:])


def assert_only_bookkeeping_labels(run: DockerRun) -> None:
    """Labels may be added (e.g. `turnout.worker=...`); they must stay in turnout's namespace and carry no env."""
    assert set(run.options) <= VALUED, run.options
    assert all(label.startswith("turnout.") and "=" in label for label in run.options.get("--label", []))


def test_a_gpu_task_runs_the_image_with_its_granted_gpus_by_uuid(tmp_path: Path) -> None:
    argv, _ = built(GPU_KEY, tmp_path)
    run = parsed(docker_part(argv))
    assert sorted(run.flags) == ["--init", "--rm", "-i"]  # removed on exit, stdin kept open, an init reaps
    assert run.options["--gpus"] == ['"device=GPU-aaa,GPU-bbb"']  # one CSV field, as docker parses it
    assert (run.image, run.command) == ("loading-worker:latest", [])  # the image's own entrypoint runs
    assert_only_bookkeeping_labels(run)


def test_the_models_dir_is_mounted_read_only_and_model_path_points_inside(tmp_path: Path) -> None:
    argv, env = built(GPU_KEY, tmp_path)
    assert parsed(docker_part(argv)).options["-v"] == [f"{tmp_path}:/models:ro"]  # the only mount
    assert env["MODEL_PATH"] == "/models/llama"


def test_env_is_named_on_the_line_and_valued_only_in_the_clients_env(tmp_path: Path) -> None:
    argv, env = built(GPU_KEY, tmp_path)
    named = parsed(docker_part(argv)).options["-e"]
    assert named == sorted({"MODEL_NAME", "MODEL_PATH", "GPU_DEVICE", "CUDA_VISIBLE_DEVICES",
                            "NVIDIA_VISIBLE_DEVICES", "TURNOUT_TASK_ID", "PYTHONUNBUFFERED", "SECRET"})  # fmt: skip
    assert all(ENV_NAME.fullmatch(key) for key in named)  # names alone, never KEY=value
    assert not any("s3cr3t" in arg for arg in argv)  # values never show in `ps`
    assert env["SECRET"] == "s3cr3t" and env["CUDA_VISIBLE_DEVICES"] == "GPU-aaa,GPU-bbb"
    assert all(key in env for key in named)  # the client has a value for every name it passes on
    assert env["GPU_DEVICE"] == "0,1"  # renumbered inside the container
    assert (
        "WORKER_ONLY" in env and "WORKER_ONLY" not in named
    )  # the worker's own env stays out of the container


def test_a_cpu_task_gets_no_gpus_flag_and_hides_every_gpu(tmp_path: Path) -> None:
    argv, env = built((), tmp_path)
    run = parsed(docker_part(argv))
    assert "--gpus" not in run.options and run.image == "loading-worker:latest"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void" and env["CUDA_VISIBLE_DEVICES"] == ""


def test_each_process_gets_its_own_container_name_to_remove_it_by(tmp_path: Path) -> None:
    (preset,) = parse_presets(PRESET_DOC)
    procs = [preset_process(preset, (), None, {}, tmp_path, docker_ok=True) for _ in range(2)]
    names = [parsed(docker_part(p.argv)).options["--name"] for p in procs]
    assert all(len(n) == 1 and NAME.fullmatch(n[0]) for n in names), names
    assert names[0] != names[1]
    assert procs[0].cleanup_argv == ["docker", "rm", "-f", names[0][0]]


def test_docker_argv_holds_exactly_what_it_was_given_in_a_stable_order() -> None:
    def line(env_keys: list[str]) -> list[str]:
        return docker.docker_argv("img", name="n", env_keys=env_keys, gpu_uuids=["GPU-1", "GPU-2"],
                                  models_dir=Path("/m"), docker="/usr/bin/docker")  # fmt: skip

    argv = line(["B", "A"])
    assert argv[0] == "/usr/bin/docker" and all(
        type(arg) is str for arg in argv
    )  # no Path or None reaches exec
    run = parsed(["docker", *argv[1:]])
    assert sorted(run.flags) == ["--init", "--rm", "-i"]
    assert (run.options["--name"], run.options["--gpus"], run.options["-e"], run.options["-v"]) == (
        ["n"], ['"device=GPU-1,GPU-2"'], ["A", "B"], ["/m:/models:ro"])  # fmt: skip
    assert (run.image, run.command) == ("img", [])
    assert_only_bookkeeping_labels(run)
    assert line(["A", "B"]) == argv  # the order env names were given in does not change the line


def test_an_engine_that_does_not_answer_is_reported_as_absent(tmp_path: Path) -> None:
    fake = tmp_path / "docker"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    assert docker.engine_answers(str(fake)) is False
    assert docker.engine_answers(str(tmp_path / "missing")) is False
    ok = tmp_path / "docker-ok"
    ok.write_text("#!/bin/sh\nexit 0\n")
    ok.chmod(0o755)
    assert docker.engine_answers(str(ok)) is True
