"""`jsonsafe.problem`: where a value stops being strict JSON, named as users write paths.

Tables for each kind of refusal and for the paths they name, then properties over random values built from
JSON-safe parts: such a value has no problem and serialises strictly (and passes the quick check, which keeps no
paths), and one NaN, infinity or lone surrogate put anywhere in it is found at exactly the place it was put; the
quick check never passes what the close look refuses.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnout.jsonsafe import MAX_DEPTH, _walk, carried, problem

NAN, INF = float("nan"), float("inf")
NOT_A_NUMBER = "is not a JSON number"
SURROGATE = "lone UTF-16 surrogate"


def strict_json(value: Any) -> bytes:
    """What every strict reader accepts: no NaN or Infinity, and text that is UTF-8."""
    return json.dumps(value, allow_nan=False, ensure_ascii=False).encode("utf-8")


def nested(depth: int, leaf: Any = 1, *, as_dict: bool = False) -> Any:
    value = leaf
    for _ in range(depth):
        value = {"k": value} if as_dict else [value]
    return value


# -- tables ------------------------------------------------------------------------------------------------------

FINE = {
    "null": None,
    "booleans": [True, False],
    "integers": [0, -1, 2**64, -(2**63)],
    "floats": [0.0, -0.0, 1.5, 1e308, -1e-308, 5e-324],
    "empty text": "",
    "emoji, a real pair": "\U0001f600",
    "NUL and controls": "\x00\t\n\x1f",
    "empty containers": [[], {}],
    "a tuple is a list": (1, "two", (3.0,)),
    "keys any text": {"a.b": 1, " ": 2, "\U0001f600": 3, "": {"fine": True}},
    "64 nested lists": nested(MAX_DEPTH),
    "64 nested objects": nested(MAX_DEPTH, as_dict=True),
    "a wide list": list(range(100_000)),
}


@pytest.mark.parametrize("value", list(FINE.values()), ids=list(FINE))
def test_a_value_strict_json_can_carry_has_no_problem(value: Any) -> None:
    assert problem(value) is None
    strict_json(value)  # and it really serialises strictly


DEEP = ".".join(["0"] * MAX_DEPTH)  # the path of the 65th nested list
BAD: dict[str, tuple[Any, str, str]] = {
    # value                                    path          why (a part of it)
    "NaN": (NAN, "value", f"nan {NOT_A_NUMBER}"),
    "infinity": (INF, "value", f"inf {NOT_A_NUMBER}"),
    "minus infinity": (-INF, "value", f"-inf {NOT_A_NUMBER}"),
    "a high surrogate": ("\ud800", "value", SURROGATE),
    "a low surrogate inside text": ("ab\udc80cd", "value", SURROGATE),
    "a list item": ([0, 1, INF], "2", NOT_A_NUMBER),
    "a nested field": ({"a": [1, {"b": NAN}]}, "a.1.b", NOT_A_NUMBER),
    "text in a tuple": ({"t": ("ok", "\udfff")}, "t.1", SURROGATE),
    "a key that is not text": ({"a": {1: "x"}}, "a", "key 1 is not a string"),
    "a None key": ({None: 1}, "value", "key None is not a string"),
    "a surrogate key": ({"a": {"b\ud800": 1}}, "a.b\\ud800", f"key holds a {SURROGATE}"),
    "bytes": ({"raw": b"\x00"}, "raw", "a bytes is not a JSON value"),
    "a set": ([{1, 2}], "0", "a set is not a JSON value"),
    "a Decimal": (Decimal("1.5"), "value", "a Decimal is not a JSON value"),
    "an object": ({"o": object()}, "o", "a object is not a JSON value"),
    "65 nested lists": (nested(MAX_DEPTH + 1), DEEP, f"nested deeper than {MAX_DEPTH} levels"),
    "65 nested objects": (
        nested(MAX_DEPTH + 1, as_dict=True),
        ".".join(["k"] * MAX_DEPTH),
        f"nested deeper than {MAX_DEPTH} levels",
    ),
}


@pytest.mark.parametrize(("value", "path", "why"), list(BAD.values()), ids=list(BAD))
def test_a_value_strict_json_cannot_carry_is_named_with_its_path(value: Any, path: str, why: str) -> None:
    found = problem(value)
    assert found is not None and found[0] == path, found
    assert why in found[1]


def test_the_path_starts_from_the_name_the_caller_gives() -> None:
    assert problem(NAN, "output") == ("output", f"nan {NOT_A_NUMBER} (NaN and Infinity have no JSON form)")
    assert problem({"items": [0, {"score": INF}]}, "output")[0] == "output.items.1.score"  # type: ignore[index]


def test_of_several_values_the_first_in_document_order_is_named() -> None:
    assert problem([NAN, "\ud800"]) == ("0", f"nan {NOT_A_NUMBER} (NaN and Infinity have no JSON form)")
    assert problem({"a": {"b": 1}, "c": [2, -INF], "d": NAN})[0] == "c.1"  # type: ignore[index]
    assert problem({"a": [{"x": "\ud800"}], "b": NAN})[0] == "a.0.x"  # type: ignore[index]


def test_a_value_that_contains_itself_is_refused_not_walked_forever() -> None:
    loop: list[Any] = []
    loop.append(loop)
    found = problem(loop)
    assert found is not None and found[1] == f"nested deeper than {MAX_DEPTH} levels"
    with pytest.raises(ValueError, match="Circular reference"):
        strict_json(loop)  # json agrees it cannot be written


# -- gaps found by these tests, now closed --------------------------------------------------------------------------


def test_an_empty_key_at_the_top_keeps_its_place_in_the_path() -> None:
    # Without a root name, {"": NaN} is named like a NaN at the root ("value"), and {"": {"x": NaN}} like {"x": NaN}
    assert problem({"": NAN}) != problem(NAN)
    assert problem({"": {"x": NAN}}) != problem({"x": NAN})


def test_an_integer_too_long_to_write_is_a_problem() -> None:
    with pytest.raises(ValueError, match="Exceeds the limit"):
        strict_json(10**5000)
    assert problem({"n": 10**5000}) is not None


def test_the_path_naming_a_bad_key_is_itself_writable_text() -> None:
    found = problem({"a": {"b\ud800": 1}})
    assert found is not None
    found[0].encode("utf-8")  # a 422 or an invalid_output error naming this path must be servable


def test_the_first_bad_key_or_value_in_document_order_is_named() -> None:
    assert problem({"a": NAN, "b\ud800": 1})[0] == "a"  # type: ignore[index]
    assert problem({"x\ud800": 1, "y\udfff": 2})[0] == "x\\ud800"  # type: ignore[index]


# -- properties --------------------------------------------------------------------------------------------------

TEXT = st.text(st.characters(codec="utf-8"), max_size=8)  # any text UTF-8 can carry, so no surrogates
KEYS = st.text(st.characters(codec="utf-8"), min_size=1, max_size=6)  # non-empty: see the empty-key gap above
LEAVES = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | TEXT
JSON_VALUES = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
    max_leaves=24,
)
BAD_LEAVES = st.sampled_from([NAN, INF, -INF]) | st.builds(
    lambda before, surrogate, after: before + surrogate + after,
    TEXT,
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
    TEXT,
)


@settings(deadline=None)
@given(JSON_VALUES)
def test_a_value_built_from_json_safe_parts_has_no_problem_and_round_trips(value: Any) -> None:
    assert problem(value) is None
    assert carried(value)  # passed quickly: the close look's paths are only built where something is wrong
    assert json.loads(strict_json(value)) == value


def _put(value: Any, bad: Any, data: st.DataObject) -> tuple[Any, list[str]]:
    """A copy of `value` with `bad` put at a drawn place (replacing what is there, or as a new item or field),
    and that place's path parts."""
    descend = isinstance(value, list | dict) and data.draw(st.booleans(), label="descend")
    if not descend:
        return bad, []
    if isinstance(value, list):
        i = data.draw(st.integers(0, len(value)), label="index")  # len(value): a new last item
        if i == len(value):
            return [*value, bad], [str(i)]
        inner, parts = _put(value[i], bad, data)
        return [*value[:i], inner, *value[i + 1 :]], [str(i), *parts]
    key = data.draw(st.sampled_from(sorted(value)) | KEYS if value else KEYS, label="key")
    inner, parts = _put(value[key], bad, data) if key in value else (bad, [])
    return {**value, key: inner}, [key, *parts]


@settings(deadline=None)
@given(JSON_VALUES, BAD_LEAVES, st.sampled_from(["", "output"]), st.data())
def test_one_bad_value_put_anywhere_is_found_at_exactly_that_path(
    value: Any, bad: Any, root: str, data: st.DataObject
) -> None:
    spoiled, parts = _put(value, bad, data)
    expected = ".".join([root, *parts] if root else parts) or "value"
    found = problem(spoiled, root)
    assert found is not None and found[0] == expected, (found, expected)
    assert (NOT_A_NUMBER if isinstance(bad, float) else SURROGATE) in found[1]
    with pytest.raises((ValueError, UnicodeEncodeError)):
        strict_json(spoiled)  # it really cannot be written strictly


class _Text(str):
    pass


class _Number(float):
    pass


ANY_LEAVES = (
    LEAVES | BAD_LEAVES | st.builds(_Text, TEXT) | st.builds(_Number, st.floats()) | st.just(Decimal(1))
)
ANY_VALUES = st.recursive(
    ANY_LEAVES,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.tuples(inner)
        | st.dictionaries(KEYS | st.integers(), inner, max_size=3)
    ),
    max_leaves=16,
)


@settings(deadline=None)
@given(ANY_VALUES | st.integers(1, 3).map(lambda k: nested(MAX_DEPTH - 2 + k)))
def test_the_quick_check_passes_nothing_the_close_look_refuses(value: Any) -> None:
    if carried(value):
        assert _walk(value, "") is None
