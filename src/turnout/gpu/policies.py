"""Which worker a GPU task goes to: node scoring policies and a memoised index over many workers.

`allocate` (allocation.py) decides *which units of one worker*; this module decides *which worker*. Both
the controller and the trace simulator (`turnout simulate`) go through `PlacementIndex.choose`, so the
benchmark measures the production code path.

A policy is a score function over one `Node` record (its units, their usage, its free CPU and memory) and a
rule for which units a fitting node hands out; feasibility is shared (`Policy.evaluate`). Higher is better;
None = the node cannot host the request now:
* `random`: a uniform feasible node and a uniform fitting unit (the paper's baseline).
* `bestfit`: the node left with the least CPU and GPU after placement (paper's BestFit, integer score).
* `fgd`: Fragmentation Gradient Descent (Weng et al., ATC'23), faithful to the authors' simulator: the node
  whose expected GPU fragmentation, measured against the workload's typical tasks, grows least.
Turnout places with `fgd` by default. Two tie-break variants (best fit; keeping models that model-pinned
tasks need) both lost to FGD's own first-in-random-order rule on the openb trace, so they are not kept.

Scores depend only on a node's *state* (its units' shapes and usage, its free CPU and memory), never on
names, so `PlacementIndex` scores each distinct state once per request shape and reuses the answer for every
worker in that state. Ties go to the node registered first (the simulator registers nodes in a per-seed
random order, as the paper's simulator does).
"""

from __future__ import annotations

import bisect
import math
import random
import sys
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from turnout.errors import InvalidInput
from turnout.gpu.allocation import (
    GpuGrant,
    GpuRequest,
    Strategy,
    add_grant,
    allocate,
    gpu_units_of,
    model_rank,
    need_bytes,
)
from turnout.gpu.devices import GpuUnit, UnitUsage

PPM = 1_000_000
_EMPTY = UnitUsage()
_CPU_SCALE = 128.0  # BestFit normalises by the largest openb node: 128 cores and 8 GPUs
_GPU_SCALE = 8.0
_MEMO_LIMIT = 500_000


@dataclass(frozen=True)
class Host:
    """The host side of a worker that placement weighs: free CPU cores and free memory."""

    cpu_free: float = math.inf
    memory_free_bytes: int = sys.maxsize


Typicals = tuple[tuple[GpuRequest, float], ...]  # (request shape, probability), most popular first


def typical_mix(requests: Iterable[GpuRequest], coverage: float = 0.95) -> Typicals:
    """FGD's "typical tasks": the most popular request shapes until `coverage` of all tasks, renormalised.

    Shape = (cpu, count, fraction, memory, models, capability), as the paper's `GetTypicalPods` keys on
    (cpu, gpu milli, gpu count, gpu type); ties in popularity keep first-seen order.
    """
    counts: dict[GpuRequest, int] = {}
    for r in requests:
        key = replace(r, host_memory_bytes=0, workload=None)
        counts[key] = counts.get(key, 0) + 1
    total = sum(counts.values())
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    chosen: list[tuple[GpuRequest, int]] = []
    cum = 0
    for key, n in ranked:
        if cum >= coverage * total:
            break
        chosen.append((key, n))
        cum += n
    return tuple((key, n / cum) for key, n in chosen)


def host_fits(request: GpuRequest, host: Host) -> bool:
    return request.cpu <= host.cpu_free and request.host_memory_bytes <= host.memory_free_bytes


def _left_ppm(unit: GpuUnit, used: UnitUsage) -> int:
    """Unallocated share of a unit in ppm (0 when unusable or held whole)."""
    if not unit.healthy or used.exclusive or not unit.memory_bytes:
        return 0
    return (unit.memory_bytes - used.memory_bytes) * PPM // unit.memory_bytes


@dataclass(frozen=True)
class Node:
    """One worker as a policy scores it: its GPU units, what is held on them, and its free CPU and memory."""

    units: Sequence[GpuUnit]
    usage: Mapping[str, UnitUsage]
    host: Host = Host()

    def holding(self, request: GpuRequest, grant: GpuGrant | None) -> Node:
        """The node once `grant` (for `request`) is held on it."""
        usage = (
            add_grant(self.usage, grant, request.workload, request.tenant)
            if grant is not None
            else self.usage
        )
        host = Host(self.host.cpu_free - request.cpu, self.host.memory_free_bytes - request.host_memory_bytes)
        return Node(self.units, usage, host)


class Fragments:
    """Each typical task's fragment of a node state, in ppm of a GPU, memoised on the state with units in
    canonical order (fragmentation is a function of the multiset). Independent of the shapes' popularity, so
    one cache serves every mix: the online mix changes with each task, the shapes in it seldom do."""

    def __init__(self) -> None:
        self._memo: dict[tuple[object, ...], dict[int, int]] = {}
        self._accepts: dict[tuple[int, str, int, bool, bool, str | None], bool] = {}
        self._needs: dict[tuple[int, int], int] = {}
        self.shapes: list[GpuRequest] = []  # a shape's id is its position here
        self._ids: dict[GpuRequest, int] = {}

    def id_of(self, shape: GpuRequest) -> int:
        found = self._ids.get(shape)
        if found is None:
            found = self._ids[shape] = len(self.shapes)
            self.shapes.append(shape)
        return found

    def of(self, node: Node, cpu_free: float) -> dict[int, int]:
        """The node state's fragments by shape id, as far as measured (`fragment` fills in the rest)."""
        state = [(u.model, u.memory_bytes, u.is_mig, u.healthy, u.compute_capability, node.usage.get(u.uuid, _EMPTY), k)
                 for k, u in enumerate(node.units)]  # fmt: skip
        state.sort(
            key=lambda s: (s[0], s[1], s[5].memory_bytes, s[5].exclusive, s[5].tasks, s[2], s[3], s[6])
        )
        key = (tuple(s[:6] for s in state), cpu_free)
        memo = self._memo.get(key)
        if memo is None:
            if len(self._memo) > _MEMO_LIMIT:
                self._memo.clear()
            memo = self._memo[key] = {}
        return memo

    def fragment(self, i: int, node: Node, cpu_free: float) -> int:
        """Free GPU memory (ppm) that task shape `t` could not use on the node: the free memory of units it
        cannot use if it could be placed now, else all of it (wrong model, too little CPU or room, no GPU)."""
        t = self.shapes[i]
        used = [node.usage.get(u.uuid, _EMPTY) for u in node.units]
        lefts = [_left_ppm(u, x) for u, x in zip(node.units, used, strict=True)]
        total = sum(lefts)
        if total == 0 or not t.wants_gpu or t.cpu > cpu_free:
            return total
        usable = usable_left = 0
        for unit, u, left in zip(node.units, used, lefts, strict=True):
            if left == 0 or not self._accepts_unit(i, unit):
                continue
            if t.exclusive:
                ok = u.tasks == 0 and not unit.is_mig
            elif unit.is_mig:
                ok = u.tasks == 0 and self._need(i, unit) <= unit.memory_bytes
            else:  # the mix carries no workload labels, so no training/inference clash applies here
                ok = unit.memory_bytes - u.memory_bytes >= self._need(i, unit)
            if ok:
                usable += 1
                usable_left += left
        return total - usable_left if usable >= max(t.count, 1) else total

    def _accepts_unit(self, i: int, unit: GpuUnit) -> bool:
        key = (i, unit.model, unit.memory_bytes, unit.is_mig, unit.healthy, unit.compute_capability)
        ok = self._accepts.get(key)
        if ok is None:
            ok = self._accepts[key] = model_rank(self.shapes[i], unit) is not None
        return ok

    def _need(self, i: int, unit: GpuUnit) -> int:
        key = (i, unit.memory_bytes)
        need = self._needs.get(key)
        if need is None:
            need = self._needs[key] = need_bytes(self.shapes[i], unit)
        return need


class FragmentationMeter:
    """FGD's expected fragmentation of a node against a typical-task mix, in ppm of a GPU: each typical task's
    fragment (`Fragments`) weighted by its popularity."""

    def __init__(self, mix: Typicals, fragments: Fragments | None = None) -> None:
        self.mix = mix
        self.fragments = fragments or Fragments()
        self._weights = [(self.fragments.id_of(t), p) for t, p in mix]

    def __call__(self, node: Node, cpu_free: float) -> float:
        memo = self.fragments.of(node, cpu_free)
        frag = 0.0
        for i, p in self._weights:
            f = memo.get(i)
            if f is None:
                f = memo[i] = self.fragments.fragment(i, node, cpu_free)
            frag += p * f
        return frag


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


@dataclass(frozen=True)
class Outcome:
    """A node's answer to one request: its score and the units it would hand out (None for a CPU task)."""

    score: float
    grant: GpuGrant | None


Score = Callable[[GpuRequest, Node, "GpuGrant | None"], float]  # higher is better
Pick = Callable[[GpuRequest, Node, GpuGrant, Score], Outcome]  # the grant a node that fits hands out


@dataclass(frozen=True)
class Policy:
    """A placement policy: a score over one node record, and how a fitting node picks its units.

    Feasibility is the same for all: the host must fit, and a GPU request must get units from `allocate`.
    """

    name: str
    score: Score
    pick: Pick
    randomized: bool = False  # True: answers may not be memoised by node state
    weighs_mix: bool = False  # True: scores depend on the typical-task mix it was made with

    def evaluate(self, request: GpuRequest, node: Node) -> Outcome | None:
        """The node's score and grant for `request`, or None when it cannot host it now."""
        if not host_fits(request, node.host):
            return None
        if not request.wants_gpu:
            return Outcome(self.score(request, node, None), None)
        packed = allocate(request, node.units, node.usage, Strategy.PACK)
        if packed is None:
            return None
        return self.pick(request, node, packed, self.score)


def _candidates(request: GpuRequest, node: Node) -> list[GpuGrant]:
    """Every single-unit grant a shared request could take here now (through `allocate`, one unit at a time)."""
    return [g for u in node.units if (g := allocate(request, [u], node.usage)) is not None]


def packed_grant(request: GpuRequest, node: Node, packed: GpuGrant, score: Score) -> Outcome:
    """The best-fit grant `allocate` gives."""
    return Outcome(score(request, node, packed), packed)


def best_unit(request: GpuRequest, node: Node, packed: GpuGrant, score: Score) -> Outcome:
    """Whole GPUs: the packed grant (first free GPUs by index, as the FGD paper does); a share: the unit that
    scores best, the first on ties."""
    if request.exclusive:
        return packed_grant(request, node, packed, score)
    best: Outcome | None = None
    for grant in _candidates(request, node):
        s = score(request, node, grant)
        if best is None or s > best.score:
            best = Outcome(s, grant)
    return best or packed_grant(request, node, packed, score)  # `packed` proves a candidate exists


def random_unit(rng: random.Random) -> Pick:
    """A uniformly drawn unit among those a share fits (whole GPUs: the packed grant)."""

    def pick(request: GpuRequest, node: Node, packed: GpuGrant, score: Score) -> Outcome:
        if request.exclusive:
            return Outcome(0.0, packed)
        return Outcome(0.0, rng.choice(_candidates(request, node)))

    return pick


def no_score(request: GpuRequest, node: Node, grant: GpuGrant | None) -> float:
    """Every feasible node alike (the index draws one uniformly)."""
    return 0.0


def bestfit_score(request: GpuRequest, node: Node, grant: GpuGrant | None) -> float:
    """The paper's BestFit: least CPU and GPU left after placement, as an integer 0..100 score."""
    gpu_left = sum(_left_ppm(u, node.usage.get(u.uuid, _EMPTY)) for u in node.units) / PPM
    left = (node.host.cpu_free - request.cpu) / _CPU_SCALE * 0.5 + (
        gpu_left - gpu_units_of(grant, node.units)
    ) / _GPU_SCALE * 0.5
    return float(int((1 - left) * 100))


def fgd_score(meter: FragmentationMeter) -> Score:
    """Fragmentation Gradient Descent, as in the authors' simulator: int(sigmoid(-Δfrag) * 100), Δfrag in GPUs."""

    def score(request: GpuRequest, node: Node, grant: GpuGrant | None) -> float:
        before = meter(node, node.host.cpu_free)
        after = meter(node.holding(request, grant), node.host.cpu_free - request.cpu)
        return float(int(_sigmoid((before - after) / PPM) * 100))

    return score


POLICY_NAMES = ("random", "bestfit", "fgd")


def make_policy(
    name: str, *, mix: Typicals = (), rng: random.Random | None = None, fragments: Fragments | None = None
) -> Policy:
    """A policy by name; `mix` (and a shared `fragments` cache) feed FGD, `rng` the random one."""
    if name == "random":
        return Policy("random", no_score, random_unit(rng or random.Random(0)), randomized=True)
    if name == "bestfit":
        return Policy("bestfit", bestfit_score, packed_grant)
    if name == "fgd":
        return Policy("fgd", fgd_score(FragmentationMeter(mix, fragments)), best_unit, weighs_mix=True)
    raise InvalidInput(f"policy: unknown {name!r} (known: {', '.join(POLICY_NAMES)})", field="policy")


def score_node(
    request: GpuRequest,
    units: Sequence[GpuUnit],
    usage: Mapping[str, UnitUsage],
    policy: Policy,
    host: Host | None = None,
) -> float | None:
    """One node's score for `request` under `policy`, or None when the node cannot host it now."""
    outcome = policy.evaluate(request, Node(units, usage, host or Host()))
    return outcome.score if outcome is not None else None


_Answer = tuple[float, tuple[int, ...], GpuGrant | None] | None  # score, unit positions, grant; None = no fit
_MISSING = object()


@dataclass
class _Node:
    key: Hashable
    rank: int
    node: Node
    state: int = -1  # id of its state signature in the index
    sig: tuple[object, ...] = ()


class PlacementIndex:
    """Many workers, each scored once per distinct state and request shape.

    Register workers with `upsert` (again whenever their usage or free CPU/memory changes), then `choose`.
    A choice costs one dictionary lookup per distinct node state, so a large fleet where many workers look
    alike is cheap, and a re-scored node costs only its own evaluation.
    """

    def __init__(self, policy: Policy, rng: random.Random | None = None) -> None:
        self.policy = policy
        self.rng = rng or random.Random(0)
        self._nodes: dict[Hashable, _Node] = {}
        self._state_ids: dict[tuple[object, ...], int] = {}
        self._members: dict[int, list[tuple[int, Hashable]]] = {}  # state -> (rank, key), sorted by rank
        self._next_state = 0
        self._memo: dict[GpuRequest, dict[int, _Answer]] = {}  # request -> state -> answer
        self._fits: dict[GpuRequest, dict[int, bool]] = {}
        self._memo_size = 0

    def __len__(self) -> int:
        return len(self._nodes)

    def upsert(
        self, key: Hashable, units: Sequence[GpuUnit], usage: Mapping[str, UnitUsage], host: Host
    ) -> None:
        """Add or update a worker; the first registration fixes its rank for tie-breaks."""
        node = self._nodes.get(key)
        if node is None:
            node = self._nodes[key] = _Node(key, len(self._nodes), Node(tuple(units), dict(usage), host))
        else:
            self._leave(node)
            node.node = Node(tuple(units), dict(usage), host)
        if self._memo_size > _MEMO_LIMIT:
            self._forget()
        sig = (
            tuple(
                (
                    u.model,
                    u.memory_bytes,
                    u.parent_uuid is not None,
                    u.healthy,
                    u.compute_capability,
                    u.temperature_c,
                    usage.get(u.uuid, _EMPTY),
                )
                for u in units
            ),
            host.cpu_free,
            host.memory_free_bytes,
        )
        node.sig = sig
        node.state = self._state_ids.get(sig, -1)
        if node.state < 0:
            node.state = self._state_ids[sig] = self._next_state
            self._next_state += 1
        bisect.insort(self._members.setdefault(node.state, []), (node.rank, key))

    def use(self, policy: Policy) -> None:
        """Score with `policy` from now on; what was memoised under the previous one is dropped."""
        self.policy = policy
        self._memo.clear()
        self._memo_size = len(self._fits)

    def _forget(self) -> None:
        """Drop memoised answers and the ids of states no worker is in, so a long-lived index stays small."""
        self._memo.clear()
        self._fits.clear()
        self._memo_size = 0
        live = {n.state for n in self._nodes.values()}
        self._state_ids = {sig: i for sig, i in self._state_ids.items() if i in live}
        self._next_state = max(self._state_ids.values(), default=-1) + 1

    def remove(self, key: Hashable) -> None:
        node = self._nodes.pop(key, None)
        if node is not None:
            self._leave(node)

    def _leave(self, node: _Node) -> None:
        members = self._members[node.state]
        members.remove((node.rank, node.key))
        if not members:
            del self._members[node.state]

    def node(self, key: Hashable) -> tuple[tuple[GpuUnit, ...], dict[str, UnitUsage], Host]:
        n = self._nodes[key]
        return tuple(n.node.units), dict(n.node.usage), n.node.host

    def _evaluate(self, state: int, request: GpuRequest) -> _Answer:
        """Score the first worker in `state`; the answer holds unit positions so any twin can reuse it."""
        node = self._nodes[self._members[state][0][1]]
        out = self.policy.evaluate(request, node.node)
        if out is None:
            return None
        positions = {u.uuid: i for i, u in enumerate(node.node.units)}
        return out.score, tuple(positions[x] for x in out.grant.uuids) if out.grant else (), out.grant

    def choose(self, request: GpuRequest) -> tuple[Hashable, GpuGrant | None] | None:
        """The best worker for `request` and the units it gets there, or None if no worker can host it now."""
        if self.policy.randomized:
            return self._choose_uniformly(request)
        answers = self._memo.setdefault(request, {})
        best_score, best_rank, best_state, best = -math.inf, sys.maxsize, -1, None
        for state, members in self._members.items():
            res = answers.get(state, _MISSING)
            if res is _MISSING:
                res = answers[state] = self._evaluate(state, request)
                self._memo_size += 1
            if res is None:
                continue
            score = res[0]  # type: ignore[index]
            if score > best_score or (score == best_score and members[0][0] < best_rank):
                best_score, best_rank, best_state, best = score, members[0][0], state, res
        if best is None:
            return None
        key = self._members[best_state][0][1]
        held: tuple[int, ...] = best[1]  # type: ignore[index]
        template: GpuGrant | None = best[2]  # type: ignore[index]
        if template is None:
            return key, None
        units = self._nodes[key].node.units
        return key, replace(
            template, uuids=tuple(units[i].uuid for i in held), indices=tuple(units[i].index for i in held)
        )

    def _choose_uniformly(self, request: GpuRequest) -> tuple[Hashable, GpuGrant | None] | None:
        """A uniformly drawn feasible worker (no memo: the unit choice inside it is random too)."""
        fits = self._fits.setdefault(request, {})
        feasible = [m for s, m in self._members.items() if self._feasible(s, request, fits)]
        if not feasible:
            return None
        pick = self.rng.randrange(sum(len(m) for m in feasible))
        for members in feasible:
            if pick < len(members):
                key = members[pick][1]
                n = self._nodes[key]
                out = self.policy.evaluate(request, n.node)
                return (key, out.grant) if out is not None else None
            pick -= len(members)
        return None

    def _feasible(self, state: int, request: GpuRequest, fits: dict[int, bool]) -> bool:
        ok = fits.get(state)
        if ok is None:
            node = self._nodes[self._members[state][0][1]]
            ok = fits[state] = host_fits(request, node.node.host) and (
                not request.wants_gpu or allocate(request, node.node.units, node.node.usage) is not None
            )
            self._memo_size += 1
        return ok
