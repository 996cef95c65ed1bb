"""The channel bench's verdict: channel over HTTP per figure, from each mode's medians (no cluster started)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import bench_channel


def rep(bulk: float, p50: float, cpu: float) -> dict[str, Any]:
    return {
        "bulk": {"tasks_per_s": bulk, "cpu_ms_per_task": cpu, "all_succeeded": True,
                 "cpu_ms_per_task_by_role": {"controller": cpu / 2, "worker-peers": cpu / 2}},
        "single": {"tasks_per_s": bulk / 2, "all_succeeded": True},
        "latency": {"p50_ms": p50, "p99_ms": 2 * p50, "all_succeeded": True},
    }  # fmt: skip


def test_one_call_on_each_road_is_measured_against_a_real_controller(tmp_path: Path) -> None:
    calls = bench_channel.per_call(tmp_path, 50)
    assert calls["calls"] == 50
    costs = [calls[f"{call}_{road}"] for call in bench_channel.REQUESTS for road in ("http", "channel")]
    assert all(c["wall_ms"] > 0 and c["controller_cpu_ms"] >= 0 and c["caller_cpu_ms"] >= 0 for c in costs)
    assert sum(c["controller_cpu_ms"] for c in costs) > 0  # /proc counts in clock ticks: 50 calls may read 0
    text = bench_channel.summary({**bench_channel.compare({"channel": {"reps": []}, "http": {"reps": []}}),
                                  "params": {"n": 10, "reps": 0}, "loadavg_at_start": [1.0],
                                  "loadavg_at_end": [1.0], "calls": calls})  # fmt: skip
    assert "lease" in text and "events" in text


def test_the_ratios_are_the_channels_medians_over_https() -> None:
    modes = {"channel": {"reps": [rep(200, 10, 4), rep(180, 12, 5), rep(190, 30, 4.5)]},
             "http": {"reps": [rep(100, 20, 8), rep(120, 20, 9), rep(110, 25, 7)]}}  # fmt: skip
    ratios = bench_channel.compare(modes)
    assert ratios["channel_over_http"] == {"bulk_tasks_per_s": round(190 / 110, 2), "single_tasks_per_s": round(95 / 55, 2),
                                           "p50_ms": 0.6, "p99_ms": 0.6, "cpu_ms_per_task": 0.56}  # fmt: skip
    text = bench_channel.summary({**ratios, "params": {"n": 10, "reps": 3}, "loadavg_at_start": [1.0],
                                  "loadavg_at_end": [2.0]})  # fmt: skip
    assert "cpu_ms_per_task" in text and "0.56" in text and "every task succeeded (http): True" in text
