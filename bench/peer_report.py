"""The peer bench's verdict: medians over repetitions, ratios against Ray and Celery, which aims are met.

Pure functions over the result dict `bench_peers.run` writes, so the arithmetic is tested without running
anything (tests/unit/test_peer_report.py). A system's entry is `{"reps": [rep, ...]}` or `{"skipped": why}`;
a rep is `{"bulk", "single", "latency", "quarter_gpu"?}` of `peer_measure` figures, or `{"error": why}`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

SYSTEMS = ("turnout", "celery", "ray")
LABELS = {"turnout": "Turnout (SQLite fsync'd, defaults)", "celery": "Celery (prefork -c 2, Redis)",
          "ray": "Ray (num_cpus=2, num_gpus=2)"}  # fmt: skip
VERDICT = {True: "yes", False: "NO", None: "not judged"}
# The figures of a row: name -> (phase, key) in each rep.
FIGURES = {
    "bulk_tasks_per_s": ("bulk", "tasks_per_s"),
    "single_tasks_per_s": ("single", "tasks_per_s"),
    "p50_ms": ("latency", "p50_ms"),
    "p99_ms": ("latency", "p99_ms"),
    "cpu_ms_per_task": ("bulk", "cpu_ms_per_task"),
    "client_cpu_ms_per_task": ("bulk", "client_cpu_ms_per_task"),
    "quarter_gpu_tasks_per_s": ("quarter_gpu", "tasks_per_s"),
    "quarter_gpu_default_tasks_per_s": ("quarter_gpu_default", "tasks_per_s"),  # Ray at max_calls=1
    "two_requests_p50_ms": ("latency_two_requests", "p50_ms"),  # Turnout's submit() then result()
    "httpx_transport_p50_ms": ("latency_httpx_transport", "p50_ms"),  # Client.run over httpx's own transport
}


@dataclass(frozen=True)
class Aim:
    """Turnout's figure against a peer's: met when turnout / peer is at least (or at most) `target`."""

    text: str
    figure: str
    peer: str
    target: float
    higher_is_better: bool

    def judge(self, rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
        mine, theirs = rows["turnout"].get(self.figure), rows[self.peer].get(self.figure)
        out: dict[str, Any] = {"aim": self.text, "turnout": mine, "peer": theirs, "target": self.target,
                               "ratio": None, "met": None}  # fmt: skip
        if mine is None or theirs is None or theirs == 0:
            out["why_not_judged"] = f"no figure from {'turnout' if mine is None else self.peer}"
            return out
        ratio = mine / theirs
        out["ratio"] = round(ratio, 2)
        out["met"] = (ratio >= self.target if self.higher_is_better else ratio <= self.target) and bool(
            rows["turnout"]["all_succeeded"]
        )
        return out


AIMS = (
    Aim("bulk tasks/s >= Ray's", "bulk_tasks_per_s", "ray", 1.0, True),
    Aim("one-by-one tasks/s >= Ray's", "single_tasks_per_s", "ray", 1.0, True),
    Aim("bulk tasks/s >= 3x Celery's", "bulk_tasks_per_s", "celery", 3.0, True),
    Aim("one-by-one tasks/s >= 3x Celery's", "single_tasks_per_s", "celery", 3.0, True),
    Aim("p50 submit-to-result <= Celery's", "p50_ms", "celery", 1.0, False),
    # Ray schedules from its driver (the owner of a task leases a worker from the raylet and pushes the task
    # to it), work Turnout's controller does: the client's CPU is part of the work, so the aim counts it; the
    # figure without it is judged beside it, as it was before (the client's share differs most there)
    Aim("CPU per task, client included <= Ray's", "total_cpu_ms_per_task", "ray", 1.0, False),
    Aim("CPU per task, client left out <= Ray's", "cpu_ms_per_task", "ray", 1.0, False),
    Aim("quarter-GPU tasks/s >= Ray's", "quarter_gpu_tasks_per_s", "ray", 1.0, True),
)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def row(entry: dict[str, Any]) -> dict[str, Any]:
    """One system's medians over its good repetitions, and whether every task of every phase succeeded."""
    if "skipped" in entry:
        return {"status": entry["skipped"], "all_succeeded": None}
    reps = [r for r in entry.get("reps", []) if "error" not in r]
    errors = [r["error"] for r in entry.get("reps", []) if "error" in r]
    out: dict[str, Any] = {"status": "ok" if reps else f"error: {errors[0] if errors else 'no repetition ran'}",
                           "reps": len(reps), "errors": errors}  # fmt: skip
    for name, (phase, key) in FIGURES.items():
        values = [r[phase][key] for r in reps if r.get(phase, {}).get(key) is not None]
        out[name] = _median(values)
    totals = [r["bulk"]["cpu_ms_per_task"] + r["bulk"]["client_cpu_ms_per_task"] for r in reps
              if r.get("bulk", {}).get("cpu_ms_per_task") is not None
              and r["bulk"].get("client_cpu_ms_per_task") is not None]  # fmt: skip
    total = _median(totals)
    out["total_cpu_ms_per_task"] = None if total is None else round(total, 3)
    by_role = [
        r["bulk"]["cpu_ms_per_task_by_role"] for r in reps if "cpu_ms_per_task_by_role" in r.get("bulk", {})
    ]
    if by_role:
        out["cpu_ms_per_task_by_role"] = {
            role: _median([b[role] for b in by_role if role in b]) for role in by_role[0]
        }
    phases = [p for r in reps for p in r.values() if isinstance(p, dict) and "all_succeeded" in p]
    out["all_succeeded"] = bool(phases) and not errors and all(p["all_succeeded"] for p in phases)
    versions = {r["version"] for r in reps if r.get("version")}
    out["version"] = versions.pop() if len(versions) == 1 else None
    return out


def summarize(systems: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Rows per system and each aim judged; a missing system makes its aims unjudged, never a crash."""
    rows = {name: row(systems.get(name, {"skipped": "not run"})) for name in SYSTEMS}
    return {"rows": rows, "aims": [aim.judge(rows) for aim in AIMS]}


def _num(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _cell_rate(value: float | None) -> str:
    return _num(value, 0 if value is None or value >= 100 else 1)


def _notes(rows: dict[str, dict[str, Any]]) -> list[str]:
    by_system = [f"{LABELS[name].split(' (')[0]}: " + ", ".join(f"{role} {_num(ms, 2)}" for role, ms in roles.items())
                 for name, r in rows.items() if (roles := r.get("cpu_ms_per_task_by_role"))]  # fmt: skip
    notes = [f"CPU per task by process tree, ms: {'; '.join(by_system)}."] if by_system else []
    two = rows["turnout"].get("two_requests_p50_ms")
    if two is not None:
        notes.append("Turnout's round trips are `Client.run` (one request: the submission answers once the task "
                     f"ended); as `submit()` then `result()`, two requests, alternated with them: p50 {_num(two, 2)} ms.")  # fmt: skip
    own = rows["turnout"].get("httpx_transport_p50_ms")
    if own is not None:
        notes.append(f"`Client.run` over httpx's own transport instead of Turnout's (`transport.py`), alternated with "
                     f"them: p50 {_num(own, 2)} ms.")  # fmt: skip
    default = rows["ray"].get("quarter_gpu_default_tasks_per_s")
    if default is not None:
        notes.append("Ray's quarter-GPU tasks reuse their workers (`max_calls=0`); at Ray's default for GPU tasks "
                     f"(`max_calls=1`, a new worker process per task) they ran {_cell_rate(default)} tasks/s.")  # fmt: skip
    return notes


def markdown(summary: dict[str, Any], preface: str = "") -> str:
    """The table of figures and the table of aims, as Markdown."""
    lines = [preface, ""] if preface else []
    lines += ["| system | bulk submit tasks/s | one-by-one tasks/s | p50 / p99 submit-to-result ms | "
              "CPU per task ms (client) | quarter-GPU tasks/s | every task succeeded |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in summary["rows"].items():
        label = LABELS[name] if not r.get("version") else LABELS[name].replace(" (", f" {r['version']} (", 1)
        if r["status"] != "ok":
            lines.append(f"| {label} | {r['status']} | | | | | |")
            continue
        cpu = f"{_num(r['cpu_ms_per_task'], 2)} ({_num(r['client_cpu_ms_per_task'], 2)})"
        quarter = "n/a" if name == "celery" else _cell_rate(r["quarter_gpu_tasks_per_s"])
        ok = ("yes" if r["all_succeeded"] else "NO") + f" ({r['reps']} reps)"
        lines.append(f"| {label} | {_cell_rate(r['bulk_tasks_per_s'])} | {_cell_rate(r['single_tasks_per_s'])} | "
                     f"{_num(r['p50_ms'], 2)} / {_num(r['p99_ms'], 2)} | {cpu} | {quarter} | {ok} |")  # fmt: skip
    notes = _notes(summary["rows"])
    if notes:
        lines += ["", *notes]
    lines += ["", "| aim | Turnout | peer | ratio | met |", "|---|---|---|---|---|"]
    for a in summary["aims"]:
        digits = 2 if "p50" in a["aim"] or "CPU" in a["aim"] else 0
        ratio = "-" if a["ratio"] is None else f"{a['ratio']:.2f}x"
        lines.append(f"| {a['aim']} | {_num(a['turnout'], digits)} | {_num(a['peer'], digits)} | {ratio} | "
                     f"{VERDICT[a['met']]} |")  # fmt: skip
    return "\n".join(lines) + "\n"
