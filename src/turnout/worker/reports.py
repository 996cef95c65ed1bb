"""What a worker reports back (results and events), checked once before it is queued.

A report that JSON cannot carry (NaN, Infinity, a lone surrogate, a set, bytes, an object of some class)
must become a clear failure of its task, never an exception in a sender loop: one bad value used to stop
a worker's reporting for good, leaving every later task of that worker `running` while it heartbeated.
So the runner checks a handler's return value before writing it, the agent checks each completion and
event as it is queued, and `delivery` encodes strictly so nothing non-standard ever reaches the wire.

Pure functions only, and no HTTP client: warm handler processes import this module.
"""

from __future__ import annotations

import json
import re
from typing import Any

from turnout.jsonsafe import invalid_output, problem, readable

# The Python runner tags each line it writes with the number of the task it belongs to (the worker gives it in
# the task's line), first in the object, so a line a handler's thread writes after its task ended is known.
TASK_TAG = "turnout_seq"
EVENT_NAME = re.compile(r"[a-z][a-z0-9_.-]{0,63}\Z")
# written by the runner for a handler's return, never emitted by a handler
PROTOCOL_EVENTS = frozenset({"result", "finish"})


def event_name_problem(name: object) -> str | None:
    """Why `name` cannot name an event (None when it can): a short lower-case identifier, as the events
    stream writes it in its `event:` line. The reason quotes the name bounded and printable."""
    if isinstance(name, str) and EVENT_NAME.match(name):
        return None
    shown = readable(repr(name), 80) if isinstance(name, str) else f"of type {type(name).__name__}"
    return f"event name {shown} is not a short identifier (a-z first, then a-z, 0-9, _ . -; 64 at most)"


class InvalidOutput(ValueError):
    """Raised in a handler by `ctx.emit` for an event JSON cannot carry; its task fails `invalid_output`."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path = path
        self.why = why


def encode(body: Any) -> bytes:
    """Strict JSON in UTF-8: ValueError on NaN/Infinity, on a lone surrogate (UnicodeEncodeError) and on an
    int longer than Python will print; TypeError on what has no JSON form."""
    return json.dumps(body, allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def checked_completion(completion: dict[str, Any]) -> dict[str, Any]:
    """The completion as it may be sent: unchanged when JSON can carry all of it, else a failure.

    An unencodable `output` fails the task with `invalid_output` naming the path. An unencodable `error`
    (a program's own failure report) is replaced by an `invalid_output` error that still names the type it
    reported, so the user learns both that it failed and why its report was lost. Any other field (the
    worker's own, or one added later) is checked by name the same way.
    """
    where = problem(completion.get("output"), "output")
    if where is not None:
        return _failed(completion, invalid_output(*where))
    where = problem(completion.get("error"), "error")
    if where is not None:
        reported = (completion.get("error") or {}).get("type")
        known = isinstance(reported, str) and problem(reported) is None
        return _failed(
            completion, invalid_output(*where, f" (the task failed with type {reported!r})" if known else "")
        )
    for key, value in completion.items():
        if key not in ("output", "error") and (where := problem(value, key)) is not None:
            return _failed(completion, invalid_output(*where))
    return completion


def _failed(completion: dict[str, Any], error: dict[str, Any]) -> dict[str, Any]:
    return {**completion, "status": "failed", "output": None, "error": error}


def event_problem(event: dict[str, Any], n: int) -> tuple[str, str] | None:
    """Where JSON cannot carry the `n`th event (1-based) of an attempt: (`events.4.done`, why), or None."""
    where = problem(event, f"events.{n}")
    if where is None:
        return None
    kind = event.get("event")
    what = f"a {kind!r} event" if isinstance(kind, str) and problem(kind) is None else "an event"
    return where[0], f"{where[1]} ({what}, the {_ordinal(n)} this attempt emitted)"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def with_event_failure(completion: dict[str, Any], error: dict[str, Any] | None) -> dict[str, Any]:
    """A succeeded completion fails with `error` when one of its events could not be carried.

    A task whose stream lost an event did not report all it produced, so it must not read as succeeded
    (a follower would trust an incomplete stream). It runs to its end all the same: its process is
    healthy and may be warm, and killing it would cost a model load for a fault in one value. A task that
    failed on its own keeps its own error, which says more about how it ended (and keeps a retryable type
    such as `gpu_oom` retryable).
    """
    if error is None or completion.get("status") != "succeeded":
        return completion
    return _failed(completion, error)


def refused_completion(completion: dict[str, Any], status: int | None, message: str,
                       field: str | None) -> dict[str, Any]:  # fmt: skip
    """What to send in place of a completion that was refused (`status` None: it could not be encoded).

    Only the fields a failure needs, so the replacement cannot be refused for the same reason.
    """
    where = problem(completion)
    if where is not None:
        error = invalid_output(*where)
    else:
        said = f"{status}: {message}" if status is not None else message
        error = invalid_output((field or "").removeprefix("results.0.") or "output",
                               f"the controller refused this task's result ({said})")  # fmt: skip
    return {"task_id": completion.get("task_id"), "attempt": completion.get("attempt"), "status": "failed",
            "output": None, "error": error}  # fmt: skip
