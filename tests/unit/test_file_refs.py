"""File references in inputs and outputs: found anywhere, given paths for command workers, merged into outputs;
the output directory a Python task is given."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from turnout.blobs import TMP_MAX_AGE_S, Blobs
from turnout.errors import InvalidInput
from turnout.files import refs_in, set_field, with_paths
from turnout.worker.app import Context
from turnout.worker.containment import worker_tag
from turnout.worker.files import TaskFileError, WorkerFiles, _with_files, own_scratch, stale_scratch

A, B = "f_000000000001aaaaaaaaaaaaaaaa", "f_000000000002bbbbbbbbbbbbbbbb"


def test_references_are_found_anywhere_in_an_input_with_their_field_paths_in_document_order() -> None:
    data = {"image": {"$file": A}, "batch": [{"x": 1}, {"$file": B}], "note": {"$file": 3}, "text": "$file"}
    assert refs_in(data) == [("input.image", A), ("input.batch.1", B)]
    assert refs_in(None) == [] and refs_in([{"$file": A}], "tasks.2.input") == [("tasks.2.input.0", A)]


def test_a_command_workers_input_line_gets_a_path_beside_each_reference_and_nothing_else_changes() -> None:
    data = {"image": {"$file": A}, "batch": [{"$file": B}], "n": 1}
    assert with_paths(data, {A: "/tmp/a"}) == {
        "image": {"$file": A, "path": "/tmp/a"},
        "batch": [{"$file": B}],
        "n": 1,
    }


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        (None, {"files": {"o.txt": {"$file": A}}}),
        ({"score": 1}, {"score": 1, "files": {"o.txt": {"$file": A}}}),
        ({"files": {"mine": {"$file": B}}}, {"files": {"mine": {"$file": B}, "o.txt": {"$file": A}}}),
        ([1, 2], {"value": [1, 2], "files": {"o.txt": {"$file": A}}}),
    ],
)
def test_output_files_join_the_handlers_output_without_losing_what_it_returned(
    output: object, expected: object
) -> None:
    assert _with_files(output, {"o.txt": {"$file": A}}) == expected


def test_an_output_whose_files_key_is_not_an_object_fails_naming_output_files() -> None:
    with pytest.raises(TaskFileError) as caught:
        _with_files({"files": 3}, {"o.txt": {"$file": A}})
    assert caught.value.error["field"] == "output.files"


def test_submit_file_flags_need_an_object_input() -> None:
    assert set_field(None, "image", {"$file": A}) == {"image": {"$file": A}}
    with pytest.raises(InvalidInput):
        set_field([1], "image", {"$file": A})


def test_a_python_tasks_output_directory_is_made_only_when_its_handler_uses_it_and_removed_behind(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        async with httpx.AsyncClient(base_url="http://127.0.0.1:9") as http:
            files = WorkerFiles(http, scratch=tmp_path / "scratch")
            try:
                made_ahead = set((tmp_path / "scratch").iterdir())
                # Given two tasks whose runner makes their directory at first use
                quiet = await files.prepare({"id": "t_1", "attempt": 1, "input": {}}, make_output=False)
                writer = await files.prepare({"id": "t_2", "attempt": 1, "input": {}}, make_output=False)
                # Then neither directory is there before its handler runs, and the two are not the same
                assert not quiet.output_dir.exists() and not writer.output_dir.exists()
                assert quiet.output_dir != writer.output_dir and quiet.output_dir not in made_ahead
                # When one handler writes a file and the other never looks at its directory
                ctx = Context(
                    task_id="t_2", attempt=1, device="cpu", gpus=[], output_dir=str(writer.output_dir)
                )
                (ctx.output_dir / "o.txt").write_text("x")
                assert ctx.output_dir == writer.output_dir  # made once, mode 0700
                assert stat.S_IMODE(writer.output_dir.stat().st_mode) == 0o700
                # Then the quiet one is seen empty with one look, and nothing is made or removed for it
                assert await files.collect(quiet, {"id": "t_1", "attempt": 1}, {"n": 1}) == {"n": 1}
                assert files.remove_if_empty(quiet) and not quiet.output_dir.exists()
                # and the writer's is not taken for empty
                assert not files.remove_if_empty(writer)
                # When its file is gone, Then its now-empty directory is removed behind
                (writer.output_dir / "o.txt").unlink()
                assert files.remove_if_empty(writer)
            finally:
                files.close()
            assert not writer.output_dir.exists()

    asyncio.run(scenario())


def test_a_workers_scratch_is_named_by_its_tag_and_those_of_gone_workers_are_removed_first(
    tmp_path: Path,
) -> None:
    gone = subprocess.Popen(["sleep", "30"])
    gone_tag = worker_tag(gone.pid)  # read while it runs: its pid and start ticks
    gone.kill()
    gone.wait()
    dead = tmp_path / f"turnout-worker-{gone_tag}-abc123"
    (dead / "t_1-1").mkdir(parents=True)
    (dead / "t_1-1" / "input.bin").write_text("a task's data")
    alive = tmp_path / f"turnout-worker-{worker_tag()}-xyz789"  # another worker in this very process
    alive.mkdir()
    older = tmp_path / "turnout-worker-0vwu91ss"  # an older version's random name: not ours to judge
    older.mkdir()
    elsewhere = tmp_path / "kept"
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("x")
    link = tmp_path / f"turnout-worker-{gone_tag}-link00"  # a link is never followed
    link.symlink_to(elsewhere)

    own = own_scratch(tmp_path)

    assert not dead.exists()
    assert alive.exists() and older.exists() and link.is_symlink() and (elsewhere / "precious").exists()
    assert own.parent == tmp_path and own.name.startswith(f"turnout-worker-{worker_tag()}-")
    assert stat.S_IMODE(own.stat().st_mode) == 0o700
    assert stale_scratch(tmp_path) == []  # what is left is all alive or not ours


def _stand_in(controller: Callable[[httpx.Request], httpx.Response]) -> httpx.AsyncClient:
    """A client whose controller is `controller`, called in-process."""
    return httpx.AsyncClient(base_url="http://turnout", transport=httpx.MockTransport(controller))


def test_a_link_in_the_shared_storage_is_never_read_as_an_input_file(tmp_path: Path) -> None:
    """Whoever can write to the shared storage could swap a stored file for a link to any file of the worker's
    host: the worker then fetches the file from the controller, which serves no link (`Blobs.open`)."""
    secret = tmp_path / "admin.token"
    secret.write_text("the operator's token")
    asked: list[str] = []

    def controller(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return httpx.Response(404, json={"error": {"type": "not_found", "message": "no such file"}})

    async def scenario() -> None:
        async with _stand_in(controller) as http:
            files = WorkerFiles(http, scratch=tmp_path / "scratch", storage=tmp_path / "shared")
            files.worker_id = "w_1"
            try:
                (tmp_path / "shared" / "objects" / A).symlink_to(secret)
                with pytest.raises(TaskFileError) as refused:
                    await files.prepare({"id": "t_1", "attempt": 1, "input": {"doc": {"$file": A}}})
                assert refused.value.error["type"] == "input_file_missing"
                assert asked and A in asked[0]  # fetched, not read through the link
                # a regular file there is read in place, with no request
                (tmp_path / "shared" / "objects" / A).unlink()
                (tmp_path / "shared" / "objects" / A).write_text("stored")
                got = await files.prepare({"id": "t_2", "attempt": 1, "input": {"doc": {"$file": A}}})
                assert Path(got.inputs[A]).read_text() == "stored" and len(asked) == 1
            finally:
                files.close()

    asyncio.run(scenario())


def test_an_output_directory_in_the_shared_storage_outlives_its_sweep_while_its_task_runs(
    tmp_path: Path,
) -> None:
    """The storage's sweep removes what did not change in its tmp/ for a day; a task may run longer, writing
    nothing until its end. The heartbeat's `keep_in_use` touches its directory; once it ended, nothing does."""
    day_and_more = TMP_MAX_AGE_S + 3600

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url="http://127.0.0.1:9") as http:
            files = WorkerFiles(http, scratch=tmp_path / "scratch", storage=tmp_path / "shared")
            try:
                running = await files.prepare({"id": "t_1", "attempt": 1, "input": {}})
                ended = await files.prepare({"id": "t_2", "attempt": 1, "input": {}})
                (ended.output_dir / "kept.txt").write_text("x")
                files.cleanup(ended)
                ended.output_dir.mkdir()  # as if a late write had made it again
                long_ago = time.time() - day_and_more
                for d in (running.output_dir, ended.output_dir):
                    os.utime(d, (long_ago, long_ago))
                files.keep_in_use()
                blobs = Blobs(tmp_path / "shared")
                blobs.remove_stale_tmp(time.time())
                assert running.output_dir.is_dir() and not ended.output_dir.exists()
                # a directory made ahead and handed out a day later is its new task's, as new to the sweep
                stock = await files.prepare({"id": "t_3", "attempt": 1, "input": {}})
                os.utime(stock.output_dir, (long_ago, long_ago))
                files._outputs._stock.appendleft(stock.output_dir)
                handed = await files.prepare({"id": "t_4", "attempt": 1, "input": {}})
                assert handed.output_dir == stock.output_dir
                assert time.time() - handed.output_dir.stat().st_mtime < 60
            finally:
                files.close()

    asyncio.run(scenario())


def test_an_output_directory_of_too_many_files_fails_its_task_before_any_is_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("turnout.worker.files.MAX_OUTPUT_FILES", 5)
    sent: list[str] = []

    def controller(request: httpx.Request) -> httpx.Response:
        sent.append(request.url.path)
        return httpx.Response(500)

    async def scenario() -> None:
        async with _stand_in(controller) as http:
            files = WorkerFiles(http, scratch=tmp_path / "scratch")
            files.worker_id = "w_1"
            try:
                many = await files.prepare({"id": "t_1", "attempt": 1, "input": {}})
                for i in range(6):
                    (many.output_dir / f"part-{i}.txt").write_text(str(i))
                with pytest.raises(TaskFileError) as refused:
                    await files.collect(many, {"id": "t_1", "attempt": 1}, {"n": 6})
                assert refused.value.error["type"] == "output_too_large"
                assert refused.value.error["field"] == "output_dir"
                assert "more than 5 files" in str(refused.value)
                assert sent == []
            finally:
                files.close()

    asyncio.run(scenario())
