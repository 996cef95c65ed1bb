"""The controller CPU bench runs (its asserts check that the run's stages chained and settled in one report)."""

from __future__ import annotations

from pathlib import Path

from bench import bench_controller
from bench.bench_pipelines import CONFIG
from turnout.config import controller_settings
from turnout.store import open_store


def test_the_controller_bench_measures_each_step_of_a_task_and_of_a_chained_run(tmp_path: Path) -> None:
    (tmp_path / "turnout.yaml").write_text(CONFIG)
    store = open_store(f"sqlite:///{tmp_path / 'turnout.db'}")
    try:
        result = bench_controller._measure(store, controller_settings(tmp_path / "turnout.yaml"), 10)
    finally:
        store.close()
    assert set(result["cpu_p50_ms"]) == set(bench_controller.STEPS)
    assert all(ms > 0 for ms in result["cpu_p50_ms"].values())
    assert result["run_over_task"] > 0
    assert "3-stage chained run" in bench_controller.summary(result)
