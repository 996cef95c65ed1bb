"""Preset files: every error names the model, the key and the file; valid ones become runnable variants."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from turnout.errors import InvalidInput
from turnout.models import Device
from turnout.worker import presets as presets_module
from turnout.worker.pools import OneOffPool, ProcessPool
from turnout.worker.presets import Mode, child_env, load_presets, parse_presets, preset_runnables
from turnout.worker.processes import RefusedProcess
from turnout.worker.sandbox import Isolation

GOOD = {
    "models": {
        "llama": {
            "inference": {
                "command": ["python", "/app/worker.py"],
                "docker_image": "loading-worker:latest",
                "env_vars": {"QUANT": "q4", "BATCH": 8, "FAST": True},
                "resources": {"gpu": 1, "gpu_memory": "8Gi"},
                "mode": "session",
                "timeout_s": 600,
            }
        },
        "tiny": {"inference": {"command": "python tiny.py --fast"}},
        "trainer": {"training": {"command": ["train"]}},
    }
}


def with_inference(**changes: Any) -> dict[str, Any]:
    spec = {"command": ["python", "w.py"], **changes}
    return {"models": {"llama": {"inference": {k: v for k, v in spec.items() if v is not None}}}}


def test_a_valid_file_serves_each_model_with_an_inference_section_as_a_capability() -> None:
    llama, tiny = parse_presets(GOOD)
    assert (llama.name, llama.variant.device, llama.mode, llama.timeout_s) == (
        "llama",
        Device.GPU,
        Mode.SESSION,
        600.0,
    )
    assert llama.variant.resources.gpu == 1 and llama.variant.resources.gpu_memory_bytes == 8 * 2**30
    assert dict(llama.env_vars) == {"QUANT": "q4", "BATCH": "8", "FAST": "true"}
    assert (tiny.variant.device, tiny.mode, tiny.command) == (
        Device.CPU,
        Mode.ONE_OFF,
        ("python", "tiny.py", "--fast"),
    )


@pytest.mark.parametrize(
    ("doc", "key"),
    [
        (
            with_inference(resources={"gpu": 1, "gpu_memory": "lots"}),
            "models.llama.inference.resources.gpu_memory",
        ),
        (with_inference(resources={"gpus": 1}), "models.llama.inference.resources.gpus"),
        (with_inference(mode="forever"), "models.llama.inference.mode"),
        (with_inference(timeout_s=-1), "models.llama.inference.timeout_s"),
        (with_inference(timeout_s="10m"), "models.llama.inference.timeout_s"),
        (with_inference(command=[]), "models.llama.inference.command"),
        (with_inference(command=["ok", 3]), "models.llama.inference.command"),
        (with_inference(command=None), "models.llama.inference"),
        (with_inference(docker_image=""), "models.llama.inference.docker_image"),
        (with_inference(env_vars={"BAD-NAME": "x"}), "models.llama.inference.env_vars.BAD-NAME"),
        (with_inference(env_vars={"NESTED": {"a": 1}}), "models.llama.inference.env_vars.NESTED"),
        (with_inference(min_processes=2), "models.llama.inference.min_processes"),
        (with_inference(comand=["typo"]), "models.llama.inference.comand"),
        (with_inference(isolation="jail"), "models.llama.inference.isolation"),
        (with_inference(isolation=True), "models.llama.inference.isolation"),
        (with_inference(network="no"), "models.llama.inference.network"),
        (with_inference(isolation="none", network=False), "models.llama.inference.network"),
        ({"models": {"llama": {"inference": ["python"]}}}, "models.llama.inference"),
        ({"models": {"Llama!": {"inference": {"command": ["x"]}}}}, "models.Llama!"),
        ({"models": {"trainer": {"training": {}}}}, "models"),
        ({"model": {}}, "models"),
    ],
)
def test_an_invalid_preset_names_the_model_and_the_key(doc: dict[str, Any], key: str) -> None:
    with pytest.raises(InvalidInput) as err:
        parse_presets(doc)
    assert err.value.field == key
    assert err.value.message.startswith(f"{key}: ")


def test_an_error_from_a_file_also_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "presets.yaml"
    path.write_text(
        "models:\n  llama:\n    inference:\n      command: [python]\n      resources: {gpu_memory: -3}\n"
    )
    with pytest.raises(InvalidInput) as err:
        load_presets(path)
    assert err.value.message.startswith("models.llama.inference.resources.gpu_memory: ")
    assert str(path) in err.value.message


@pytest.mark.parametrize("text", ["models: [unclosed", ""])
def test_a_file_that_is_not_yaml_or_is_empty_is_refused_with_its_name(tmp_path: Path, text: str) -> None:
    path = tmp_path / "presets.yaml"
    path.write_text(text)
    with pytest.raises(InvalidInput) as err:
        load_presets(path)
    assert str(path) in err.value.message


def test_a_missing_file_is_refused_with_its_name(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match=r"nope\.yaml"):
        load_presets(tmp_path / "nope.yaml")


def test_env_pins_gpus_after_env_vars_so_a_preset_cannot_widen_what_it_sees(tmp_path: Path) -> None:
    (preset,) = parse_presets(with_inference(env_vars={"CUDA_VISIBLE_DEVICES": "all", "MODEL_NAME": "alias"}))
    env = child_env(preset, ("GPU-a", "2", "", ""), "t-1", tmp_path)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-a" and env["GPU_DEVICE"] == "2"
    assert env["MODEL_NAME"] == "alias"  # a preset may rename its model
    assert env["MODEL_PATH"] == str(tmp_path / "llama") and env["TURNOUT_TASK_ID"] == "t-1"
    assert "TURNOUT_TASK_ID" not in child_env(preset, (), None, tmp_path)


def write(tmp_path: Path, doc: dict[str, Any]) -> Path:
    path = tmp_path / "presets.yaml"
    path.write_text(json.dumps(doc))
    return path


def test_one_off_presets_get_a_fresh_process_per_task_and_sessions_a_warm_pool(tmp_path: Path) -> None:
    runnables = preset_runnables(write(tmp_path, GOOD), {}, models_dir=tmp_path, engine_answers=lambda: False)
    pools = {r.variant.capability: r.pool for r in runnables}
    assert isinstance(pools["tiny"], OneOffPool)
    assert type(pools["llama"]) is ProcessPool
    assert runnables[0].task_line({"id": "t", "input": {"text": "hi"}}) == '{"text": "hi"}'


def test_the_image_is_used_where_an_engine_answers_and_the_command_elsewhere(tmp_path: Path) -> None:
    (with_engine,) = preset_runnables(
        write(tmp_path, with_inference(docker_image="img:1")), {}, engine_answers=lambda: True
    )
    (without,) = preset_runnables(
        write(tmp_path, with_inference(docker_image="img:1")), {}, engine_answers=lambda: False
    )
    docker_proc = with_engine.pool.factory(())
    assert docker_proc.argv[3:6] == ["docker", "run", "--rm"] and "img:1" in docker_proc.argv
    assert docker_proc.cleanup_argv[:3] == ["docker", "rm", "-f"]
    assert without.pool.factory(()).argv[3:] == ["python", "w.py"]  # under the guard


def test_the_engine_is_not_asked_when_no_preset_has_an_image(tmp_path: Path) -> None:
    def engine() -> bool:
        raise AssertionError("docker info must not run")

    preset_runnables(write(tmp_path, with_inference()), {}, engine_answers=engine)


def test_an_image_only_preset_without_an_engine_fails_its_tasks_not_the_worker(tmp_path: Path) -> None:
    doc = {"models": {"llama": {"inference": {"docker_image": "img:1"}}}}
    (runnable,) = preset_runnables(write(tmp_path, doc), {}, engine_answers=lambda: False)

    async def one_task() -> Any:
        proc = await runnable.pool.acquire((), "t-1")
        assert isinstance(proc, RefusedProcess)
        return await proc.run("{}", lambda e: None, None)

    outcome = asyncio.run(one_task())
    assert not outcome.succeeded
    assert outcome.error["type"] == "docker_unavailable"
    assert "img:1" in outcome.error["message"] and "docker info" in outcome.error["message"]


def test_a_one_off_process_reads_its_input_to_eof_and_a_missing_command_fails_clearly(tmp_path: Path) -> None:
    script = tmp_path / "cat.py"
    script.write_text(
        "import json, sys\n"
        "data = json.load(sys.stdin)\n"  # reads to EOF: stdin closes after the one line
        "print(json.dumps({'event': 'result', 'data': data}))\n"
        "print(json.dumps({'event': 'finish', 'status': 'completed'}))\n"
    )
    doc = {"models": {"cat": {"inference": {"command": [sys.executable, str(script)]}},
                      "ghost": {"inference": {"command": ["/no/such/program"]}}}}  # fmt: skip
    cat, ghost = preset_runnables(
        write(tmp_path, doc), {"PATH": "/usr/bin:/bin"}, engine_answers=lambda: False
    )

    async def one(runnable: Any, data: Any) -> Any:
        proc = await runnable.pool.acquire((), "t-1")
        try:
            return await proc.run(runnable.task_line({"input": data}), lambda e: None, 10)
        finally:
            runnable.pool.release(proc, (), True)
            await proc.close()

    assert asyncio.run(one(cat, {"a": [1, 2]})).output == {"a": [1, 2]}
    failed = asyncio.run(one(ghost, {}))
    assert failed.error["exit_code"] == 127 and "/no/such/program" in failed.error["message"]


def test_isolation_and_network_are_read_and_unsaid_ones_stay_unset() -> None:
    sandboxed = parse_presets(with_inference(isolation="sandbox", network=True))[0]
    unsaid = parse_presets(with_inference())[0]
    assert (sandboxed.isolation, sandboxed.network) == (Isolation.SANDBOX, True)
    assert (unsaid.isolation, unsaid.network) == (None, None)


def test_a_preset_that_cuts_the_network_on_a_worker_without_sandbox_is_refused_naming_key_and_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "presets.yaml"
    path.write_text(json.dumps(with_inference(network=False)))
    with pytest.raises(InvalidInput) as err:
        preset_runnables(path, {}, engine_answers=lambda: False)
    assert err.value.field == "models.llama.inference.network"
    assert str(path) in err.value.message


def test_a_sandboxed_preset_where_no_sandbox_can_start_fails_its_tasks_instead_of_running_unsandboxed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(presets_module, "find_bwrap", lambda: "no bubblewrap here (test)")
    path = tmp_path / "presets.yaml"
    path.write_text(json.dumps(with_inference(isolation="sandbox")))
    (runnable,) = preset_runnables(path, {}, engine_answers=lambda: False)

    async def run_one() -> Any:
        proc = await runnable.pool.acquire((), "t_1")
        return await proc.run("{}", lambda e: None, 5)

    outcome = asyncio.run(run_one())
    assert not outcome.succeeded
    assert outcome.error["type"] == "sandbox_unavailable"
    assert "no bubblewrap here (test)" in outcome.error["message"]


def test_a_session_preset_caps_its_pool_with_max_processes_and_one_off_refuses_it() -> None:
    session = {"models": {"m": {"inference": {"command": ["x"], "mode": "session", "max_processes": 2}}}}
    assert parse_presets(session)[0].max_processes == 2
    one_off = {"models": {"m": {"inference": {"command": ["x"], "max_processes": 2}}}}
    with pytest.raises(InvalidInput) as info:
        parse_presets(one_off)
    assert info.value.field == "models.m.inference.max_processes"
