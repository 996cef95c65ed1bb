"""The `docker run` line built for a preset's image. No engine runs here: the line itself is the contract."""

from __future__ import annotations

import json
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


def test_a_gpu_task_runs_the_image_with_its_granted_gpus_by_uuid(tmp_path: Path) -> None:
    argv, _ = built(GPU_KEY, tmp_path)
    line = docker_part(argv)
    assert line[:4] == ["docker", "run", "--rm", "-i"]
    assert line[line.index("--gpus") + 1] == '"device=GPU-aaa,GPU-bbb"'  # one CSV field, as docker parses it
    assert line[-1] == "loading-worker:latest"


def test_the_models_dir_is_mounted_read_only_and_model_path_points_inside(tmp_path: Path) -> None:
    argv, env = built(GPU_KEY, tmp_path)
    line = docker_part(argv)
    assert line[line.index("-v") + 1] == f"{tmp_path}:/models:ro"
    assert env["MODEL_PATH"] == "/models/llama"


def test_env_is_named_on_the_line_and_valued_only_in_the_clients_env(tmp_path: Path) -> None:
    argv, env = built(GPU_KEY, tmp_path)
    line = docker_part(argv)
    named = [line[i + 1] for i, arg in enumerate(line) if arg == "-e"]
    assert set(named) == {"MODEL_NAME", "MODEL_PATH", "GPU_DEVICE", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES",
                          "TURNOUT_TASK_ID", "PYTHONUNBUFFERED", "SECRET"}  # fmt: skip
    assert "WORKER_ONLY" not in named  # the worker's own env stays out of the container
    assert not any("s3cr3t" in arg for arg in argv)  # values never show in `ps`
    assert env["SECRET"] == "s3cr3t" and env["CUDA_VISIBLE_DEVICES"] == "GPU-aaa,GPU-bbb"
    assert env["GPU_DEVICE"] == "0,1"  # renumbered inside the container


def test_a_cpu_task_gets_no_gpus_flag_and_hides_every_gpu(tmp_path: Path) -> None:
    argv, env = built((), tmp_path)
    assert "--gpus" not in argv
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void" and env["CUDA_VISIBLE_DEVICES"] == ""


def test_each_process_gets_its_own_container_name_to_remove_it_by(tmp_path: Path) -> None:
    (preset,) = parse_presets(PRESET_DOC)
    procs = [preset_process(preset, (), None, {}, tmp_path, docker_ok=True) for _ in range(2)]
    names = [docker_part(p.argv)[docker_part(p.argv).index("--name") + 1] for p in procs]
    assert names[0] != names[1] and all(n.startswith("turnout-llama-") for n in names)
    assert procs[0].cleanup_argv == ["docker", "rm", "-f", names[0]]


def test_docker_argv_is_stable_for_a_given_input() -> None:
    argv = docker.docker_argv(
        "img", name="n", env_keys=["B", "A"], gpu_uuids=["GPU-1"], models_dir=Path("/m")
    )
    assert argv == ["docker", "run", "--rm", "-i", "--init", "--name", "n", "--gpus", '"device=GPU-1"',
                    "-e", "A", "-e", "B", "-v", "/m:/models:ro", "img"]  # fmt: skip
    assert json.dumps(argv)  # plain strings only


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
