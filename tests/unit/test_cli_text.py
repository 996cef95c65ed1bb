"""What the CLI prints of what the controller sent: text a terminal shows, never escape sequences it obeys."""

from __future__ import annotations

from turnout.cli_output import summary, terminal_safe

CLEAR_AND_RETITLE = "\x1b[2J\x1b]0;pwned\x07\x9b31m"


def test_control_characters_become_spaces_and_line_breaks_stay_unless_one_line() -> None:
    assert terminal_safe(f"a{CLEAR_AND_RETITLE}b\nc\td") == "a [2J ]0;pwned  31mb\nc\td"
    assert terminal_safe("b\nc\td", one_line=True) == "b c d"
    assert terminal_safe(None) == "" and terminal_safe(3.5) == "3.5"


def test_a_tasks_summary_carries_no_escape_sequence_from_its_error_reason_or_gpu_name() -> None:
    task = {"id": "t_1", "state": "failed", "device": "gpu", "gpu_model": f"H100{CLEAR_AND_RETITLE}",
            "routing": {"reason": f"why{CLEAR_AND_RETITLE}"},
            "error": {"type": "handler_error", "message": f"boom{CLEAR_AND_RETITLE}"}}  # fmt: skip
    line = summary(task)
    assert "\x1b" not in line and "\x07" not in line and "\x9b" not in line
    assert "boom" in line and "H100" in line and "why" in line
