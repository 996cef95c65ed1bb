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


def problem(value: Any, path: str = "") -> tuple[str, str] | None:
    """The first place in `value` that strict JSON cannot carry, as (path, why); None when all is well.

    Paths read as users write them: `output.items.3.score`. Walks iteratively: a hostile value may be deep.
    """
    stack: list[tuple[Any, str, int]] = [(value, path, 0)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, str):
            why = _bad_text(item)
            if why:
                return where or "value", why
        elif isinstance(item, bool) or item is None or isinstance(item, int):
            continue
        elif isinstance(item, float):
            if not math.isfinite(item):
                return where or "value", f"{item!r} is not a JSON number (NaN and Infinity have no JSON form)"
        elif isinstance(item, dict):
            if depth >= MAX_DEPTH:
                return where or "value", f"nested deeper than {MAX_DEPTH} levels"
            for key, sub in reversed(list(item.items())):
                if not isinstance(key, str):
                    return where or "value", f"key {key!r} is not a string"
                sub_path = f"{where}.{key}" if where else key
                why = _bad_text(key)
                if why:
                    return sub_path, f"key {why}"
                stack.append((sub, sub_path, depth + 1))
        elif isinstance(item, list | tuple):
            if depth >= MAX_DEPTH:
                return where or "value", f"nested deeper than {MAX_DEPTH} levels"
            for i in range(len(item) - 1, -1, -1):
                stack.append((item[i], f"{where}.{i}" if where else str(i), depth + 1))
        else:
            return where or "value", f"a {type(item).__name__} is not a JSON value"
    return None


def _bad_text(text: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "holds a lone UTF-16 surrogate, which no UTF-8 text can carry"
    return None
