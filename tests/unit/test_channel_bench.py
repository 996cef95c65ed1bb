"""The channel bench's verdict: channel over HTTP per figure, from each mode's medians (no cluster started)."""

from __future__ import annotations

from typing import Any

from bench import bench_channel


def rep(bulk: float, p50: float, cpu: float) -> dict[str, Any]:
    return {
        "bulk": {"tasks_per_s": bulk, "cpu_ms_per_task": cpu, "all_succeeded": True,
                 "cpu_ms_per_task_by_role": {"controller": cpu / 2, "worker-peers": cpu / 2}},
        "single": {"tasks_per_s": bulk / 2, "all_succeeded": True},
        "latency": {"p50_ms": p50, "p99_ms": 2 * p50, "all_succeeded": True},
    }  # fmt: skip


def test_the_ratios_are_the_channels_medians_over_https() -> None:
    modes = {"channel": {"reps": [rep(200, 10, 4), rep(180, 12, 5), rep(190, 30, 4.5)]},
             "http": {"reps": [rep(100, 20, 8), rep(120, 20, 9), rep(110, 25, 7)]}}  # fmt: skip
    ratios = bench_channel.compare(modes)
    assert ratios["channel_over_http"] == {"bulk_tasks_per_s": round(190 / 110, 2), "single_tasks_per_s": round(95 / 55, 2),
                                           "p50_ms": 0.6, "p99_ms": 0.6, "cpu_ms_per_task": 0.56}  # fmt: skip
    text = bench_channel.summary({**ratios, "params": {"n": 10, "reps": 3}, "loadavg_at_start": [1.0],
                                  "loadavg_at_end": [2.0]})  # fmt: skip
    assert "cpu_ms_per_task" in text and "0.56" in text and "every task succeeded (http): True" in text
