"""Delivering a worker's reports to the controller: retried when the controller is away, never forever
because of what a report holds.

Answers sort in two. One about the controller or the network (5xx, 408, 429, 401/403/404, a dropped
connection) is retried with backoff and jitter, items kept and in order: the same body may be taken later. Any other
4xx (400, 413, 422, ...) is about the payload, so the batch is split in halves until each refused item
stands alone; each of those is replaced once by what the caller offers (a completion becomes an
`invalid_output` failure) or dropped, with an error in the log. The rest of the batch goes through.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from turnout.worker.reports import encode

log = logging.getLogger("turnout.worker")

# Answers that say nothing about the payload. A refused token or an unknown worker is the same for every
# body, so splitting cannot help; the heartbeat loop registers again on 404, and leasing stops meanwhile.
TRANSIENT_STATUS = frozenset({401, 403, 404, 408, 425, 429})
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0


@dataclass(frozen=True)
class Refusal:
    """Why an item was not delivered: the controller's answer, or (status None) a local encoding error."""

    status: int | None
    message: str
    field: str | None = None

    def describe(self) -> str:
        return f"{self.status}: {self.message}" if self.status is not None else self.message


Post = Callable[[bytes], Awaitable[httpx.Response]]
Replace = Callable[[dict[str, Any], Refusal], "dict[str, Any] | None"]


async def deliver(post: Post, key: str, items: list[dict[str, Any]], replace: Replace, what: str) -> None:
    """Post `{key: items}` until each item is stored, replaced (once) by `replace`, or dropped.

    Returns only then, so the caller may forget the items; raises nothing but CancelledError (and what
    `replace` raises). Order is kept: a first half goes before a second, a replacement where its item was.
    """
    pending: list[tuple[list[dict[str, Any]], bool]] = [(items, False)]  # (chunk, holds a replacement)
    while pending:
        chunk, replaced = pending.pop(0)
        refusal = await _post_until_answered(post, key, chunk, what)
        if refusal is None:
            continue
        if len(chunk) > 1:
            log.warning("%d %s were refused (%s); sending them in halves to find the refused ones",
                        len(chunk), what, refusal.describe())  # fmt: skip
            mid = len(chunk) // 2
            pending[0:0] = [(chunk[:mid], replaced), (chunk[mid:], replaced)]
            continue
        substitute = None if replaced else replace(chunk[0], refusal)
        if substitute is None:
            log.error("dropped one of %s for task %s: %s", what, chunk[0].get("task_id"), refusal.describe())
            continue
        log.error("one of %s for task %s was refused (%s); sending a failure in its place", what,
                  chunk[0].get("task_id"), refusal.describe())  # fmt: skip
        pending.insert(0, ([substitute], True))


async def _post_until_answered(
    post: Post, key: str, chunk: list[dict[str, Any]], what: str
) -> Refusal | None:
    """None once the controller stored the chunk; a Refusal when it, or the encoder, refused its content."""
    try:
        body = encode({key: chunk})
    except (ValueError, TypeError, RecursionError) as exc:  # checked when queued: a bug if it happens
        return Refusal(None, f"cannot be encoded as JSON: {type(exc).__name__}: {exc}")
    delay = FIRST_BACKOFF_S
    while True:
        try:
            resp = await post(body)
        except httpx.HTTPError as exc:
            log.warning("sending %d %s failed (%s); retrying in %.1f s", len(chunk), what, exc, delay)
        else:
            if resp.is_success:
                return None
            if resp.status_code < 500 and resp.status_code not in TRANSIENT_STATUS:
                return _refusal(resp)
            log.warning("sending %d %s: the controller answered %d; retrying in %.1f s", len(chunk), what,
                        resp.status_code, delay)  # fmt: skip
        await asyncio.sleep(
            delay * (0.5 + random.random() / 2)
        )  # jitter: a fleet cut off together spreads out
        delay = min(delay * 2, MAX_BACKOFF_S)


def _refusal(resp: httpx.Response) -> Refusal:
    """The controller's own words: `{"error": {"type", "message", "field"?}}`, else the start of the body."""
    try:
        error = resp.json()["error"]
        return Refusal(resp.status_code, str(error["message"]), error.get("field"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return Refusal(resp.status_code, resp.text[:500] or resp.reason_phrase)
