"""The CLI as a user runs it: subprocesses, exit codes, and errors that say what was wrong (never a traceback)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Cluster, free_port


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "turnout.cli", *args], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, env=env)  # fmt: skip


def test_simulate_replays_a_trace_through_the_placement_code(tmp_path: Path) -> None:
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,32000,65536,2,V100\nn1,32000,65536,2,V100\n")
    tasks = tmp_path / "tasks.csv"
    header = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
    rows = "".join(f"p{i},1000,1024,1,500,,LS,Running,0,10,0\n" for i in range(8))
    tasks.write_text(header + rows)
    out = run(
        "simulate",
        "--nodes",
        str(nodes),
        "--tasks",
        str(tasks),
        "--policy",
        "bestfit",
        "--seed",
        "42",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["policy"] == "bestfit" and body["seed"] == 42
    assert body["points"][0]["arrived_pct"] == 0
    assert max(p["arrived_pct"] for p in body["points"]) <= 130
    assert body["points"][-1]["allocated_pct"] == 100.0  # 4 GPUs, 8 half-GPU tasks fit (2 resampled do not)


def test_simulate_names_the_bad_file_and_line(tmp_path: Path) -> None:
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,lots,65536,2,V100\n")
    out = run("simulate", "--nodes", str(nodes), "--tasks", str(nodes))
    assert out.returncode == 2
    assert "nodes.csv" in out.stderr and "Traceback" not in out.stderr


def test_a_cli_without_a_controller_says_so(tmp_path: Path) -> None:
    env = {**os.environ, "TURNOUT_URL": f"http://127.0.0.1:{free_port()}", "TURNOUT_HOME": str(tmp_path)}
    out = run("status", env=env)
    assert out.returncode == 2
    assert "cannot reach" in out.stderr and "Traceback" not in out.stderr


def test_submit_with_bad_json_input_names_the_option(cluster: Cluster) -> None:
    out = cluster.cli("submit", "echo", "--input", "{not json")
    assert out.returncode == 2
    assert "--input" in out.stderr and "Traceback" not in out.stderr


def test_submit_wait_prints_the_result_and_tasks_lists_it(cluster: Cluster) -> None:
    cluster.start_worker("turnout.demo:app", name="demo")
    out = cluster.cli("submit", "echo", "--input", '{"x": 1}', "--wait")
    assert out.returncode == 0, out.stderr
    task = json.loads(out.stdout)
    assert task["output"] == {"x": 1} and task["state"] == "succeeded"
    listed = cluster.cli("tasks", "--json")
    assert task["id"] in {t["id"] for t in json.loads(listed.stdout)["tasks"]}
    shown = cluster.cli("task", task["id"], "--json")
    assert json.loads(shown.stdout)["id"] == task["id"]
    failed = cluster.cli("submit", "fail", "--wait")
    assert failed.returncode == 1


def test_no_auth_is_refused_off_loopback(tmp_path: Path) -> None:
    out = run("controller", "--no-auth", "--host", "0.0.0.0", "--port", str(free_port()), "--home", str(tmp_path),
              "--db", f"sqlite:///{tmp_path / 'x.db'}")  # fmt: skip
    assert out.returncode == 2
    assert "loopback" in out.stderr


def test_a_database_that_cannot_be_opened_is_named_in_one_line(tmp_path: Path) -> None:
    damaged = tmp_path / "turnout.db"
    damaged.write_bytes(b"SQLite format 3\x00" + bytes(4080))  # a header, then nothing a database holds
    before = damaged.read_bytes()
    down = f"postgresql://turnout:hunter2@127.0.0.1:{free_port()}/turnout"  # nothing listens there
    for url, says in ((f"sqlite:///{damaged}", f"cannot open sqlite:///{damaged} as a SQLite database"),
                      (down, "cannot open the database at postgresql+psycopg://turnout:***@127.0.0.1"),
                      ("sqlite:///", "db: 'sqlite:///' names no file"),
                      ("mysql://db/x", "db: 'mysql://db/x' is not a sqlite:///PATH")):  # fmt: skip
        out = run("controller", "--db", url, "--port", str(free_port()), "--home", str(tmp_path / "home"))
        assert out.returncode == 2, out.stderr
        assert says in out.stderr and "restore a damaged file from a backup" in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and "unexpected" not in out.stderr
        assert "hunter2" not in out.stderr and "Traceback" not in out.stderr
    assert damaged.read_bytes() == before  # not "repaired" into an empty database


def test_a_port_another_process_holds_is_one_line_before_anything_is_made(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        out = run("controller", "--port", str(port), "--home", str(tmp_path / "home"),
                  "--db", f"sqlite:///{tmp_path / 'home' / 'turnout.db'}")  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert f"port: cannot listen on 127.0.0.1:{port}: address already in use" in out.stderr
    assert "choose another --port" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert "Turnout controller at" not in out.stdout  # it never said it serves
    assert not (
        tmp_path / "home"
    ).exists()  # no database, no admin token made for a controller that never ran


@pytest.mark.parametrize(
    ("command", "says"),
    [
        (["worker", "no_such_module:app", "--cpus", "nan"], "--cpus: nan is not a positive number"),
        (["worker", "no_such_module:app", "--cpus", "1e400"], "--cpus: inf is not a positive number"),
        (["worker", "no_such_module:app", "--cpus", "-1"], "--cpus: -1.0 is not a positive number"),
        (["worker", "no_such_module:app", "--heartbeat-s", "0"], "--heartbeat-s: 0.0 is not a positive"),
        (
            ["worker", "no_such_module:app", "--prefetch", "-1"],
            "--prefetch: -1 is not a number of tasks",
        ),
        (["worker", "no_such_module:app", "--prefetch", "5000"], "--prefetch: 5000 is not a number of tasks"),
        (
            ["worker", "no_such_module:app", "--prefetch", "soon"],
            "--prefetch: 'soon' is not auto or a number",
        ),
        (["controller", "--heartbeat-s", "nan"], "--heartbeat-s: nan is not a positive number of seconds"),
        (["controller", "--config", "{config}"], "turnout.yaml: file_retention_s: expected seconds >= 0"),
    ],
)
def test_numbers_no_worker_or_controller_could_run_with_are_refused_naming_the_option(
    tmp_path: Path, command: list[str], says: str
) -> None:
    config = tmp_path / "turnout.yaml"
    config.write_text("file_retention_s: .nan\n")  # YAML's NaN
    args = [a.replace("{config}", str(config)) for a in command]
    port = ["--port", str(free_port()), "--db", "memory://", "--home", str(tmp_path / "home")]
    extra = (
        port
        if args[0] == "controller"
        else ["--controller", f"http://127.0.0.1:{free_port()}", "--gpus", "none"]
    )
    out = run(*args, *extra)  # a worker's app is never imported: its numbers are refused first
    assert out.returncode == 2, out.stdout + out.stderr
    assert says in out.stderr and "unexpected" not in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["controller", "--config", "{file}", "--db", "memory://", "--port", "{port}"],
        ["worker", "--presets", "{file}", "--gpus", "none", "--controller", "http://127.0.0.1:{port}"],
        ["simulate", "--nodes", "{file}", "--tasks", "{file}"],
        ["submit", "echo", "--inputs", "{file}"],
    ],
)
@pytest.mark.parametrize("kind", ["binary", "directory"])
def test_a_file_that_is_not_text_or_not_a_file_is_named_with_its_flag(
    tmp_path: Path, command: list[str], kind: str
) -> None:
    named = tmp_path / "named"
    if kind == "binary":
        named.write_bytes(b"\xff\xfe\x00garbage")  # UTF-16's mark: no UTF-8 text
    else:
        named.mkdir()
    args = [a.replace("{file}", str(named)).replace("{port}", str(free_port())) for a in command]
    env = {
        **os.environ,
        "TURNOUT_HOME": str(tmp_path / "home"),
        "TURNOUT_URL": f"http://127.0.0.1:{free_port()}",
    }
    out = run(*args, env=env)
    flag = next(a for a in command if a.startswith("--") and "{file}" in command[command.index(a) + 1])
    says = f"{flag}: {named} is not UTF-8 text" if kind == "binary" else f"{flag}: cannot read {named}"
    assert out.returncode == 2 and says in out.stderr, out.stderr
    assert "unexpected" not in out.stderr and "Traceback" not in out.stderr
