"""The one table from error classes to HTTP status codes, and the handlers that render them."""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from turnout.api.schemas import field_of
from turnout.errors import HTTP_STATUS, InvalidInput, RateLimited, TurnoutError

log = logging.getLogger("turnout.api")

STATUS = HTTP_STATUS


def error_response(exc: TurnoutError) -> JSONResponse:
    status = next((code for cls, code in STATUS.items() if isinstance(exc, cls)), 500)
    headers = (
        {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))} if isinstance(exc, RateLimited) else None
    )
    return JSONResponse({"error": exc.to_dict()}, status_code=status, headers=headers)


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
        log.exception("unexpected error")
        return JSONResponse(
            {"error": {"type": "internal", "message": f"{type(exc).__name__}: {exc}"}}, status_code=500
        )
