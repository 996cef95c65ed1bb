"""One error tree for all of Turnout.

    TurnoutError                     base; `type` is the wire name in {"error": {"type": ...}}
     ├── InvalidInput                bad user input; `field` names what was wrong (HTTP 422)
     ├── NotFound                    no such object, or not visible to this tenant (HTTP 404)
     ├── Unauthorized                missing or unknown token (HTTP 401)
     ├── Forbidden                   token lacks the role (HTTP 403)
     ├── Conflict                    state does not allow it, e.g. a late result (HTTP 409)
     ├── RateLimited                 too many requests; `retry_after_s` (HTTP 429)
     └── Unavailable                 a dependency is down (HTTP 503)

The API maps classes to status codes in one table (`api/errors.py`); nothing else decides codes.
"""

from __future__ import annotations

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


class NotFound(TurnoutError):
    type = "not_found"


class Unauthorized(TurnoutError):
    type = "unauthorized"


class Forbidden(TurnoutError):
    type = "forbidden"


class Conflict(TurnoutError):
    type = "conflict"


class RateLimited(TurnoutError):
    type = "rate_limited"

    def __init__(self, message: str, *, retry_after_s: float, field: str | None = None) -> None:
        super().__init__(message, field=field)
        self.retry_after_s = retry_after_s

    def to_dict(self) -> dict[str, Any]:
        # the header says whole seconds (HTTP allows no less); the body says exactly, for clients that can wait less
        return {**super().to_dict(), "retry_after_s": round(self.retry_after_s, 3)}


class Unavailable(TurnoutError):
    type = "unavailable"


# The one table from error classes to HTTP status codes: the API renders with it, the client reads it back.
HTTP_STATUS: dict[type[TurnoutError], int] = {
    InvalidInput: 422,
    NotFound: 404,
    Unauthorized: 401,
    Forbidden: 403,
    Conflict: 409,
    RateLimited: 429,
    Unavailable: 503,
}
