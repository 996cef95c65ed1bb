"""openb benchmark: GPU allocation at 100 % arrived demand per workload, policy and task mix, next to the FGD paper.

    python bench/bench_openb.py            # the full matrix: 5 workloads x 4 policies x seeds 42-51
    python bench/bench_openb.py --quick    # default workload, seeds 42-43
    python bench/bench_openb.py --json out.json

Every run replays through `turnout.simulate` (Turnout's own placement code), once per task mix: `online` (what
the controller weighs: the GPU tasks placed so far, the one being placed and one whole GPU) and `trace` (the
whole trace's mix known in advance, as the paper's simulator does); only fgd weighs a mix. An online fgd run
re-scores every worker for each task (the mix changes each time): minutes, not seconds, per run. The paper's figure
is column 100 of expected_alloc_ratio_by_policy.csv, mean over seeds 42-51. Placement cost is the wall time of one
`PlacementIndex.choose` over 1,000 workers x 8 GPUs in a partly used fleet, for each policy.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from turnout.gpu.allocation import GpuRequest, add_grant
from turnout.gpu.devices import GpuUnit
from turnout.gpu.policies import Host, PlacementIndex, make_policy, typical_mix
from turnout.simulate import MAPPING_NOTE, MIXES, load_nodes, load_tasks, simulate

OPENB = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "openb"
WORKLOADS = ("default", "cpu050", "gpushare100", "gpuspec33", "multigpu50")
POLICIES = ("random", "bestfit", "fgd")
PAPER_POLICY = {"random": "01-Random", "bestfit": "05-BestFit", "fgd": "06-FGD"}


def _one(args: tuple[str, str, int, str]) -> tuple[str, str, int, str, float, float]:
    workload, policy, seed, mix = args
    nodes = load_nodes(OPENB / "openb_node_list_gpu_node.csv")
    tasks = load_tasks(OPENB / f"openb_pod_list_{workload}.csv")
    start = time.perf_counter()
    result = simulate(nodes, tasks, policy, seed, mix)
    return workload, policy, seed, mix, result.allocated_at(100), time.perf_counter() - start


def paper_values() -> dict[tuple[str, str], float]:
    """(workload, paper policy label) -> mean over seeds 42-51 of the allocation at 100 % arrived."""
    acc: dict[tuple[str, str], list[float]] = {}
    with (OPENB / "expected_alloc_ratio_by_policy.csv").open() as f:
        for row in csv.DictReader(f):
            if 42 <= int(row["seed"]) <= 51:
                key = (row["workload"].removeprefix("openb_pod_list_"), row["sc_policy"])
                acc.setdefault(key, []).append(float(row["100"]))
    return {k: statistics.fmean(v) for k, v in acc.items()}


def placement_cost_ms(
    policy: str, workers: int = 1000, gpus: int = 8, decisions: int = 300, cold: bool = False
) -> float:
    """Median ms per `choose` on a fleet of `workers` x `gpus` that is about half used, as in production.

    `cold`: every timed decision is a request shape never seen before, so no worker's answer is memoised
    (the worst case: one full policy evaluation per distinct worker state).
    """
    rng = random.Random(1)
    units_of = {
        f"w{i}": [GpuUnit(f"w{i}-g{g}", g, "A100-80GB", 80 * 10**9) for g in range(gpus)]
        for i in range(workers)
    }
    shapes = [GpuRequest(fraction=f, cpu=4) for f in (0.25, 0.5)] + [
        GpuRequest(count=c, cpu=8) for c in (1, 2, 4)
    ]
    index = PlacementIndex(make_policy(policy, mix=typical_mix(shapes), rng=rng), rng)
    cpu = {k: 128.0 for k in units_of}
    usage: dict[str, dict[str, Any]] = {k: {} for k in units_of}
    for key, units in units_of.items():
        index.upsert(key, units, {}, Host(cpu[key], 2**40))
    times = []
    for n in range(workers * 2 + decisions):  # fill to ~half, then time `decisions` more
        request = rng.choice(shapes)
        if cold and n >= workers * 2:
            request = GpuRequest(fraction=0.3, cpu=1 + n / 10_000)
        t0 = time.perf_counter()
        choice = index.choose(request)
        elapsed = time.perf_counter() - t0
        if n >= workers * 2:
            times.append(elapsed)
        if choice is None:
            continue
        key, grant = choice
        cpu[str(key)] -= request.cpu
        if grant is not None:
            usage[str(key)] = add_grant(usage[str(key)], grant, None)
        index.upsert(key, units_of[str(key)], usage[str(key)], Host(cpu[str(key)], 2**40))
    return statistics.median(times) * 1000


def run(
    workloads: Iterable[str] | None = None,
    seeds: Iterable[int] = range(42, 52),
    policies: Sequence[str] = POLICIES,
    processes: int | None = None,
) -> dict[str, Any]:
    """Run the matrix (in parallel processes) and return means, the paper's values and placement cost."""
    jobs = [(w, p, s, m) for w in (workloads or WORKLOADS) for p in policies for s in seeds for m in MIXES]
    with ProcessPoolExecutor(processes or min(len(jobs), os.cpu_count() or 1)) as pool:
        runs = list(pool.map(_one, jobs))
    paper = paper_values()
    table: dict[str, dict[str, dict[str, float | None]]] = {}
    for w in dict.fromkeys(j[0] for j in jobs):
        for p in policies:
            label = PAPER_POLICY.get(p)
            cell: dict[str, float | None] = {}
            for m in MIXES:
                mine = [r for r in runs if r[0] == w and r[1] == p and r[3] == m]
                cell[m] = round(statistics.fmean(r[4] for r in mine), 2)
                cell[f"seconds_per_run_{m}"] = round(statistics.fmean(r[5] for r in mine), 1)
            cell["paper"] = round(paper[(w, label)], 2) if label and (w, label) in paper else None
            table.setdefault(w, {})[p] = cell
    cost = {p: round(placement_cost_ms(p), 3) for p in policies}
    cold = {p: round(placement_cost_ms(p, cold=True), 3) for p in policies}
    return {
        "allocated_pct_at_100": table,
        "placement_ms_1000x8": cost,
        "placement_ms_1000x8_cold": cold,
        "seeds": list(seeds),
        "mapping": MAPPING_NOTE,
    }


def _print(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title="GPU allocated % at 100 % arrived demand (mean over seeds "
        f"{result['seeds'][0]}-{result['seeds'][-1]}): mix online / trace, paper in ()"
    )
    table.add_column("workload")
    policies = list(next(iter(result["allocated_pct_at_100"].values())))
    for p in policies:
        table.add_column(p, justify="right")
    for w, row in result["allocated_pct_at_100"].items():
        cells = [
            f"{row[p]['online']:.2f} / {row[p]['trace']:.2f}"
            + (f" ({row[p]['paper']:.2f})" if row[p]["paper"] is not None else "")
            for p in policies
        ]
        table.add_row(w, *cells)
    console = Console()
    console.print(table)
    console.print(
        "Placement cost, ms per decision, 1,000 workers x 8 GPUs: "
        + ", ".join(f"{p} {ms}" for p, ms in result["placement_ms_1000x8"].items())
    )
    console.print(
        "  cold (a request shape never seen, nothing memoised): "
        + ", ".join(f"{p} {ms}" for p, ms in result["placement_ms_1000x8_cold"].items())
    )
    console.print(f"Trace mapping: {result['mapping']}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="default workload, seeds 42-43")
    parser.add_argument("--workloads", nargs="*", choices=WORKLOADS)
    parser.add_argument("--policies", nargs="*", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--seeds", type=int, default=10, help="how many seeds from 42")
    parser.add_argument("--processes", type=int)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    workloads = ["default"] if args.quick else args.workloads
    seeds = range(42, 44) if args.quick else range(42, 42 + args.seeds)
    result = run(workloads, seeds, args.policies, args.processes)
    _print(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
