"""Command workers end to end: presets served by a real worker, real programs misbehaving in every way.

Each misbehaving task must end with a clear error, leave no process behind, and leave the worker serving.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, Cluster, pid_alive
from turnout.client import Client
from turnout.worker.docker import engine_answers

LOADING_WORKER = REPO / "examples" / "loading-worker" / "worker.py"

# One program, told by its input how to misbehave; it reports its pids as `worker` events.
MISBEHAVING = textwrap.dedent("""
    import json, os, sys, time

    def emit(**event):
        sys.stdout.write(json.dumps(event) + "\\n")
        sys.stdout.flush()

    def sleeper():
        pid = os.fork()
        if pid == 0:
            time.sleep(1000)
            os._exit(0)
        return pid

    for line in sys.stdin:
        task = json.loads(line)
        do = task["do"]
        emit(event="worker", status="pids", message=json.dumps({"self": os.getpid(), "parent": os.getppid()}))
        if do == "ok":
            emit(event="result", data={"pid": os.getpid()})
            emit(event="finish", status="completed")
        elif do == "garbage":
            for junk in ("not json at all", "[1, 2, 3]", '"a string"', '{"no_event_key": 1}', "{broken"):
                sys.stdout.write(junk + "\\n")
            emit(event="result", data={"survived": True})
            emit(event="finish", status="completed")
        elif do == "crash":
            for i in range(5):
                emit(event="text_delta", delta=f"t{i} ")
            print("loading weights: ok", file=sys.stderr, flush=True)
            print("RuntimeError: boom in layer 7", file=sys.stderr, flush=True)
            os._exit(3)
        elif do == "hang":
            time.sleep(1000)
        elif do in ("fork", "tree"):
            child = sleeper()
            grandchild_pipe = os.pipe()
            mid = os.fork()
            if mid == 0:  # a child that forks a grandchild, both outliving the program
                os.write(grandchild_pipe[1], str(sleeper()).encode())
                time.sleep(1000)
                os._exit(0)
            grandchild = int(os.read(grandchild_pipe[0], 32))
            emit(event="worker", status="children", message=json.dumps([child, mid, grandchild]))
            if do == "fork":
                os._exit(0)  # exits without finish; its children still hold stdout
            time.sleep(1000)
        elif do == "env":
            keys = ["MODEL_NAME", "MODEL_PATH", "GPU_DEVICE", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES",
                    "TURNOUT_TASK_ID", "EXTRA"]
            emit(event="result", data={k: os.environ.get(k) for k in keys} | {"line": line.strip()})
            emit(event="finish", status="completed")
""")


def presets_yaml(tmp: Path) -> Path:
    program = tmp / "misbehaving.py"
    program.write_text(MISBEHAVING)
    py = sys.executable
    doc = {"models": {
        "loading-session": {"inference": {"command": [py, str(LOADING_WORKER)], "mode": "session",
                                          "env_vars": {"LOAD_S": "0.05"}}},
        "loading-oneoff": {"inference": {"command": [py, str(LOADING_WORKER)], "mode": "one-off",
                                         "env_vars": {"LOAD_S": "0.05"}}},
        "misbehaving": {"inference": {"command": [py, str(program)], "mode": "session", "timeout_s": 1.5}},
        "misbehaving-oneoff": {"inference": {"command": [py, str(program)], "mode": "one-off",
                                             "env_vars": {"EXTRA": "x"}}},
        "misbehaving-gpu": {"inference": {"command": [py, str(program)], "resources": {"gpu": 1}}},
        "image-only": {"inference": {"docker_image": "loading-worker:latest"}},
    }}  # fmt: skip
    path = tmp / "presets.yaml"
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


def start_preset_worker(cluster: Cluster, name: str = "cmd") -> Any:
    """A worker serving the test presets, with one fake GPU and a models dir of its own."""
    extra = ["--presets", str(presets_yaml(cluster.tmp)), "--models-dir", str(cluster.tmp / "models")]
    return cluster.start_worker(gpus="fake:1x24Gi", name=name, extra=extra)


@pytest.fixture(scope="module")
def served(shared_cluster: Cluster) -> Cluster:
    """One controller and one preset worker for the whole module: starting them is most of a test's time."""
    start_preset_worker(shared_cluster)
    return shared_cluster


def events_of(cluster: Cluster, task_id: str) -> list[dict[str, Any]]:
    with Client(cluster.url, cluster.token) as client:
        return list(client.task(task_id).events())


def run(
    cluster: Cluster, capability: str, data: Any, **options: Any
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    task = cluster.result(cluster.submit(capability, data, **options)["id"], wait=20)
    return task, events_of(cluster, task["id"])


def reported_pids(events: list[dict[str, Any]]) -> list[int]:
    pids: list[int] = []
    for e in events:
        if e["event"] == "worker" and e.get("status") == "pids":
            pids += json.loads(e["message"]).values()
        elif e["event"] == "worker" and e.get("status") == "children":
            pids += json.loads(e["message"])
    return pids


def wait_all_dead(pids: list[int], timeout_s: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if pid_alive(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return alive


def assert_next_task_is_served(cluster: Cluster, capability: str = "misbehaving") -> None:
    task, _ = run(cluster, capability, {"do": "ok"})
    assert task["state"] == "succeeded", task


# ---- behaviour -------------------------------------------------------------------------------------


def test_session_mode_serves_many_tasks_from_one_process_that_loads_once(served: Cluster) -> None:
    outputs = []
    for _ in range(3):
        task, events = run(served, "loading-session", {"prompt": "a b", "tokens": 3, "delay_s": 0})
        assert task["state"] == "succeeded", task
        outputs.append(task["output"])
    assert len({o["pid"] for o in outputs}) == 1
    assert [o["tasks_served"] for o in outputs][-2:] == [
        outputs[0]["tasks_served"] + 1,
        outputs[0]["tasks_served"] + 2,
    ]
    assert not any(e["event"] == "progress" for e in events)  # the model stayed loaded


def test_one_off_mode_starts_a_fresh_process_per_task_that_knows_its_task_id(served: Cluster) -> None:
    first, events = run(served, "loading-oneoff", {"prompt": "x", "tokens": 2, "delay_s": 0})
    second, _ = run(served, "loading-oneoff", {"prompt": "x", "tokens": 2, "delay_s": 0})
    assert first["state"] == second["state"] == "succeeded"
    assert first["output"]["pid"] != second["output"]["pid"]
    assert first["output"]["task_id"] == first["id"]
    assert [e["done"] for e in events if e["event"] == "progress"] == [1, 2, 3, 4, 5]  # loading, every time
    assert wait_all_dead([first["output"]["pid"], second["output"]["pid"]]) == []
    assert first["output"]["text"] == "x x "


def test_the_program_gets_the_raw_input_line_and_the_contract_env(served: Cluster) -> None:
    task, _ = run(served, "misbehaving-oneoff", {"do": "env"})
    out = task["output"]
    assert json.loads(out["line"]) == {"do": "env"}  # the input itself, not turnout's envelope
    assert out["MODEL_NAME"] == "misbehaving-oneoff"
    assert out["MODEL_PATH"] == str(served.tmp / "models" / "misbehaving-oneoff")
    assert out["TURNOUT_TASK_ID"] == task["id"]
    assert out["EXTRA"] == "x"
    # a CPU task sees no GPU
    assert out["CUDA_VISIBLE_DEVICES"] == "" and out["NVIDIA_VISIBLE_DEVICES"] == "void"


def test_a_gpu_preset_sees_only_its_granted_gpu(served: Cluster) -> None:
    task, _ = run(served, "misbehaving-gpu", {"do": "env"}, gpu="require")
    assert task["state"] == "succeeded", task
    uuid = task["gpus"][0]
    assert task["output"]["CUDA_VISIBLE_DEVICES"] == uuid == task["output"]["NVIDIA_VISIBLE_DEVICES"]
    assert task["output"]["GPU_DEVICE"] == "0"


def test_garbage_lines_become_log_events_and_the_task_still_succeeds(served: Cluster) -> None:
    task, events = run(served, "misbehaving", {"do": "garbage"})
    assert task["state"] == "succeeded", task
    assert task["output"] == {"survived": True}
    logged = [e["line"] for e in events if e["event"] == "log"]
    assert logged == ["not json at all", "[1, 2, 3]", '"a string"', '{"no_event_key": 1}', "{broken"]


def test_a_crash_mid_stream_fails_with_the_exit_code_and_the_last_stderr_lines(served: Cluster) -> None:
    task, events = run(served, "misbehaving", {"do": "crash"})
    assert task["state"] == "failed"
    error = task["error"]
    assert error["type"] == "process_exited" and error["exit_code"] == 3
    assert "RuntimeError: boom in layer 7" in error["message"] and "code 3" in error["message"]
    assert [e["delta"] for e in events if e["event"] == "text_delta"] == [f"t{i} " for i in range(5)]
    assert events[-1]["event"] == "finish" and events[-1]["status"] == "failed"
    assert wait_all_dead(reported_pids(events)) == []
    assert_next_task_is_served(served)


def test_a_hang_past_the_preset_timeout_kills_the_process_group(served: Cluster) -> None:
    task, events = run(served, "misbehaving", {"do": "hang"})
    assert task["state"] == "failed"
    assert task["error"]["type"] == "timeout"
    assert "timeout_s=1.5" in task["error"]["message"]
    assert wait_all_dead(reported_pids(events)) == []
    assert_next_task_is_served(served)


def test_children_that_outlive_the_program_are_all_killed(served: Cluster) -> None:
    task, events = run(served, "misbehaving", {"do": "fork"})
    assert task["state"] == "failed"
    assert task["error"]["type"] == "process_exited" and task["error"]["exit_code"] == 0
    pids = reported_pids(events)
    assert len(pids) == 5  # program, guard, child, mid, grandchild
    assert wait_all_dead(pids) == []
    assert_next_task_is_served(served)


@pytest.mark.skipif(engine_answers(), reason="a Docker engine answers here; the unit tests cover the refusal")
def test_a_preset_with_only_an_image_and_no_engine_fails_its_tasks_clearly(served: Cluster) -> None:
    task, _ = run(served, "image-only", {"prompt": "x"})
    assert task["state"] == "failed"
    assert task["error"]["type"] == "docker_unavailable"
    assert "loading-worker:latest" in task["error"]["message"]
    assert_next_task_is_served(served)


def test_sigkill_of_the_worker_kills_a_running_commands_whole_tree(cluster: Cluster) -> None:
    worker = start_preset_worker(cluster, name="doomed")
    task = cluster.submit("misbehaving", {"do": "tree"})
    pids: list[int] = []
    with Client(cluster.url, cluster.token) as client:
        for event in client.task(task["id"]).events():
            if event["event"] == "worker" and event.get("status") == "pids":
                pids += json.loads(event["message"]).values()
            if event["event"] == "worker" and event.get("status") == "children":
                pids += json.loads(event["message"])
                break
    assert len(pids) == 5 and all(pid_alive(p) for p in pids)
    os.kill(worker.pid, signal.SIGKILL)  # the worker alone: its children lead their own groups
    assert wait_all_dead(pids) == []
