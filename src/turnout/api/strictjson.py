"""Request bodies parsed as strict JSON: what cannot be served back is refused where it enters.

Python's `json.loads` takes `NaN`, `Infinity`, numbers that overflow to infinity (`1e400`) and lone UTF-16
surrogates (`"\\ud800"`); none of them can be written back as JSON that browsers, Go or PostgreSQL accept,
so a task holding one would answer 500 on every read and break listings and leases for everyone. Here they
are a 422 naming the field (`tasks.1.input.x`), before any handler runs.

Every JSON route goes through `StrictJsonRoute`; a router of its own must use it too
(`APIRouter(route_class=StrictJsonRoute)`). Routes that read the body by hand call `json_body`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from turnout.errors import InvalidInput
from turnout.jsonsafe import MAX_DEPTH, MAX_INT_DIGITS, problem

# A lone surrogate can only come in as an escape (the body is UTF-8): a body that has one (valid pairs match too)
# is walked value by value. Numbers JSON cannot carry are caught as they are parsed, and deep nesting by a
# count of brackets first: a body with no more than MAX_DEPTH of them cannot nest deeper.
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


class _Suspect(ValueError):
    """The parser met a value JSON cannot carry (NaN, an overflow, a huge integer): find where."""


def _suspect(_: str) -> Any:
    raise _Suspect


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # a number too large for a float: `1e400`, or 400 digits
        raise _Suspect
    return value


def _short_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Suspect
    return int(text)


def strict_loads(raw: bytes) -> Any:
    """Parse a request body as strict JSON (UTF-8); raise InvalidInput naming the first field it cannot carry.

    One pass of the C parser in the common case: the hooks see only floats (few) and, in a body long enough
    to hold a too-long one, integers."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"body: not UTF-8 text (byte {exc.start})", field="body") from None
    try:
        value, suspect = _parse(text, _WATCHFUL if len(text) > MAX_INT_DIGITS else _QUICK), False
    except _Suspect:
        value, suspect = _parse(text, _PLAIN), True
    if (
        suspect
        or ("\\u" in text and _SURROGATE.search(text))
        or (text.count("[") + text.count("{") > MAX_DEPTH and _too_deep(value))
    ):
        found = problem(value)
        if found is not None:
            # a key that holds a lone surrogate is in the path too: escaped, so the answer can carry it
            path = found[0].encode("utf-8", "backslashreplace").decode("utf-8")
            raise InvalidInput(f"{path}: {found[1]}", field=path)
    return value


_QUICK = json.JSONDecoder(parse_constant=_suspect, parse_float=_finite)
# a body long enough to hold a too-long integer: each integer is looked at too
_WATCHFUL = json.JSONDecoder(parse_constant=_suspect, parse_float=_finite, parse_int=_short_int)
_PLAIN = json.JSONDecoder()


def _parse(text: str, decoder: json.JSONDecoder) -> Any:
    try:
        return decoder.decode(text)
    except _Suspect:
        raise
    except RecursionError:
        raise InvalidInput(f"body: nested deeper than {MAX_DEPTH} levels", field="body") from None
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"body: not valid JSON: {exc}", field="body") from None
    except ValueError:  # an integer longer than Python converts (4300 digits)
        raise InvalidInput("body: holds an integer too long to be a number", field="body") from None


def _too_deep(value: Any) -> bool:
    """Whether containers nest deeper than MAX_DEPTH: one level at a time, cheap on wide, shallow bodies."""
    level = [value]
    for _ in range(MAX_DEPTH):
        below: list[Any] = []
        for item in level:
            children = item.values() if type(item) is dict else item if type(item) is list else ()
            below += [c for c in children if type(c) is dict or type(c) is list]
        if not below:
            return False
        level = below
    return True


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return True
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


class StrictJsonRoute(APIRoute):
    """A route whose JSON body is parsed by `strict_loads` before FastAPI sees it, and whose path and query
    parameters hold no NUL (PostgreSQL text cannot, so a lookup by one would fail as a server error)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            for name, value in [*request.path_params.items(), *request.query_params.items()]:
                if isinstance(value, str) and "\x00" in value:  # no id or name holds one; PostgreSQL cannot
                    raise InvalidInput(f"{name}: holds a NUL character", field=name)
            wants_json = request.method in ("POST", "PUT", "PATCH") and _is_json(
                request.headers.get("content-type")
            )
            if wants_json and await request.body():
                await json_body(request)
            return await handler(request)

        return strict


async def json_body(request: Request) -> Any:
    """The request's body parsed by `strict_loads`, once: for routes that read their body by hand, too."""
    # Starlette keeps a parsed body in `_json`, and FastAPI reads it from there: nobody parses it leniently.
    if not hasattr(request, "_json"):
        request._json = strict_loads(await request.body())
    return request._json
