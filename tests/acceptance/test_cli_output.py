"""The CLI for a person and for a script: --json on read commands, followed events, batch progress, error lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import Cluster


@pytest.fixture(scope="module")
def demo(shared_cluster: Cluster) -> Cluster:
    shared_cluster.start_worker("turnout.demo:app", name="demo")
    return shared_cluster


def test_every_read_command_answers_json_with_json(demo: Cluster) -> None:
    done = json.loads(demo.cli("submit", "echo", "--input", '{"x": 1}', "--wait").stdout)
    demo.cli("gpus")  # warm nothing; each command below must print one JSON document
    for args, key in (
        (("status", "--json"), "workers"),
        (("tasks", "--json"), "tasks"),
        (("task", done["id"], "--json"), "routing"),
        (("gpus", "--json", "--gpus", "fake:1xL4"), "gpus"),
        (("audit", "--json"), "audit"),
        (("doctor", "--json", "--gpus", "none"), "checks"),
    ):
        out = demo.cli(*args)
        assert out.returncode in (0, 1), (
            out.stderr
        )  # doctor may find a problem on this host; it still answers
        assert key in json.loads(out.stdout), args


def test_task_reads_as_where_it_ran_and_why(demo: Cluster) -> None:
    done = json.loads(
        demo.cli("submit", "shout", "--input", '{"text": "hi"}', "--gpu", "never", "--wait").stdout
    )
    out = demo.cli("task", done["id"])
    assert out.returncode == 0
    lines = {
        line.split(None, 1)[0]: line.split(None, 1)[1]
        for line in out.stdout.splitlines()
        if " " in line.strip()
    }
    assert lines["state"].strip() == "succeeded"
    assert lines["routing"].strip() == "never -> cpu: gpu: never"
    assert lines["output"].strip() == json.dumps(done["output"])


def test_follow_streams_text_and_progress_then_one_summary_line(demo: Cluster) -> None:
    shout = demo.cli("submit", "shout", "--input", '{"text": "hello"}', "--follow")
    assert shout.returncode == 0, shout.stderr
    assert shout.stdout.startswith("HELLO\n")  # the text as it streamed, then the output as JSON
    assert json.loads(shout.stdout.split("\n", 1)[1])["text"] == "HELLO"
    summary = shout.stderr.strip().splitlines()[-1]
    assert " succeeded in " in summary and " on cpu" in summary and summary.endswith("no healthy gpu worker")
    slow = demo.cli("submit", "sleep", "--input", '{"seconds": 1}', "--follow")
    assert slow.returncode == 0
    assert "· progress 1/10 (10%)" in slow.stderr
    failed = demo.cli("submit", "fail", "--input", '{"message": "nope"}', "--follow")
    assert failed.returncode == 1
    assert "failed" in failed.stderr.splitlines()[-1] and "nope" in failed.stderr.splitlines()[-1]


def test_batch_submit_from_a_file_shows_progress_and_waits_for_every_task(
    demo: Cluster, tmp_path: Path
) -> None:
    inputs = tmp_path / "inputs.jsonl"
    inputs.write_text("".join(json.dumps({"n": i}) + "\n" for i in range(25)))
    out = demo.cli("submit", "echo", "--inputs", str(inputs), "--wait")
    assert out.returncode == 0, out.stderr
    rows = [line.split("\t") for line in out.stdout.splitlines()]
    assert len(rows) == 25 and {state for _, state in rows} == {"succeeded"}
    assert "submitting" in out.stderr and "finished" in out.stderr and "25/25" in out.stderr
    assert out.stderr.strip().endswith("25 tasks: 25 succeeded")
    as_json = json.loads(demo.cli("submit", "echo", "--inputs", str(inputs), "--wait", "--json").stdout)
    assert [t["output"] for t in as_json["tasks"]] == [{"n": i} for i in range(25)]


def test_a_bad_line_in_a_batch_is_one_error_naming_file_and_line(demo: Cluster, tmp_path: Path) -> None:
    inputs = tmp_path / "bad.jsonl"
    inputs.write_text('{"n": 1}\n{oops\n')
    out = demo.cli("submit", "echo", "--inputs", str(inputs))
    assert out.returncode == 2
    assert out.stderr.startswith(f"error: --inputs: {inputs} line 2 is not JSON")
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


def test_an_input_past_the_controllers_limit_names_the_limit_and_how_to_raise_it(
    demo: Cluster, tmp_path: Path
) -> None:
    inputs = tmp_path / "big.jsonl"
    inputs.write_text(json.dumps({"s": "x" * (1024 * 1024)}) + "\n")
    out = demo.cli("submit", "echo", "--inputs", str(inputs))
    assert out.returncode == 2
    last = out.stderr.splitlines()[-1]
    assert (
        last.startswith(f"error: --inputs: {inputs} line 1: input: ")
        and "limit 1 MiB (max_input_bytes)" in last
    )
    assert "nothing was submitted" in last
    assert "fix: send less, or have the controller's operator raise the limit" in last
    assert "--request-limit NAME=VALUE" in last and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("args", "token", "says", "fix"),
    [
        (("tasks",), "tnt_wrong", "unknown or revoked token", "fix: set TURNOUT_TOKEN to a valid token"),
        (("task", "t_000000000000000000000000"), None, "not found", "fix: check the id; `turnout tasks`"),
        (("submit", "echo", "--gpu", "sometimes"), None, "gpu:", "fix: see `turnout COMMAND --help`"),
    ],
)
def test_errors_are_one_line_with_the_fix_and_exit_2(
    demo: Cluster, args: tuple[str, ...], token: str | None, says: str, fix: str
) -> None:
    saved = demo.token
    if token:
        demo.token = token
    try:
        out = demo.cli(*args)
    finally:
        demo.token = saved
    assert out.returncode == 2, out.stdout
    assert out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("error: ") and says in out.stderr and fix in out.stderr
