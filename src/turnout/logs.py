"""Log lines a machine can read: `--log-format json|text`, with task and worker ids as their own fields.

Ids reach a record three ways, first that has one wins:
- `extra={"task_id": ..., "worker_id": ...}` at the call site;
- an argument of the message that is a task or worker id (`log.warning("stopping task %s", task_id)`):
  ids have one shape (`t_` or `w_` and 24 hex digits, see `controller.new_id`), so a line that names one is
  about it, and no call site can forget to say so;
- `set_worker(getter)` once per worker process: every line a worker writes is about that worker.

A line about no task and no worker carries neither field, rather than an empty one.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Callable
from typing import Any

from turnout.errors import InvalidInput

LOG_FORMATS = ("text", "json")
_ID = re.compile(r"^[tw]_[0-9a-f]{24}$")
_WORKER: Callable[[], str | None] = lambda: None  # noqa: E731 - replaced per worker process
# attributes every LogRecord has; anything else on a record came from `extra=` and goes into the JSON line
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


def set_worker(getter: Callable[[], str | None]) -> None:
    """This process is a worker: `getter()` gives its id once registered (None before)."""
    global _WORKER
    _WORKER = getter


class IdsFilter(logging.Filter):
    """Puts `task_id` and `worker_id` on every record that has them, from `extra`, the context, or the process."""

    def filter(self, record: logging.LogRecord) -> bool:
        named = _ids_in(record.args)
        if getattr(record, "task_id", None) is None:
            record.task_id = named.get("t_")
        if getattr(record, "worker_id", None) is None:
            record.worker_id = named.get("w_") or _WORKER()
        return True


def _ids_in(args: Any) -> dict[str, str]:
    """The first task id and worker id among a record's arguments."""
    found: dict[str, str] = {}
    for arg in args if isinstance(args, tuple) else ():
        if isinstance(arg, str) and _ID.match(arg):
            found.setdefault(arg[:2], arg)
    return found


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (ISO 8601 UTC), level, logger, msg, the ids, any `extra`, and exc."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": _iso(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and value is not None:
                line[key] = value if isinstance(value, str | int | float | bool) else str(value)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    """`2026-01-01T12:00:00.123Z WARNING turnout.worker: message task=t_... worker=w_...`."""

    def format(self, record: logging.LogRecord) -> str:
        ids = "".join(
            f" {name}={value}"
            for name, value in (
                ("task", getattr(record, "task_id", None)),
                ("worker", getattr(record, "worker_id", None)),
            )
            if value
        )
        text = f"{_iso(record.created)} {record.levelname} {record.name}: {record.getMessage()}{ids}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def check_format(fmt: str) -> str:
    if fmt not in LOG_FORMATS:
        raise InvalidInput(
            f"--log-format: {fmt!r} is not one of {', '.join(LOG_FORMATS)}", field="log-format"
        )
    return fmt


def configure(fmt: str = "text", *, verbose: bool = False) -> None:
    """Send Turnout's logs to stderr in `fmt`; INFO and up with `verbose`, else WARNING and up."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if check_format(fmt) == "json" else TextFormatter())
    handler.addFilter(IdsFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"
