"""The peer bench's verdict (bench/peer_report.py) from a given result, and its rows for peers not installed."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from bench import bench_peers
from bench.peer_measure import CpuMeter
from bench.peer_report import markdown, row, summarize


def rep(bulk: float, single: float, p50: float, cpu: float, quarter: float | None = None, *,
        ok: bool = True, version: str | None = None) -> dict[str, Any]:  # fmt: skip
    out: dict[str, Any] = {
        "bulk": {"tasks_per_s": bulk, "cpu_ms_per_task": cpu, "client_cpu_ms_per_task": cpu / 10,
                 "all_succeeded": ok},
        "single": {"tasks_per_s": single, "all_succeeded": True},
        "latency": {"p50_ms": p50, "p99_ms": 2 * p50, "all_succeeded": True},
    }  # fmt: skip
    if quarter is not None:
        out["quarter_gpu"] = {"tasks_per_s": quarter, "all_succeeded": True}
    if version:
        out["version"] = version
    return out


def aims_by_text(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {a["aim"]: a for a in summary["aims"]}


def test_row_takes_the_median_of_each_figure_over_repetitions() -> None:
    entry = {
        "reps": [rep(100, 90, 10.0, 5.0, 300), rep(300, 70, 30.0, 1.0, 100), rep(200, 80, 20.0, 3.0, 200)]
    }

    r = row(entry)

    assert (r["bulk_tasks_per_s"], r["single_tasks_per_s"], r["p50_ms"], r["p99_ms"]) == (200, 80, 20.0, 40.0)
    assert (r["cpu_ms_per_task"], r["quarter_gpu_tasks_per_s"], r["reps"]) == (3.0, 200, 3)
    assert r["all_succeeded"] is True and r["status"] == "ok"


def test_a_failed_repetition_is_left_out_of_the_medians_and_marks_the_row() -> None:
    entry = {
        "reps": [
            rep(100, 90, 10.0, 5.0),
            {"error": "RuntimeError: controller exited"},
            rep(300, 70, 30.0, 1.0),
        ]
    }

    r = row(entry)

    assert r["bulk_tasks_per_s"] == 200 and r["reps"] == 2
    assert r["all_succeeded"] is False and r["errors"] == ["RuntimeError: controller exited"]


def test_ratios_and_aims_are_judged_from_the_medians() -> None:
    systems = {
        "turnout": {"reps": [rep(1200, 900, 2.0, 0.8, 1500), rep(1000, 1000, 3.0, 1.2, 1300)]},
        "celery": {"reps": [rep(400, 300, 2.5, 3.0, version="5.7.0")]},
        "ray": {"reps": [rep(1000, 1000, 2.1, 1.0, 1600, version="2.60.0")]},
    }

    aims = aims_by_text(summarize(systems))

    bulk_ray = aims["bulk tasks/s >= Ray's"]
    assert (bulk_ray["turnout"], bulk_ray["peer"], bulk_ray["ratio"], bulk_ray["met"]) == (
        1100,
        1000,
        1.1,
        True,
    )
    assert (
        aims["one-by-one tasks/s >= Ray's"]["ratio"] == 0.95
        and aims["one-by-one tasks/s >= Ray's"]["met"] is False
    )
    assert (
        aims["bulk tasks/s >= 3x Celery's"]["ratio"] == 2.75
        and aims["bulk tasks/s >= 3x Celery's"]["met"] is False
    )
    assert aims["one-by-one tasks/s >= 3x Celery's"]["ratio"] == 3.17
    assert aims["one-by-one tasks/s >= 3x Celery's"]["met"] is True
    assert (
        aims["p50 submit-to-result <= Celery's"]["ratio"] == 1.0
        and aims["p50 submit-to-result <= Celery's"]["met"]
    )
    assert aims["CPU per task, client left out <= Ray's"]["met"] is True  # 1.0 ms against 1.0 ms: not more
    assert aims["CPU per task, client included <= Ray's"]["turnout"] == 1.1  # median of 0.88 and 1.32
    quarter = aims["quarter-GPU tasks/s >= Ray's"]
    assert (quarter["ratio"], quarter["met"]) == (0.88, False)


def test_an_aim_is_not_met_when_turnout_lost_tasks_however_fast_it_was() -> None:
    systems = {"turnout": {"reps": [rep(5000, 5000, 1.0, 0.1, 5000, ok=False)]},
               "celery": {"reps": [rep(400, 300, 2.5, 3.0)]}, "ray": {"reps": [rep(1000, 1000, 2.1, 1.0, 1600)]}}  # fmt: skip

    summary = summarize(systems)

    assert summary["rows"]["turnout"]["all_succeeded"] is False
    assert all(a["met"] is False for a in summary["aims"])
    assert "| NO (1 reps) |" in markdown(summary)


def test_a_peer_that_is_not_installed_gets_a_row_saying_so_and_its_aims_are_not_judged() -> None:
    systems: dict[str, dict[str, Any]] = {"turnout": {"reps": [rep(1000, 900, 2.0, 1.0, 1200)]},
               "celery": {"reps": [rep(400, 300, 2.5, 3.0)]}, "ray": {"skipped": "not installed"}}  # fmt: skip

    summary = summarize(systems)
    text = markdown(summary, "preface line")

    ray_aims = [a for a in summary["aims"] if "Ray" in a["aim"]]
    assert len(ray_aims) == 5 and all(a["met"] is None and a["ratio"] is None for a in ray_aims)
    assert aims_by_text(summary)["bulk tasks/s >= 3x Celery's"]["met"] is False
    assert text.startswith("preface line\n")
    assert "| Ray (num_cpus=2, num_gpus=2) | not installed |" in text
    assert "| bulk tasks/s >= Ray's | 1,000 | - | - | not judged |" in text


def test_the_table_shows_versions_medians_and_celery_without_a_quarter_gpu_case() -> None:
    systems = {"turnout": {"reps": [rep(1234.4, 98.7, 15.5, 13.2, 250)]},
               "celery": {"reps": [rep(503, 566, 3.15, 3.1, version="5.7.0")]},
               "ray": {"reps": [rep(1590, 1590, 2.13, 1.0, 1800, version="2.60.0")]}}  # fmt: skip

    lines = markdown(summarize(systems)).splitlines()

    assert (
        "| Turnout (SQLite fsync'd, defaults) | 1,234 | 98.7 | 15.50 / 31.00 | 13.20 (1.32) | 250 | yes (1 reps) |"
        in lines
    )
    assert (
        "| Celery 5.7.0 (prefork -c 2, Redis) | 503 | 566 | 3.15 / 6.30 | 3.10 (0.31) | n/a | yes (1 reps) |"
        in lines
    )
    assert (
        "| Ray 2.60.0 (num_cpus=2, num_gpus=2) | 1,590 | 1,590 | 2.13 / 4.26 | 1.00 (0.10) | 1,800 | yes (1 reps) |"
        in lines
    )
    assert "| CPU per task, client included <= Ray's | 14.52 | 1.10 | 13.20x | NO |" in lines
    assert "| CPU per task, client left out <= Ray's | 13.20 | 1.00 | 13.20x | NO |" in lines


def test_cpu_per_task_is_judged_with_and_without_the_clients_share() -> None:
    """Ray's driver leases workers and pushes tasks itself (ownership): its client carries scheduling work that
    Turnout's controller does, so one judgement counts every process and the other leaves the client out."""
    turnout, ray = rep(2000, 2000, 4.0, 0.6, 1800), rep(2000, 1900, 1.5, 0.5, 1800)
    turnout["bulk"]["client_cpu_ms_per_task"], ray["bulk"]["client_cpu_ms_per_task"] = 0.01, 0.3
    systems = {"turnout": {"reps": [turnout]}, "celery": {"reps": [rep(500, 600, 2.7, 1.8)]},
               "ray": {"reps": [ray]}}  # fmt: skip

    aims = aims_by_text(summarize(systems))

    included = aims["CPU per task, client included <= Ray's"]
    left_out = aims["CPU per task, client left out <= Ray's"]
    assert (included["turnout"], included["peer"]) == (0.61, 0.8)
    assert (included["ratio"], included["met"]) == (0.76, True)
    assert (left_out["ratio"], left_out["met"]) == (1.2, False)
    # no client figure: no total, and the aim is not judged rather than judged on half the work
    no_client = {"bulk": {"tasks_per_s": 1, "cpu_ms_per_task": 0.5, "all_succeeded": True}}
    assert row({"reps": [no_client]})["total_cpu_ms_per_task"] is None


def test_notes_give_turnouts_cpu_by_process_and_rays_default_gpu_workers() -> None:
    t1, t2 = rep(100, 90, 10.0, 13.0, 250), rep(120, 95, 11.0, 11.0, 260)
    t1["bulk"]["cpu_ms_per_task_by_role"] = {"controller": 6.0, "worker-peers": 7.0}
    t2["bulk"]["cpu_ms_per_task_by_role"] = {"controller": 4.0, "worker-peers": 7.5}
    ray = rep(1590, 1590, 2.13, 1.0, 1800)
    ray["quarter_gpu_default"] = {"tasks_per_s": 1.14, "all_succeeded": True}
    t1["latency_two_requests"] = {"p50_ms": 14.0, "p99_ms": 20.0, "all_succeeded": True}
    t2["latency_two_requests"] = {"p50_ms": 15.0, "p99_ms": 21.0, "all_succeeded": True}
    t1["latency_httpx_transport"] = {"p50_ms": 12.0, "p99_ms": 20.0, "all_succeeded": True}
    t2["latency_httpx_transport"] = {"p50_ms": 13.0, "p99_ms": 21.0, "all_succeeded": True}
    systems: dict[str, dict[str, Any]] = {
        "turnout": {"reps": [t1, t2]},
        "celery": {"skipped": "no Redis"},
        "ray": {"reps": [ray]},
    }

    summary = summarize(systems)
    text = markdown(summary)

    assert summary["rows"]["turnout"]["cpu_ms_per_task_by_role"] == {"controller": 5.0, "worker-peers": 7.25}
    assert summary["rows"]["ray"]["quarter_gpu_default_tasks_per_s"] == 1.14
    assert "CPU per task by process tree, ms: Turnout: controller 5.00, worker-peers 7.25." in text
    assert "(`max_calls=1`, a new worker process per task) they ran 1.1 tasks/s." in text
    assert "as `submit()` then `result()`, two requests, alternated with them: p50 14.50 ms." in text
    assert (
        "over httpx's own transport instead of Turnout's (`transport.py`), alternated with them: p50 12.50 ms."
        in text
    )
    assert "| Celery (prefork -c 2, Redis) | no Redis |" in text


def test_a_peer_whose_package_cannot_be_imported_is_skipped_as_not_installed(monkeypatch: Any) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # as if absent: importing it raises ImportError
    monkeypatch.setitem(sys.modules, "celery", None)

    assert bench_peers.ray_rep({}) == {"skipped": bench_peers.NOT_INSTALLED}
    assert bench_peers.celery_missing() == bench_peers.NOT_INSTALLED
    assert bench_peers.installed("json") and not bench_peers.installed("no_such_module_for_sure")


BURNER = "import time\nwhile time.process_time() < 0.3: pass\nprint('burnt', flush=True)\ntime.sleep(120)\n"


def start_burner() -> subprocess.Popen[str]:
    """A process that has used at least 0.3 s of CPU once it prints `burnt`, and then sleeps."""
    proc = subprocess.Popen([sys.executable, "-c", BURNER], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "burnt\n"
    return proc


def test_cpu_meter_counts_a_process_born_during_the_phase_and_not_one_that_ended_before_its_end() -> None:
    """Given a busy process that ends (reaped outside the metered trees) while the meter runs and another that
    is born and burns 0.3 s meanwhile, the meter shows the newcomer's time, not the sum of the trees at the
    end less the sum at the start (which the vanished process's earlier time would pull down to about zero)."""
    procs: list[subprocess.Popen[str]] = []
    try:
        procs.append(start_burner())
        with CpuMeter({"children": os.getpid()}, include_roots=False) as meter:
            procs[0].kill()
            procs[0].wait()  # reaped by this (unmetered) process: its time leaves the metered tree
            procs.append(start_burner())
        assert meter.seconds()["children"] >= 0.25  # /proc counts in clock ticks: 0.3 s may read as 0.29
        assert meter.overhead_s >= 0
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
