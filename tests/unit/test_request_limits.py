"""Request limits as configured, and strict JSON as parsed: the rules the API applies at its edge."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnout.api.limits import body_limit_of
from turnout.api.strictjson import strict_loads
from turnout.config import RequestLimits, controller_settings, parse_limit_flags, parse_request_limits
from turnout.errors import InvalidInput
from turnout.jsonsafe import MAX_INT_DIGITS, problem


def test_limits_take_quantities_and_counts_and_flags_win_over_the_file(tmp_path) -> None:
    config = tmp_path / "turnout.yaml"
    config.write_text("request_limits:\n  max_body_bytes: 16Mi\n  max_labels: 8\n  max_input_bytes: 2Mi\n")
    settings = controller_settings(config, limit_flags=parse_limit_flags(["max_input_bytes=512Ki"]))
    limits = settings.request_limits
    assert (limits.max_body_bytes, limits.max_labels, limits.max_input_bytes) == (16 * 2**20, 8, 512 * 2**10)
    assert limits.max_events_per_request == RequestLimits().max_events_per_request  # untouched: the default


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"max_bodee_bytes": "1Mi"}, "request_limits.max_bodee_bytes"),
        ({"max_body_bytes": 0}, "request_limits.max_body_bytes"),
        ({"max_body_bytes": "lots"}, "request_limits.max_body_bytes"),
        ({"max_labels": 1.5}, "request_limits.max_labels"),
        ({"max_labels": True}, "request_limits.max_labels"),
        (["max_labels"], "request_limits"),
    ],
)
def test_a_bad_limit_is_refused_naming_it(raw: object, field: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_request_limits(raw)
    assert caught.value.field == field


def test_a_flag_without_a_value_is_refused() -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_limit_flags(["max_body_bytes"])
    assert caught.value.field == "request-limit"


def test_a_413_names_the_limit_as_set() -> None:
    limits = RequestLimits(max_body_bytes=8 * 2**20, max_label_bytes=1536)
    assert limits.describe("max_body_bytes") == "limit 8 MiB (max_body_bytes)"
    assert limits.describe("max_label_bytes") == "limit 1.5 KiB (max_label_bytes)"
    assert limits.describe("max_labels") == "limit 32 (max_labels)"


def test_worker_batches_and_batch_submits_have_their_own_body_limit() -> None:
    limits = RequestLimits()
    assert body_limit_of(limits, "/v1/tasks") == "max_body_bytes"
    assert body_limit_of(limits, "/v1/tasks/batch") == "max_batch_body_bytes"
    assert body_limit_of(limits, "/v1/workers/w_1/events") == "max_worker_body_bytes"
    assert body_limit_of(limits, "/v1/workers/w_1/complete") == "max_worker_body_bytes"
    assert body_limit_of(limits, "/v1/workers/w_1/heartbeat") == "max_body_bytes"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"a": NaN}', "a"),
        (b'{"a": [1, {"b": -Infinity}]}', "a.1.b"),
        (b'{"a": 1e400}', "a"),
        (b'{"s": "\\ud800"}', "s"),
        (b'{"k\\udfff": 1}', "k\\udfff"),
        (b"[" * 65 + b"]" * 65, "0." * 63 + "0"),
        (b"[" * 10_000 + b"]" * 10_000, "body"),
        (b"\xff", "body"),
        (b'"\xed\xa0\x80"', "body"),  # a surrogate written as UTF-8 bytes is not UTF-8
        (b"[1, 2", "body"),
        (b"1" * 5000, "body"),
    ],
)
def test_strict_json_refuses_what_json_cannot_carry_naming_where(body: bytes, field: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        strict_loads(body)
    assert caught.value.field == field


def test_strict_json_takes_what_json_can_carry() -> None:
    body = (
        b'{"emoji": "\\ud83d\\ude00", "tiny": 1e-400, "text": "nan", "deep": ' + b"[" * 63 + b"]" * 63 + b"}"
    )
    value = strict_loads(body)
    assert value["emoji"] == "\U0001f600" and value["tiny"] == 0.0 and value["text"] == "nan"


# what a client may send: numbers past a float's range and integers past MAX_INT_DIGITS, lone surrogates in
# strings and keys (JSON's `\\udXXX` escapes), and everything that is fine
_EDGE_INTS = st.integers(-3, 3).map(lambda k: (10**MAX_INT_DIGITS - 1 + k) * (-1) ** (k % 2))
_TEXT = st.text(st.characters(codec=None, categories=["Ll", "Nd", "Cs", "So"]), max_size=4)
_VALUES: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers() | _EDGE_INTS | st.floats() | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=12,
)


@given(_VALUES)
def test_strict_json_takes_what_json_can_carry_and_names_the_first_place_it_cannot(value: Any) -> None:
    """The quick checks (hooks in the parser, a count of brackets) agree with the full walk (`problem`)."""
    body = json.dumps(value).encode()  # ASCII: surrogates escaped; NaN and Infinity written as Python does
    # what a lenient parser reads: two escaped halves of a surrogate pair read back as one character
    parsed = json.loads(body)
    found = problem(parsed)
    if found is None:
        assert strict_loads(body) == parsed
    else:
        with pytest.raises(InvalidInput) as caught:
            strict_loads(body)
        assert caught.value.field == found[0].encode("utf-8", "backslashreplace").decode("utf-8")
        assert not (isinstance(parsed, float) and math.isfinite(parsed))


def test_a_file_upload_has_the_file_limit_while_a_json_body_sent_there_keeps_the_json_one() -> None:
    limits = RequestLimits()
    for kind in ("application/octet-stream", "multipart/form-data; boundary=x", "image/png"):
        assert body_limit_of(limits, "/v1/files", kind) == "max_file_bytes"
        assert body_limit_of(limits, "/v1/workers/w_1/files", kind) == "max_file_bytes"  # a task's output
    for kind in ("", "application/json", "application/merge-patch+json; charset=utf-8"):
        assert body_limit_of(limits, "/v1/files", kind) == "max_body_bytes"
    assert body_limit_of(limits, "/v1/files/f_x", "application/octet-stream") == "max_body_bytes"
    assert (
        body_limit_of(limits, "/v1/workers/w_1/files/shared", "application/octet-stream") == "max_body_bytes"
    )
