"""One error tree for all of Turnout.

    TurnoutError                     base; `type` is the wire name in {"error": {"type": ...}}
     ├── InvalidInput                bad user input; `field` names what was wrong (HTTP 422)
     ├── NotFound                    no such object, or not visible to this tenant (HTTP 404)
     ├── Unauthorized                missing or unknown token (HTTP 401)
     ├── Forbidden                   token lacks the role (HTTP 403)
     ├── Conflict                    state does not allow it, e.g. a late result (HTTP 409)
     │    └── IdempotencyConflict    an idempotency_key reused for a different request; `index`, `task_id`
     ├── PayloadTooLarge             a request over a size limit; the message names the limit (HTTP 413)
     ├── RateLimited                 too many requests; `retry_after_s` (HTTP 429)
     └── Unavailable                 a dependency is down (HTTP 503)
          └── StorageUnavailable     the database cannot take the change (disk full, unreachable); nothing of
                                     the request was kept; `retry_after_s` (HTTP 503 with Retry-After)

The API maps classes to status codes in one table (`api/errors.py`); nothing else decides codes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any


class TurnoutError(Exception):
    type = "error"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type, "message": self.message}
        if self.field:
            out["field"] = self.field
        return out


class InvalidInput(TurnoutError):
    type = "invalid_input"


def number(
    value: Any,
    at: str,
    expected: str,
    valid: Callable[[float], bool] = lambda _: True,
    *,
    field: str | None = None,
) -> float:
    """`value` as a float where it is a real, finite number (not a bool, not NaN) that `valid` takes; else an
    InvalidInput `{at}: expected {expected}, got {value!r}`, naming `field` (default: `at`)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not valid(value)
    ):
        raise InvalidInput(f"{at}: expected {expected}, got {value!r}", field=field or at)
    return float(value)


class NotFound(TurnoutError):
    type = "not_found"


class Unauthorized(TurnoutError):
    type = "unauthorized"


class Forbidden(TurnoutError):
    type = "forbidden"


class Conflict(TurnoutError):
    type = "conflict"


class IdempotencyConflict(Conflict):
    """An idempotency_key already names a task that asked for something else: returning that task would
    silently drop this request, so it is refused. `index` is the request's position in its batch."""

    def __init__(self, key: str, task_id: str, *, index: int = 0, field: str = "idempotency_key",
                 earlier: int | None = None, earlier_field: str | None = None) -> None:  # fmt: skip
        # `earlier`: the key came first at that position of the same batch, whose task is never made
        said = (f"is also {earlier_field or f'the key of item {earlier}'} in this batch, with a different body"
                if earlier is not None else f"already names task {task_id}, submitted with a different body")  # fmt: skip
        super().__init__(f"{field}: {key!r} {said}; use a new key for a new request", field=field)
        self.key = key
        self.task_id = task_id
        self.index = index
        self.earlier = earlier


class PayloadTooLarge(TurnoutError):
    """A request (or a part of one: a task's input, its labels, an event batch) over a configured limit.

    Its message names the limit as it is set (`limit 8 MiB (max_body_bytes)`), so a user knows what to change.
    """

    type = "payload_too_large"


class RateLimited(TurnoutError):
    type = "rate_limited"

    def __init__(self, message: str, *, retry_after_s: float, field: str | None = None) -> None:
        super().__init__(message, field=field)
        self.retry_after_s = retry_after_s

    def after(self, held_s: float) -> RateLimited:
        """The same refusal answered `held_s` later: that much less to wait."""
        return RateLimited(
            self.message, retry_after_s=max(0.0, self.retry_after_s - held_s), field=self.field
        )

    def to_dict(self) -> dict[str, Any]:
        # the header says whole seconds (HTTP allows no less); the body says exactly, for clients that can wait less
        return {**super().to_dict(), "retry_after_s": round(self.retry_after_s, 3)}


class Unavailable(TurnoutError):
    type = "unavailable"


class StorageFull(Unavailable):
    """The database's disk has no room for a write it must make before it can serve (opening it migrates)."""


class StorageUnavailable(Unavailable):
    """The database refused or lost a write, so nothing of the request is durable: the caller may retry as is.

    Its message never carries SQL or driver text (that goes to the controller's log).
    """

    type = "storage_unavailable"

    def __init__(self, message: str, *, retry_after_s: float = 5.0, field: str | None = None) -> None:
        super().__init__(message, field=field)
        self.retry_after_s = retry_after_s


def read_user_file(path: Path, flag: str) -> str:
    """The text of a file the user named with `flag` (`--config`, `--presets`, ...). A missing, unreadable or
    non-UTF-8 file is an InvalidInput naming the flag and the file, never a traceback."""
    field = flag.lstrip("-")
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidInput(f"{flag}: cannot read {path} ({exc.strerror or exc})", field=field) from None
    except UnicodeDecodeError as exc:
        raise InvalidInput(
            f"{flag}: {path} is not UTF-8 text ({exc.reason} at byte {exc.start})", field=field
        ) from None


# The one table from error classes to HTTP status codes: the API renders with it, the client reads it back.
HTTP_STATUS: dict[type[TurnoutError], int] = {
    InvalidInput: 422,
    NotFound: 404,
    Unauthorized: 401,
    Forbidden: 403,
    Conflict: 409,
    PayloadTooLarge: 413,
    RateLimited: 429,
    Unavailable: 503,
}
