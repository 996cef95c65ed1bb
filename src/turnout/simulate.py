"""Replay a GPU-cluster trace through Turnout's own placement code (`turnout simulate`).

The replay follows the openb protocol of the FGD paper (shared/traces/openb/PROTOCOL.md), so its curves
are comparable with the paper's: tasks sorted by name, shuffled per seed, tuned by resampling to 130 % of
the cluster's GPU capacity, placed one at a time with no departures, ties going to the first node in a
per-seed random node order, and the x axis counting every task that *arrived*, failed ones included.

Every decision goes through `PlacementIndex.choose` and `allocate`, exactly as the controller places work.
Trace rows become Turnout requests: `num_gpu >= 1` with `gpu_milli = 1000` -> `count = num_gpu` (whole,
exclusive GPUs); `num_gpu = 1` with a smaller `gpu_milli` -> `fraction = gpu_milli / 1000` of one GPU's
memory; `gpu_spec` "A|B" -> `models = ("A", "B")`; `cpu_milli` and `memory_mib` -> host CPU and memory.
A node's GPUs get the memory of their model (`MODEL_MEMORY_GB`, decimal GB so that a per-mille share
is a whole number of bytes); only ratios matter for the result.
"""

from __future__ import annotations

import csv
import io
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnout.errors import InvalidInput, read_user_file
from turnout.gpu.allocation import GpuRequest, add_grant
from turnout.gpu.devices import GpuUnit
from turnout.gpu.policies import Fragments, Host, PlacementIndex, make_policy, typical_mix
from turnout.placement import online_mix

MIXES = ("online", "trace")  # `--mix`: the controller's live estimate, or the whole trace's (the paper's)
TUNE_RATIO = 1.3
MAX_ARRIVED_PCT = 130
MODEL_MEMORY_GB: dict[str, int] = {
    "P100": 16,
    "V100M16": 16,
    "V100M32": 32,
    "T4": 16,
    "A10": 24,
    "G2": 24,
    "G3": 32,
}
DEFAULT_MEMORY_GB = 16  # an unknown model: any size works, the trace's shares are relative
MAPPING_NOTE = (
    "num_gpu>=1 & gpu_milli=1000 -> gpu=num_gpu (exclusive); num_gpu=1 & gpu_milli<1000 -> gpu=gpu_milli/1000 "
    "(a share of one GPU's memory); gpu_spec -> gpu_model list; GPU memory from the node's model "
    f"({', '.join(f'{m} {g} GB' for m, g in MODEL_MEMORY_GB.items())}); cpu_milli, memory_mib -> host cpu, memory"
)


@dataclass(frozen=True)
class TraceNode:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str


@dataclass(frozen=True)
class TraceTask:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    gpu_milli: int
    models: tuple[str, ...]

    @property
    def gpu_demand_milli(self) -> int:
        return self.num_gpu * self.gpu_milli

    def request(self) -> GpuRequest:
        """The Turnout request for this row (see the module docstring for the mapping)."""
        cpu, mem = self.cpu_milli / 1000, self.memory_mib * 2**20
        if self.num_gpu == 0:
            return GpuRequest(cpu=cpu, host_memory_bytes=mem)
        if self.gpu_milli >= 1000 or self.num_gpu > 1:
            return GpuRequest(count=self.num_gpu, models=self.models, cpu=cpu, host_memory_bytes=mem)
        return GpuRequest(fraction=self.gpu_milli / 1000, models=self.models, cpu=cpu, host_memory_bytes=mem)


@dataclass
class SimulationResult:
    policy: str
    seed: int
    mix: str  # online or trace: what FGD weighs fragmentation against
    points: list[tuple[int, float]]  # (arrived %, allocated %)
    tasks: int = 0
    failed: int = 0
    capacity_gpus: int = 0
    notes: list[str] = field(default_factory=list)

    def allocated_at(self, arrived_pct: int) -> float:
        return dict(self.points)[arrived_pct]

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "seed": self.seed,
            "mix": self.mix,
            "points": [{"arrived_pct": x, "allocated_pct": y} for x, y in self.points],
        }


def _int(row: dict[str, str], col: str, where: str) -> int:
    try:
        return int(row[col])
    except (KeyError, TypeError, ValueError):
        raise InvalidInput(
            f"{where}: column {col!r} must be an integer, got {row.get(col)!r}", field=col
        ) from None


def _rows(path: Path, required: Sequence[str], flag: str) -> list[tuple[str, dict[str, str]]]:
    """(position "file:line", row) for each data row; a missing file or column is InvalidInput naming it."""
    reader = csv.DictReader(io.StringIO(read_user_file(path, flag), newline=""))
    missing = [c for c in required if c not in (reader.fieldnames or [])]
    if missing:
        raise InvalidInput(f"{path}:1: missing column(s) {', '.join(missing)}", field=str(path))
    return [(f"{path}:{reader.line_num}", row) for row in reader]


def load_nodes(path: Path) -> list[TraceNode]:
    nodes = []
    for where, row in _rows(path, ("sn", "cpu_milli", "memory_mib", "gpu", "model"), "--nodes"):
        node = TraceNode(
            row["sn"],
            _int(row, "cpu_milli", where),
            _int(row, "memory_mib", where),
            _int(row, "gpu", where),
            (row["model"] or "").strip(),
        )
        if node.gpus < 0 or node.cpu_milli < 0 or node.memory_mib < 0:
            raise InvalidInput(f"{where}: negative capacity", field="gpu")
        nodes.append(node)
    if not nodes:
        raise InvalidInput(f"{path}: no nodes", field=str(path))
    return nodes


def load_tasks(path: Path) -> list[TraceTask]:
    tasks = []
    for where, row in _rows(path, ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli"), "--tasks"):
        num, milli = _int(row, "num_gpu", where), _int(row, "gpu_milli", where)
        if num < 0 or milli < 0:
            raise InvalidInput(f"{where}: num_gpu and gpu_milli must be >= 0", field="num_gpu")
        milli = (
            min(milli, 1000) if num else 0
        )  # the paper clips to (0, 1000]; GPU fields matter only with GPUs
        if num and milli == 0:
            raise InvalidInput(f"{where}: a task with num_gpu > 0 needs gpu_milli > 0", field="gpu_milli")
        models = tuple(m.strip() for m in (row.get("gpu_spec") or "").split("|") if m.strip())
        tasks.append(
            TraceTask(
                row["name"], _int(row, "cpu_milli", where), _int(row, "memory_mib", where), num, milli, models
            )
        )
    return tasks


def node_units(node: TraceNode) -> tuple[GpuUnit, ...]:
    memory = MODEL_MEMORY_GB.get(node.model, DEFAULT_MEMORY_GB) * 10**9
    return tuple(GpuUnit(f"{node.name}/gpu{i}", i, node.model, memory) for i in range(node.gpus))


def task_sequence(tasks: Sequence[TraceTask], capacity_milli: int, rng: random.Random) -> list[TraceTask]:
    """Sort by name, shuffle, then resample (or drop) to `TUNE_RATIO` x capacity, as the paper's simulator."""
    originals = sorted(tasks, key=lambda t: t.name)
    seq = list(originals)
    rng.shuffle(seq)
    target = TUNE_RATIO * capacity_milli
    total = sum(t.gpu_demand_milli for t in seq)
    if total <= target and originals:
        while True:  # the stop test uses the per-GPU milli, so an 8-GPU draw may overshoot (as in the paper)
            t = originals[rng.randrange(len(originals))]
            if total + t.gpu_milli > target:
                break
            total += t.gpu_demand_milli
            seq.append(t)
    else:
        while total > target:
            total -= seq.pop(rng.randrange(len(seq))).gpu_demand_milli
    return seq


def curve(events: Sequence[tuple[int, int]], capacity_milli: int) -> list[tuple[int, float]]:
    """The paper's discrete curve: mean allocated % over the events at each arrived % (0..130)."""
    by_x: dict[int, list[float]] = {}
    for arrived, used in events:
        by_x.setdefault(round(arrived * 100 / capacity_milli), []).append(
            round(used * 100 / capacity_milli, 2)
        )
    points: list[tuple[int, float]] = []
    for x in range(MAX_ARRIVED_PCT + 1):
        ys = by_x.get(x) or [y for dx in (x - 1, x, x + 1) for y in by_x.get(dx, [])]
        # nothing arrived near x (a sparse trace): allocation only grows, so it stands where it was
        points.append((x, round(sum(ys) / len(ys), 2) if ys else (points[-1][1] if points else 0.0)))
    return points


def simulate(
    nodes: Sequence[TraceNode], tasks: Sequence[TraceTask], policy: str, seed: int, mix: str = "online"
) -> SimulationResult:
    """Replay `tasks` on `nodes` under `policy` (see module docstring); deterministic for a given seed.

    `mix` is what FGD weighs fragmentation against: `online` (as the controller does, `placement.online_mix`:
    the GPU tasks placed so far, the one being placed and one whole GPU, anew for each task) or `trace` (the
    whole trace's mix, known in advance, as the FGD paper's simulator does). Other policies ignore it.
    """
    if mix not in MIXES:
        raise InvalidInput(f"mix: unknown {mix!r} (known: {', '.join(MIXES)})", field="mix")
    rng = random.Random(seed)
    capacity_milli = sum(n.gpus for n in nodes) * 1000
    if capacity_milli == 0:
        raise InvalidInput("nodes: the cluster has no GPU", field="nodes")
    trace_mix = (
        typical_mix(t.request() for t in sorted(tasks, key=lambda t: t.name)) if mix == "trace" else ()
    )
    sequence = task_sequence(tasks, capacity_milli, rng)
    fragments = Fragments()  # what each task shape leaves unusable per node state, whatever the mix
    index = PlacementIndex(make_policy(policy, mix=trace_mix, rng=rng, fragments=fragments), rng)
    running: list[GpuRequest] = []  # the GPU tasks placed so far: with no departures, all still run
    ordered = sorted(nodes, key=lambda n: n.name)
    perm = list(range(len(ordered)))
    rng.shuffle(perm)  # per-seed random node order: ties go to the first node in it
    cpu_left = {n.name: n.cpu_milli for n in ordered}
    mem_left = {n.name: n.memory_mib for n in ordered}
    for pos in sorted(range(len(ordered)), key=perm.__getitem__):
        n = ordered[pos]
        index.upsert(n.name, node_units(n), {}, Host(n.cpu_milli / 1000, n.memory_mib * 2**20))
    arrived = used = failed = 0
    events: list[tuple[int, int]] = []
    for task in sequence:
        request = task.request()
        arrived += task.gpu_demand_milli
        if mix == "online" and index.policy.weighs_mix:
            index.use(make_policy(policy, mix=online_mix(running, request), rng=rng, fragments=fragments))
        choice = index.choose(request)
        if choice is None:
            failed += 1
        else:
            name, grant = choice
            units, usage, _ = index.node(name)
            cpu_left[str(name)] -= task.cpu_milli
            mem_left[str(name)] -= task.memory_mib
            if grant is not None:
                usage = add_grant(usage, grant, None)
                used += task.gpu_demand_milli
                running.append(request)
            host = Host(cpu_left[str(name)] / 1000, mem_left[str(name)] * 2**20)
            index.upsert(name, units, usage, host)
        events.append((arrived, used))
    return SimulationResult(
        policy,
        seed,
        mix,
        curve(events, capacity_milli),
        len(sequence),
        failed,
        capacity_milli // 1000,
        [MAPPING_NOTE],
    )


def run_simulation(
    nodes_csv: Path, tasks_csv: Path, policy: str, seed: int, mix: str = "online"
) -> SimulationResult:
    return simulate(load_nodes(Path(nodes_csv)), load_tasks(Path(tasks_csv)), policy, seed, mix)


def main(nodes: Path, tasks: Path, policy: str, seed: int, as_json: bool, mix: str = "online") -> int:
    """`turnout simulate`: print the curve as JSON or as a table every 10 % of arrived demand."""
    result = run_simulation(nodes, tasks, policy, seed, mix)
    if as_json:
        print(json.dumps(result.to_json()))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{tasks.name} on {nodes.name}: policy {policy}, seed {seed}, mix {mix}")
    table.add_column("arrived GPU demand %", justify="right")
    table.add_column("GPU allocated %", justify="right")
    for x, y in result.points:
        if x % 10 == 0:
            table.add_row(str(x), f"{y:.2f}")
    console = Console()
    console.print(table)
    console.print(
        f"{result.tasks} tasks, {result.failed} not placed, {result.capacity_gpus} GPUs. Mapping: {MAPPING_NOTE}"
    )
    return 0
