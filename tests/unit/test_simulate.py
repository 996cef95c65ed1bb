"""The trace simulator: exact ratios on tiny hand-made traces, and one real openb run near the paper."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from turnout.errors import InvalidInput
from turnout.gpu.allocation import GpuRequest
from turnout.gpu.policies import POLICY_NAMES, Host, PlacementIndex, make_policy, score_node
from turnout.simulate import curve, main, run_simulation

OPENB = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces" / "openb"
NODE_COLS = ["sn", "cpu_milli", "memory_mib", "gpu", "model"]
TASK_COLS = ["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec"]


def write_csv(path: Path, cols: list[str], rows: list[list[object]]) -> Path:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        w.writerows(rows)
    return path


@pytest.fixture
def three_gpu_nodes(tmp_path: Path) -> Path:
    """Two T4s on one node, one P100 on another: 3,000 milli of capacity."""
    return write_csv(
        tmp_path / "nodes.csv", NODE_COLS, [["n-a", 16000, 65536, 2, "T4"], ["n-b", 8000, 32768, 1, "P100"]]
    )


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("seed", [42, 43])
def test_task_that_can_never_fit_counts_as_arrived_but_not_allocated(
    tmp_path: Path, three_gpu_nodes: Path, policy: str, seed: int
) -> None:
    # Given 3 GPUs, a 2-GPU task pinned to P100 (only one exists) and a 1-GPU task: 3,000 milli arrive,
    # and any resample would overshoot 130 %, so the sequence is exactly these two tasks.
    tasks = write_csv(
        tmp_path / "tasks.csv",
        TASK_COLS,
        [["t-1", 4000, 1024, 2, 1000, "P100"], ["t-2", 4000, 1024, 1, 1000, ""]],
    )
    result = run_simulation(three_gpu_nodes, tasks, policy, seed)
    assert (result.tasks, result.failed) == (2, 1)
    assert result.allocated_at(100) == 33.33
    assert result.allocated_at(101) == 33.33  # no event at 101 %: the average over 100-102 %
    assert result.allocated_at(130) == 33.33  # no event near 130 %: allocation stands where it was


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_complementary_shares_fill_one_gpu_exactly(tmp_path: Path, policy: str) -> None:
    nodes = write_csv(tmp_path / "nodes.csv", NODE_COLS, [["n", 8000, 65536, 1, "V100M32"]])
    tasks = write_csv(
        tmp_path / "tasks.csv", TASK_COLS, [["a", 1000, 512, 1, 460, ""], ["b", 1000, 512, 1, 540, ""]]
    )
    result = run_simulation(nodes, tasks, policy, 42)
    points = dict(result.points)
    assert result.failed == 0
    assert points[100] == 100.0
    assert {points[46], points[54]} in ({46.0, 0.0}, {0.0, 54.0}, {46.0}, {54.0})


def test_curve_averages_events_per_arrived_percent_and_falls_back_to_neighbours() -> None:
    events = [(0, 0), (100, 100), (100, 100), (150, 100), (1000, 900)]  # capacity 1,000 milli
    points = dict(curve(events, 1000))
    assert points[10] == round((10 + 10) / 2, 2)
    assert points[15] == 10.0  # python rounds 15.0 half to even: 150 milli is x = 15
    assert points[100] == 90.0
    assert points[101] == 90.0 and points[99] == 90.0  # neighbours of 100
    assert points[50] == 10.0  # no event near 50 %: allocation stands where it was (it only grows)


def test_json_output_has_the_documented_shape(
    tmp_path: Path, three_gpu_nodes: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tasks = write_csv(tmp_path / "tasks.csv", TASK_COLS, [["t", 1000, 10, 1, 1000, ""]])
    assert main(three_gpu_nodes, tasks, "fgd", 7, as_json=True) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["policy"], out["seed"]) == ("fgd", 7)
    assert [p["arrived_pct"] for p in out["points"]] == list(range(131))
    assert main(three_gpu_nodes, tasks, "bestfit", 7, as_json=False) == 0
    assert "GPU allocated" in capsys.readouterr().out


def test_bad_csv_is_invalid_input_naming_the_file_and_line(tmp_path: Path, three_gpu_nodes: Path) -> None:
    tasks = write_csv(
        tmp_path / "tasks.csv", TASK_COLS, [["ok", 1000, 10, 1, 500, ""], ["bad", "lots", 10, 1, 500, ""]]
    )
    with pytest.raises(InvalidInput, match=r"tasks\.csv:3: column 'cpu_milli'"):
        run_simulation(three_gpu_nodes, tasks, "bestfit", 42)
    no_gpu_col = write_csv(
        tmp_path / "nodes2.csv", ["sn", "cpu_milli", "memory_mib", "model"], [["n", 1, 1, "T4"]]
    )
    with pytest.raises(InvalidInput, match=r"nodes2\.csv:1: missing column\(s\) gpu"):
        run_simulation(no_gpu_col, tasks, "bestfit", 42)
    with pytest.raises(InvalidInput, match="cannot read"):
        run_simulation(tmp_path / "absent.csv", tasks, "bestfit", 42)
    with pytest.raises(InvalidInput, match="unknown 'nope'"):
        run_simulation(three_gpu_nodes, write_csv(tmp_path / "t.csv", TASK_COLS, []), "nope", 42)


def test_index_ties_go_to_the_first_registered_worker_and_twins_get_their_own_uuids() -> None:
    from turnout.gpu.devices import GpuUnit

    index = PlacementIndex(make_policy("bestfit"))
    for name in ("w2", "w1"):
        index.upsert(name, [GpuUnit(f"{name}-g0", 0, "L4", 24 * 10**9)], {}, Host(8, 2**34))
    choice = index.choose(GpuRequest(fraction=0.5, cpu=1))
    assert (
        choice is not None and choice[0] == "w2" and choice[1] is not None and choice[1].uuids == ("w2-g0",)
    )
    assert score_node(GpuRequest(count=2), index.node("w1")[0], {}, make_policy("fgd")) is None


@pytest.mark.skipif(not OPENB.is_dir(), reason=f"openb traces not found at {OPENB}")
def test_real_openb_workload_lands_near_the_papers_bestfit() -> None:
    result = run_simulation(
        OPENB / "openb_node_list_gpu_node.csv", OPENB / "openb_pod_list_default.csv", "bestfit", 42
    )
    with (OPENB / "expected_alloc_ratio_by_policy.csv").open() as f:
        paper = [
            float(r["100"])
            for r in csv.DictReader(f)
            if r["workload"] == "openb_pod_list_default" and r["sc_policy"] == "05-BestFit"
        ]
    assert abs(result.allocated_at(100) - sum(paper) / len(paper)) < 2.0
