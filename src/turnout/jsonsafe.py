"""What JSON can carry, checked once at each edge where outside data comes in or goes out.

Python's `json` module writes `NaN`, `Infinity` and lone UTF-16 surrogates (`"\\ud800"`) without complaint,
but no strict JSON reader (browsers, Go, PostgreSQL's `jsonb`, orjson) accepts them back. A value that
cannot be served back must be refused where it enters (a client's body: 422 naming the field; a handler's
result: the task fails `invalid_output` naming the path), never stored and discovered later.
"""

from __future__ import annotations

import math
from typing import Any

MAX_DEPTH = 64
INVALID_OUTPUT = "invalid_output"  # the error type of a result (a worker's, an endpoint's) JSON cannot carry
MAX_PATH_CHARS = 300
MAX_MESSAGE_CHARS = 2000
MAX_INT_DIGITS = 4000  # Python refuses to write ints of more than 4,300 digits (sys.get_int_max_str_digits)
_TOO_LONG_INT = 10**MAX_INT_DIGITS


def problem(value: Any, path: str = "") -> tuple[str, str] | None:
    """The first place in `value`, in document order, that strict JSON cannot carry, as (path, why); None
    when all is well.

    Paths read as users write them (`output.items.3.score`) and are always writable text themselves: a bad
    key is named with its bad characters escaped. Walks iteratively: a hostile value may be deep. A value of
    plain JSON types that is all fine (nearly every one) is passed by `carried` first, which keeps no paths.
    """
    return None if carried(value) else _walk(value, path)


def _walk(value: Any, path: str) -> tuple[str, str] | None:
    """`problem`, the close look: every value in document order, its path kept."""
    root: tuple[str, ...] = (path,) if path else ()
    # (is_key, item, path, depth): a key is checked just before the value it names, so order is the document's
    stack: list[tuple[bool, Any, tuple[str, ...], int]] = [(False, value, root, 0)]
    while stack:
        is_key, item, where, depth = stack.pop()
        if is_key:
            if not isinstance(item, str):
                return _render(where[:-1]), f"key {_shown(item)} is not a string"
            bad = _bad_text(item)
            if bad:
                return _render(where), f"key {bad}"
            continue
        why = _problem_here(item, depth)
        if why:
            return _render(where), why
        if isinstance(item, dict):
            for key, sub in reversed(list(item.items())):
                stack.append((False, sub, (*where, str(key)), depth + 1))
                stack.append((True, key, (*where, key), depth + 1))
        elif isinstance(item, list | tuple):
            for i in range(len(item) - 1, -1, -1):
                stack.append((False, item[i], (*where, str(i)), depth + 1))
    return None


def carried(value: Any, depth: int = 0) -> bool:
    """Quickly: whether strict JSON carries all of `value`, as `problem` would find. False for anything it is
    unsure of (a subclass of str, int, float, dict or list), where `problem` then looks closely. Its recursion
    is bounded: no container past MAX_DEPTH is looked into."""
    kind = type(value)
    if kind is str:
        return value.isascii() or _bad_text(value) is None
    if kind is dict:
        return depth < MAX_DEPTH and all(
            type(k) is str and (k.isascii() or _bad_text(k) is None) and carried(v, depth + 1)
            for k, v in value.items()
        )
    if kind is list or kind is tuple:
        return depth < MAX_DEPTH and all(carried(v, depth + 1) for v in value)
    if kind is float:
        return math.isfinite(value)
    if kind is int:
        return -_TOO_LONG_INT < value < _TOO_LONG_INT
    return value is None or kind is bool


def _problem_here(item: Any, depth: int) -> str | None:
    """What is wrong with this one value itself (not with what it holds)."""
    if isinstance(item, str):
        return _bad_text(item)
    if isinstance(item, bool) or item is None:
        return None
    if isinstance(item, int):
        return "an integer too long to write as JSON" if abs(item) >= _TOO_LONG_INT else None
    if isinstance(item, float):
        return (
            None
            if math.isfinite(item)
            else f"{item!r} is not a JSON number (NaN and Infinity have no JSON form)"
        )
    if isinstance(item, dict | list | tuple):
        return f"nested deeper than {MAX_DEPTH} levels" if depth >= MAX_DEPTH else None
    return f"a {type(item).__name__} is not a JSON value"


def _shown(item: Any) -> str:
    """A key's repr for a message, bounded; an object whose repr raises is named by its type."""
    try:
        text = repr(item)
    except Exception:
        return f"of type {type(item).__name__}"
    return text if len(text) <= 100 else text[:97] + "..."


def _render(parts: tuple[str, ...]) -> str:
    if not parts:
        return "value"
    return ".".join(p.encode("utf-8", "backslashreplace").decode("utf-8") for p in parts)


def _bad_text(text: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "holds a lone UTF-16 surrogate, which no UTF-8 text can carry"
    return None


def invalid_output(path: str, why: str, note: str = "") -> dict[str, Any]:
    """The error of a task whose report JSON cannot carry, naming where: `output.x: nan is not ...`.

    The path may hold the very key that was refused (a lone surrogate) or a long chain of keys: it is made
    printable and bounded here, so the error itself can always be sent.
    """
    path = readable(path, MAX_PATH_CHARS)
    return {
        "type": INVALID_OUTPUT,
        "message": readable(f"{path}: {why}{note}", MAX_MESSAGE_CHARS),
        "field": path,
    }


def readable(text: str, limit: int) -> str:
    """`text` as UTF-8 can carry it (a lone surrogate becomes `\\udc80`), cut to `limit` characters."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 3] + "..."
