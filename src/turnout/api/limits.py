"""Request size limits, enforced as the body streams in: no request is ever read whole to be refused.

A body whose `Content-Length` is over its route's limit is answered 413 at once, before a byte of it is
read; a body without one (chunked) is counted as it arrives and answered 413 at the first chunk past the
limit. The application then sees the client as gone, so it stops reading too, and the server discards the
rest of the upload unread. Either way the controller holds at most one limit's worth of one request, and its
event loop stays free for the heartbeats that keep healthy workers healthy.

Each route has one limit (`RequestLimits`, settable): worker batches and batch submits may be larger than
anything else.
"""

from __future__ import annotations

import json
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from turnout.config import RequestLimits, describe_bytes

_WORKER_BATCH = re.compile(r"^/v1/workers/[^/]+/(events|complete)$")
_FILE_UPLOAD = re.compile(r"^/v1/(workers/[^/]+/)?files$")  # a user's upload, or a worker's task output


FILE_SLACK_BYTES = 64 * 1024  # multipart boundaries and part headers around a file of max_file_bytes


def body_limit_of(limits: RequestLimits, path: str, content_type: str = "") -> str:
    """The name of the limit that bounds a request body on `path` (with its `content_type`).

    A file upload's bytes are streamed to disk, not parsed as JSON, so they have their own, larger limit;
    a JSON body sent there is held whole like any other and keeps the JSON limit."""
    if _FILE_UPLOAD.match(path) and not _json_or_none(content_type):
        return "max_file_bytes"
    if path == "/v1/tasks/batch":
        return "max_batch_body_bytes"
    if _WORKER_BATCH.match(path):
        return "max_worker_body_bytes"
    return "max_body_bytes"


class BodyLimit:
    """ASGI middleware: a 413 `payload_too_large` for a body over its route's limit, decided while it streams."""

    def __init__(self, app: ASGIApp, limits: RequestLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        name = body_limit_of(self.limits, scope["path"], _header(scope, b"content-type"))
        limit: int = getattr(self.limits, name) + (FILE_SLACK_BYTES if name == "max_file_bytes" else 0)
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _refuse(send, self.limits, name, f"{describe_bytes(declared)} declared")
            return
        received = 0
        over = answered = started = False

        async def counted_receive() -> Message:
            nonlocal received, over, answered
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    over = True  # the app stops reading: from now on the client is gone to it
                    if not started:
                        answered = True
                        await _refuse(send, self.limits, name, f"more than {describe_bytes(limit)} sent")
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if answered:
                return  # the 413 is the answer; what the app says after its client "left" goes nowhere
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except Exception:
            if not over:
                raise  # an app that failed because its client "left" is nobody's error


def _json_or_none(content_type: str) -> bool:
    kind = content_type.split(";", 1)[0].strip().lower()
    return not kind or kind == "application/json" or kind.endswith("+json")


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", ()):
        if key == name:
            return str(value.decode("latin-1"))
    return ""


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", ()):
        if key == b"content-length":
            text = value.decode("latin-1").strip()
            return int(text) if text.isdigit() else None  # a malformed one is the server's to refuse
    return None


async def _refuse(send: Send, limits: RequestLimits, name: str, what: str) -> None:
    message = f"request body too large ({what}); {limits.describe(name)}"
    body = json.dumps({"error": {"type": "payload_too_large", "message": message}}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})
