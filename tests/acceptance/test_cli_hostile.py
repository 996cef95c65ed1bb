"""The CLI given what a user gets wrong, or pointed at what is not a controller: one `error:` line, exit 2, and
nothing submitted, printed or overwritten that the user did not ask for."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, Cluster


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TURNOUT_")}
    base.update(PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)]), TURNOUT_URL="http://127.0.0.1:9",
                TURNOUT_TOKEN="tnt_test")  # fmt: skip
    base.update(env or {})
    return subprocess.run([sys.executable, "-m", "turnout.cli", *args], env=base, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)  # fmt: skip


def one_error(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.splitlines()
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in out.stderr, out.stderr
    return lines[-1]


# ---- M3, M4: a URL that is not a controller ------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ("status",),
        ("submit", "shout", "--input", '{"text": "a"}'),
        ("submit", "shout", "--input", '{"text": "a"}', "--wait"),
        ("task", "t_0123456789abcdef01234567"),
        ("token", "create", "--role", "read"),
        ("file", "get", "f_0123456789ab0123456789abcdef", "-o", "got"),
    ],
)
def test_a_url_that_is_not_a_controller_is_named_with_what_came_back(
    web_page: str, args: tuple[str, ...], tmp_path: Path
) -> None:
    os.chdir(tmp_path)
    line = one_error(cli(*args, env={"TURNOUT_URL": web_page}))
    assert line.startswith(f"error: {web_page} did not answer as a Turnout controller (HTTP 200 text/html"), (
        line
    )
    assert "fix: point TURNOUT_URL" in line and "please report" not in line
    assert not (tmp_path / "got").exists()  # M4: a page is never taken for a file, nor said to be checked


def test_a_malformed_url_is_one_line_naming_the_url() -> None:
    line = one_error(cli("status", env={"TURNOUT_URL": "http://[::1"}))
    assert line.startswith("error: url: 'http://[::1' is not a URL") and "please report" not in line


@pytest.mark.parametrize("url", ["notaurl", "localhost:8750", "http://[::1"])
def test_a_worker_given_a_malformed_controller_url_exits_at_once_naming_it(url: str) -> None:
    # it retried registering for ever, logging "controller not reachable" each time
    line = one_error(
        cli("worker", "tests.apps.testapp:app", "--gpus", "none", "--controller", url, timeout=20)
    )
    assert line.startswith("error: --controller: url: ") and repr(url) in line


# ---- M8: ids --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("task", "../../v1/workers"), "task id: '../../v1/workers' is not a task id"),
        (("task", "t_x?wait=1"), "task id: 't_x?wait=1' is not a task id"),
        (("task", ""), "task id: '' is not a task id"),
        (("cancel", "../workers"), "task id: '../workers' is not a task id"),
        (("run", "../tasks"), "pipeline: '../tasks' is not a pipeline name"),
        (("file", "get", "../tasks"), "file id: '../tasks' is not a file id"),
        (("file", "delete", "f_/x"), "file id: 'f_/x' is not a file id"),
        (("token", "revoke", "../x"), "token id: '../x' is not a token id"),
    ],
)
def test_an_id_that_is_not_one_is_refused_before_any_request(
    web_page: str, args: tuple[str, ...], says: str
) -> None:
    line = one_error(cli(*args, env={"TURNOUT_URL": web_page}))  # a request would say "did not answer as"
    assert line.startswith(f"error: {says}"), line


# ---- M1, L1: flags that --inputs would drop ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--file", "image=/nonexistent"], "--file"),
        (["--input", '{"text": "ignored?"}'], "--input"),
        (["--follow"], "--follow"),
    ],
)
def test_a_flag_that_inputs_would_ignore_is_refused(tmp_path: Path, extra: list[str], flag: str) -> None:
    inputs = tmp_path / "ok.jsonl"
    inputs.write_text('{"text": "a"}\n')
    line = one_error(cli("submit", "shout", "--inputs", str(inputs), *extra))
    assert line.startswith(f"error: {flag} cannot be combined with --inputs"), line


def test_gpu_true_is_the_boolean_the_api_takes(web_page: str) -> None:
    # sent as JSON true, so the only error is the page's, not a refusal of 'true' that lists true as valid
    line = one_error(cli("submit", "shout", "--input", "{}", "--gpu", "true", env={"TURNOUT_URL": web_page}))
    assert "did not answer as a Turnout controller" in line, line


# ---- H2, M5: the controller and `up` refuse bad flags before anything is made or printed ---------------------


def test_a_controller_with_missing_tls_files_prints_nothing_and_keeps_admin_token(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "admin.token").write_text("tnt_of_another_database\n")
    out = cli("controller", "--db", "memory://", "--home", str(home), "--port", "0",
              "--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.key")  # fmt: skip
    line = one_error(out)
    assert line.startswith("error: --tls-cert: cannot read /nonexistent.pem"), line
    assert out.stdout == ""  # no admin token, no "Turnout controller at https://..."
    assert sorted(p.name for p in home.iterdir()) == ["admin.token"]
    assert (home / "admin.token").read_text() == "tnt_of_another_database\n"


def test_a_controller_with_storage_that_is_a_file_names_the_flag(tmp_path: Path) -> None:
    afile = tmp_path / "binary.yaml"
    afile.write_text("x")
    out = cli("controller", "--db", "memory://", "--home", str(tmp_path / "home"), "--port", "0",
              "--storage", str(afile))  # fmt: skip
    assert one_error(out).startswith(f"error: --storage: {afile} is not a directory")
    assert out.stdout == "" and not (tmp_path / "home").exists()


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--gpus", "bogus"], "error: gpus: 'bogus' is not a GPU spec"),
        (["--presets", "/nonexistent.yaml"], "error: --presets: cannot read /nonexistent.yaml"),
        (["--app", "nosuch_mod_for_turnout:app"], "error: --app: no module named 'nosuch_mod_for_turnout'"),
        (["--app", "nocolon"], "error: --app: expected MODULE:APP"),
    ],
)
def test_up_refuses_a_local_worker_that_could_not_start_before_serving(
    tmp_path: Path, flags: list[str], says: str
) -> None:
    out = cli("up", "--db", "memory://", "--home", str(tmp_path / "home"), "--port", "0", *flags, timeout=60)
    assert one_error(out).startswith(says)
    assert out.stdout == "" and not (tmp_path / "home").exists()


# ---- M2, M9: against a real controller --------------------------------------------------------------------


@pytest.fixture(scope="module")
def idle(shared_cluster: Cluster) -> Cluster:
    """A controller whose only worker (demo app) registered and died: its tasks are accepted and stay queued."""
    worker = shared_cluster.start_worker("turnout.demo:app", name="gone")
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait(timeout=10)
    return shared_cluster


def test_a_batch_refused_after_the_first_names_its_line_and_prints_what_was_submitted(
    idle: Cluster, tmp_path: Path
) -> None:
    cluster = idle
    lines = [json.dumps({"n": i}) for i in range(1500)]
    lines[1200] = json.dumps({"s": "x" * (1024 * 1024 + 10)})  # line 1201: over max_input_bytes
    inputs = tmp_path / "partial.jsonl"
    inputs.write_text("\n".join(lines) + "\n")
    out = cluster.cli("submit", "shout", "--inputs", str(inputs), timeout=120)
    line = one_error(out)
    assert line.startswith(f"error: --inputs: {inputs} line 1201: input: "), line
    assert "limit 1 MiB (max_input_bytes)" in line
    assert "the 1000 inputs before it (lines 1-1000) were submitted" in line
    ids = [row.split("\t")[0] for row in out.stdout.splitlines()]
    assert len(ids) == 1000 and all(i.startswith("t_") for i in ids)
    for task_id in (ids[0], ids[-1]):
        assert cluster.api("GET", f"/v1/tasks/{task_id}").json()["input"]["n"] in (0, 999)


def test_tasks_in_a_pipe_shows_whole_ids(idle: Cluster) -> None:
    cluster = idle
    task = cluster.submit("shout", {"text": "a"})
    out = cluster.cli("tasks")
    assert out.returncode == 0, out.stderr
    assert task["id"] in out.stdout and "…" not in out.stdout


def test_a_file_flag_with_an_input_that_cannot_hold_it_is_refused_before_any_upload(tmp_path: Path) -> None:
    photo = tmp_path / "photo.txt"
    photo.write_text("pixels")
    # nothing listens at TURNOUT_URL: an upload first would be a connection error, not this line
    line = one_error(cli("submit", "echo", "--input", "[1, 2]", "--file", f"image={photo}"))
    assert line.startswith("error: --file: the task input must be a JSON object to hold files by name")
