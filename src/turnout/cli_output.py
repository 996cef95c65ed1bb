"""How the CLI shows things to a person: followed events, one-line task summaries, batch progress, error fixes.

Data a script wants goes to stdout (a task's text, its output, `--json`); everything meant for eyes (status
lines, progress bars, summaries) goes to stderr, so `turnout submit ... --follow > out.txt` keeps only text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from turnout.errors import (
    Conflict,
    Forbidden,
    InvalidInput,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    StorageFull,
    TurnoutError,
    Unauthorized,
    Unavailable,
)

BATCH = 1000  # the API's most tasks per batch submit


def fix_for(exc: TurnoutError) -> str:
    """The one thing to try next for an error the CLI shows."""
    if exc.field == "port":
        return "choose another --port, or stop what listens there"
    if exc.field == "host":
        return "give --host an address of this machine (127.0.0.1 for this host only, 0.0.0.0 for every interface)"
    if exc.field == "url":  # the URL is malformed, or what answers there is not a controller
        return "point TURNOUT_URL (or --controller) at a Turnout controller, e.g. http://127.0.0.1:8750"
    if isinstance(exc, StorageFull):
        return "free space on that disk, then start again"
    if exc.field == "db":
        return "--db takes sqlite:///PATH (restore a damaged file from a backup), postgresql://USER@HOST/DB of a server this host reaches, or memory://"
    if isinstance(exc, Unavailable):
        if "cannot reach" in exc.message:
            return "start it with `turnout up` (or `turnout controller`), or point TURNOUT_URL at it"
        return "the controller's storage is busy or full; retry in a few seconds"
    if isinstance(exc, Unauthorized):
        return (
            "set TURNOUT_TOKEN to a valid token (on the controller host: turnout token create --role submit)"
        )
    if isinstance(exc, Forbidden):
        return "use a token with that role (turnout token create --role ROLE)"
    if isinstance(exc, NotFound):
        return _not_found_fix(exc)
    if isinstance(exc, RateLimited):
        return f"wait {exc.retry_after_s:g} s and retry"
    if isinstance(exc, PayloadTooLarge):
        return (
            "send less, or have the controller's operator raise the limit it names "
            "(`turnout controller --request-limit NAME=VALUE`, or request_limits: in turnout.yaml)"
        )
    if isinstance(exc, InvalidInput):
        if CONFIG_ERROR.match(exc.message):  # turnout.yaml's errors begin with the file's name
            return "correct that key in the file (README: turnout.yaml), then start again"
        return "see `turnout COMMAND --help` for the accepted values"
    if isinstance(exc, Conflict):
        return "`turnout task ID` shows its current state"
    return "run `turnout doctor` to check this host and its controller"


CONFIG_ERROR = re.compile(r"^\S+\.ya?ml: ")


def _not_found_fix(exc: NotFound) -> str:
    """What to check for a 404, by what was not found (the message names it)."""
    message = exc.message.lower()
    if message.startswith(("pipeline run ", "run ")):
        return "check the run id that `turnout run` printed (another tenant's runs are not visible)"
    if message.startswith("pipeline "):
        return "`turnout run` takes a pipeline defined under pipelines: in the controller's turnout.yaml"
    if message.startswith("token "):
        return "check the id; `turnout token list` lists the tokens you may manage"
    if message.startswith("file "):
        return "check the id; files expire after the controller's file_retention_s"
    return "check the id; `turnout tasks` lists recent tasks (another tenant's tasks are not visible)"


def error_line(message: str, fix: str) -> str:
    one = " ".join(message.split())  # a server message with newlines still makes one line
    return f"error: {one} (fix: {fix})" if fix else f"error: {one}"


CONTROL_CHARACTERS = (*range(0x20), *range(0x7F, 0xA0))  # C0, DEL and C1: ESC and CSI among them
_KEEP_LINES = {c: " " for c in CONTROL_CHARACTERS if c not in (0x09, 0x0A)}
_ONE_LINE = dict.fromkeys(CONTROL_CHARACTERS, " ")


def terminal_safe(value: Any, *, one_line: bool = False) -> str:
    """What the controller sent (an error message, a worker's GPU name, a routing reason) as text a terminal
    only shows: its control characters as spaces, so no escape sequence in it can clear or retitle the user's
    terminal or forge lines. `one_line`: line breaks and tabs too (a table cell)."""
    return ("" if value is None else str(value)).translate(_ONE_LINE if one_line else _KEEP_LINES)


def summary(task: dict[str, Any]) -> str:
    """`succeeded in 0.012 s on cpu, worker local: no healthy gpu worker` or `failed (timeout: ...)`."""
    state = task.get("state", "?")
    where = task.get("device") or "no device"
    if task.get("gpu_model"):
        where += f" ({task['gpu_model']})"
    run = f" in {task['run_s']:.3f} s" if task.get("run_s") is not None else ""
    cost = f", ${task['cost_usd']:.6f}" if task.get("cost_usd") is not None else ""
    reason = (task.get("routing") or {}).get("reason")
    why = f": {reason}" if reason else ""
    head = f"{task.get('id', '')} {state}{run} on {where}{cost}{why}"
    error = task.get("error")
    if state != "succeeded" and error:
        head += f" [{error.get('type', 'error')}: {error.get('message', '')}]"
    return terminal_safe(head)


def task_table(task: dict[str, Any]) -> Table:
    """`turnout task ID` for a person: the fields that say where it ran and why, then input and output."""
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    routing = task.get("routing") or {}
    rows = [
        ("id", task.get("id")), ("capability", task.get("capability")), ("state", task.get("state")),
        ("device", (task.get("device") or "-") + (f" ({task['gpu_model']})" if task.get("gpu_model") else "")),
        ("routing", f"{routing.get('requested', '?')} -> {routing.get('device', '?')}: {routing.get('reason', '')}" if routing else "-"),
        ("worker", task.get("worker") or "-"), ("gpus", ", ".join(task.get("gpus") or []) or "-"),
        ("attempts", task.get("attempts")), ("queue_s", task.get("queue_s")), ("run_s", task.get("run_s")),
        ("cost_usd", task.get("cost_usd")), ("created_at", task.get("created_at")), ("finished_at", task.get("finished_at")),
        ("input", json.dumps(task.get("input"))), ("output", json.dumps(task.get("output"))),
        ("error", json.dumps(task["error"]) if task.get("error") else "-"),
    ]  # fmt: skip
    for name, value in rows:
        table.add_row(name, escape("-" if value is None else str(value)))
    return table


def follow(events: Iterable[dict[str, Any]], out: Console, err: Console) -> None:
    """Print a task's events as they come: text to stdout as it streams, everything else as status lines."""
    inline = False  # stdout holds a partial line of streamed text
    for event in events:
        kind = event.get("event")
        if kind == "text_delta":
            out.print(event.get("delta", ""), end="", markup=False, highlight=False, soft_wrap=True)
            inline = True
            continue
        if kind == "text":
            out.print(event.get("content", ""), markup=False, highlight=False, soft_wrap=True)
            inline = False
            continue
        if inline:
            out.print()
            inline = False
        line = _status_line(event)
        if line:
            err.print(line, highlight=False)
    if inline:
        out.print()


def _status_line(event: dict[str, Any]) -> str | None:
    kind = event.get("event")
    if kind == "progress":
        done, total = event.get("done"), event.get("total")
        pct = f" ({100 * done / total:.0f}%)" if isinstance(done, int | float) and total else ""
        return f"[dim]· progress {done}/{total}{pct}[/dim]"
    if kind == "worker":
        message = f": {escape(str(event['message']))}" if event.get("message") else ""
        return f"[dim]· {escape(str(event.get('status', 'worker')))}{message}[/dim]"
    if kind == "log":
        return (
            f"[dim]  {escape(str(event.get('stream', 'log')))} | {escape(str(event.get('line', '')))}[/dim]"
        )
    if kind in ("result", "finish", "connection"):
        return None  # the summary line after the stream says how it ended
    rest = {k: v for k, v in event.items() if k not in ("seq", "ts")}
    return f"[dim]· {escape(json.dumps(rest))}[/dim]"


def read_inputs(lines: Iterable[str], source: str) -> Iterator[Any]:
    """One task input per non-empty line of JSON; a bad line is an error naming the file and line."""
    for _, data in numbered_inputs(lines, source):
        yield data


def numbered_inputs(lines: Iterable[str], source: str) -> Iterator[tuple[int, Any]]:
    """(line number, input) for each non-empty line of JSON; a bad line is an error naming the file and line."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except ValueError as exc:
            raise InvalidInput(
                f"--inputs: {source} line {number} is not JSON ({exc})", field="inputs"
            ) from None


class PartlySubmitted(Exception):
    """A batch was refused after earlier ones were accepted: `submitted` holds those tasks (the caller shows
    their ids, so nothing runs unseen), `error` the refusal, said of the file's line."""

    def __init__(self, submitted: list[dict[str, Any]], error: TurnoutError) -> None:
        super().__init__(error.message)
        self.submitted = submitted
        self.error = error


def _of_line(exc: TurnoutError, start: int, lines: Sequence[int], source: str, sent: int) -> TurnoutError:
    """The refusal of the batch that began at spec `start`, said of the line of `source` it is about
    (`tasks.3.input: ...` -> `--inputs: FILE line 1204: input: ...`), and of what was already submitted."""
    message, field = exc.message, exc.field
    prefix, _, rest = (field or "").partition(".")
    index, _, inner = rest.partition(".")
    if prefix == "tasks" and index.isdigit() and start + int(index) < len(lines):
        message = f"line {lines[start + int(index)]}: " + message.removeprefix(f"tasks.{index}.")
        field = inner or None
    message = (
        f"--inputs: {source} {message}" if message.startswith("line ") else f"--inputs: {source}: {message}"
    )
    if sent:
        message += (f"; the {sent} inputs before it (lines {lines[0]}-{lines[sent - 1]}) were submitted, their "
                    "ids are on stdout: submit only the lines after them again")  # fmt: skip
    else:
        message += "; nothing was submitted"
    if isinstance(exc, RateLimited):
        return RateLimited(message, retry_after_s=exc.retry_after_s, field=field)
    try:
        return type(exc)(message, field=field)
    except TypeError:  # an error class with a constructor of its own
        return exc


def submit_many(
    client: Any,
    specs: Sequence[dict[str, Any]],
    err: Console,
    *,
    wait: bool,
    lines: Sequence[int] | None = None,
    source: str = "-",
) -> list[dict[str, Any]]:
    """Submit in batches of the API's limit with a progress bar; with `wait`, a second bar as tasks finish.

    A refused batch raises PartlySubmitted with the tasks accepted before it; its error names the line of
    `source` (`lines[i]` is spec i's line) that was refused, and which lines went."""
    lines = lines if lines is not None else range(1, len(specs) + 1)
    submitted: list[dict[str, Any]] = []
    with _progress(err) as bars:
        sending = bars.add_task("submitting", total=len(specs))
        for start in range(0, len(specs), BATCH):
            try:
                handles = client.submit_batch(list(specs[start : start + BATCH]))
            except TurnoutError as exc:
                raise PartlySubmitted(
                    submitted, _of_line(exc, start, lines, source, len(submitted))
                ) from None
            submitted += [h.task for h in handles]
            bars.advance(sending, len(handles))
        if not wait:
            return submitted
        finishing = bars.add_task("finished", total=len(submitted))
        done = []
        for t in submitted:
            done.append(client.task(t["id"]).result())
            bars.advance(finishing)
        return done


def _progress(err: Console) -> Progress:
    return Progress(TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err, transient=False)  # fmt: skip


def counts_line(tasks: Sequence[dict[str, Any]]) -> str:
    by_state: dict[str, int] = {}
    for t in tasks:
        by_state[t["state"]] = by_state.get(t["state"], 0) + 1
    return f"{len(tasks)} tasks: " + ", ".join(f"{n} {s}" for s, n in sorted(by_state.items()))
