"""File references in inputs and outputs: found anywhere, given paths for command workers, merged into outputs."""

from __future__ import annotations

import pytest

from turnout.errors import InvalidInput
from turnout.files import refs_in, set_field, with_paths
from turnout.worker.files import TaskFileError, _with_files

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
