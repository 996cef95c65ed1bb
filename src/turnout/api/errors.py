"""The one table from error classes to HTTP status codes, and the handlers that render them."""

from __future__ import annotations

import logging
import math
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from turnout.api.schemas import field_of
from turnout.api.service import storage_unavailable
from turnout.errors import HTTP_STATUS, InvalidInput, RateLimited, StorageUnavailable, TurnoutError
from turnout.store.sql import is_storage_failure

log = logging.getLogger("turnout.api")


def error_response(exc: TurnoutError) -> JSONResponse:
    status = next((code for cls, code in HTTP_STATUS.items() if isinstance(exc, cls)), 500)
    retry_after_s = exc.retry_after_s if isinstance(exc, RateLimited | StorageUnavailable) else None
    # whole seconds, never less than the wait (HTTP allows no fraction); a 429's body says it exactly
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if retry_after_s is not None else None
    body = {k: _utf8(v) if isinstance(v, str) else v for k, v in exc.to_dict().items()}
    return JSONResponse({"error": body}, status_code=status, headers=headers)


def _utf8(text: str) -> str:
    """Text a response can carry: an error that quotes a client's bad string must not fail to render."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def install(app: FastAPI) -> None:
    @app.exception_handler(TurnoutError)
    async def _turnout(_: Request, exc: TurnoutError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        field = field_of(tuple(first.get("loc", ())))
        kind = first.get("type", "")
        msg = "unknown field" if kind == "extra_forbidden" else first.get("msg", "invalid")
        if kind == "json_invalid":
            msg, field = "request body is not valid JSON", "body"
        return error_response(InvalidInput(f"{field or 'body'}: {msg}", field=field or "body"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(
            {"error": {"type": kind, "message": str(exc.detail)}}, status_code=exc.status_code
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return unexpected_response(exc)


def unexpected_response(exc: Exception) -> JSONResponse:
    """A failure no route expected: a database failure is a 503, anything else a JSON 500. Neither says what
    failed: an exception's text may hold SQL and its parameters (another tenant's ids, a constraint's name),
    so the answer gives a reference to the controller's log line, where the whole traceback is."""
    if is_storage_failure(exc):  # a database failure outside Service.call/read
        return error_response(storage_unavailable(exc))
    ref = secrets.token_hex(4)
    log.exception("unexpected error (reference %s)", ref)
    message = f"internal error, reference {ref}: the controller's log has what failed"
    return JSONResponse({"error": {"type": "internal", "message": message}}, status_code=500)
