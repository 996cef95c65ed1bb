"""`turnout simulate --mix`: online replays the controller's own estimate of the task mix; trace knows it all."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from turnout import simulate as sim
from turnout.errors import InvalidInput
from turnout.gpu.allocation import GpuRequest
from turnout.placement import online_mix

NODE_COLS = ["sn", "cpu_milli", "memory_mib", "gpu", "model"]
TASK_COLS = ["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec"]


def write_csv(path: Path, cols: list[str], rows: list[list[object]]) -> Path:
    path.write_text("\n".join([",".join(cols), *(",".join(str(c) for c in r) for r in rows)]) + "\n")
    return path


@pytest.fixture
def mixed_trace(tmp_path: Path) -> tuple[Path, Path]:
    """Four 2-GPU nodes and a trace of shares, whole GPUs and a CPU-only task."""
    nodes = write_csv(tmp_path / "nodes.csv", NODE_COLS, [[f"n{i}", 32000, 65536, 2, "T4"] for i in range(4)])
    rows: list[list[object]] = [
        [f"t{i:02d}", 2000, 1024, 1, (250, 500, 1000, 750)[i % 4], ""] for i in range(12)
    ]
    rows.append(["cpu", 1000, 512, 0, 0, ""])
    return nodes, write_csv(tmp_path / "tasks.csv", TASK_COLS, rows)


def test_online_mix_weighs_what_the_controller_weighs_the_tasks_placed_so_far_this_one_and_a_whole_gpu(
    mixed_trace: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[list[GpuRequest], GpuRequest]] = []

    def spy(running: list[GpuRequest], request: GpuRequest) -> object:
        seen.append((list(running), request))
        return online_mix(running, request)

    monkeypatch.setattr(sim, "online_mix", spy)
    result = sim.run_simulation(*mixed_trace, "fgd", 3, "online")
    assert len(seen) == result.tasks  # one estimate per arriving task, as the controller makes per lease
    for (running, request), (running_next, _) in itertools.pairwise(seen):
        assert running_next in (running, [*running, request])  # the placed tasks, in order, nothing else
        assert request.wants_gpu or running_next == running  # a CPU-only task holds no GPU: not running here
    assert seen[-1][0] and all(r.wants_gpu for r in seen[-1][0])


@pytest.mark.parametrize("policy", ["random", "bestfit"])
def test_policies_that_weigh_no_mix_give_the_same_curve_either_way(
    mixed_trace: tuple[Path, Path], policy: str
) -> None:
    online = sim.run_simulation(*mixed_trace, policy, 5, "online")
    trace = sim.run_simulation(*mixed_trace, policy, 5, "trace")
    assert online.points == trace.points and (online.mix, trace.mix) == ("online", "trace")


def test_json_names_the_mix_and_online_is_the_default(
    mixed_trace: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert sim.main(*mixed_trace, "fgd", 1, as_json=True) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"policy", "seed", "mix", "points"} and out["mix"] == "online"
    assert sim.main(*mixed_trace, "fgd", 1, as_json=True, mix="trace") == 0
    assert json.loads(capsys.readouterr().out)["mix"] == "trace"


def test_an_unknown_mix_is_invalid_input_naming_the_field(mixed_trace: tuple[Path, Path]) -> None:
    with pytest.raises(InvalidInput, match="mix: unknown 'paper'") as caught:
        sim.run_simulation(*mixed_trace, "fgd", 1, "paper")
    assert caught.value.field == "mix"
