"""What `turnout run` and `turnout demo` show of a pipeline run: a live stage table, then the bill.

The live table redraws on stderr (where a terminal is) as the run moves; the cost table at the end goes to
stdout, so `turnout run ... > bill.txt` keeps the bill and not the animation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from turnout.cli_output import terminal_safe

STATE_STYLE = {"succeeded": "green", "failed": "red", "cancelled": "yellow", "running": "cyan", "leased": "cyan",
               "queued": "white", "pending": "dim"}  # fmt: skip


def _s(x: float | None) -> str:
    return "" if x is None else f"{x:.3f}"


def usd(x: float | None) -> str:
    return "-" if x is None else f"${x:.6f}"


def _cell(value: Any) -> Text:
    """A value the controller sent, shown as plain text: never read as rich markup (a `[/x]` in a worker's GPU
    name or a reason raised MarkupError, and the run's display died), control characters as spaces (an ESC
    sequence there could clear or retitle the user's terminal)."""
    return Text(terminal_safe(value, one_line=True))


def stage_table(run: dict[str, Any]) -> Table:
    """Each stage: its state, where it ran, and how long it queued, cold-started and ran."""
    table = Table(title=_cell(f"{run['pipeline']} {run['id']}: {run['state']}"), title_justify="left")
    for col in ("#", "stage", "state", "device", "gpu model", "queue s", "cold s", "run s", "why there"):
        table.add_column(col, justify="right" if col.endswith(" s") or col == "#" else "left")
    for st in run["stages"]:
        state = _cell(st["state"])
        state.stylize(STATE_STYLE.get(st["state"], ""))
        table.add_row(str(st["index"] + 1), _cell(st["capability"]), state, _cell(st["device"]),
                      _cell(st["gpu_model"]), _s(st["queue_s"]), _s(st["cold_start_s"]), _s(st["run_s"]),
                      _cell(st.get("reason")))  # fmt: skip
    return table


def cost_table(run: dict[str, Any]) -> Table:
    """The bill: each stage's device, seconds and cost; the total against running every stage on the GPU."""
    table = Table(title="cost", title_justify="left")
    for col in ("stage", "device", "worker", "seconds", "cost", "on the GPU"):
        table.add_column(col, justify="right" if col in ("seconds", "cost", "on the GPU") else "left")
    for st in run["stages"]:
        seconds = (st["run_s"] or 0.0) + (st["cold_start_s"] or 0.0) if st["run_s"] is not None else None
        table.add_row(_cell(st["capability"]), _cell(st["device"]), _cell((st["worker"] or "")[:16]), _s(seconds),
                      usd(st["cost_usd"]), "")  # fmt: skip
    table.add_row("total", "", "", _s(run.get("run_s")), usd(run.get("cost_usd")), usd(run.get("gpu_only_cost_usd")),
                  style="bold")  # fmt: skip
    return table


def saving_line(run: dict[str, Any]) -> str:
    cost, gpu_only = run.get("cost_usd"), run.get("gpu_only_cost_usd")
    if cost is None or not gpu_only:
        return "no prices configured: add prices: to turnout.yaml to see what each stage cost"
    pct = 100 * (1 - cost / gpu_only)
    return f"cost {usd(cost)} against {usd(gpu_only)} with every stage on the GPU: {pct:.0f}% saved"


def follow_run(fetch: Callable[[float], dict[str, Any]], run: dict[str, Any], err: Console) -> dict[str, Any]:
    """Redraw the stage table as the run moves; `fetch(wait_s)` reads the run, waiting up to wait_s for a change."""
    with Live(stage_table(run), console=err, refresh_per_second=8, transient=False) as live:
        while run["state"] == "running":
            run = fetch(0.25)
            live.update(Group(stage_table(run)))
            time.sleep(0.05)
    return run
