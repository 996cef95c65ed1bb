"""Per-tenant limits and fairness: the `limits:` section of turnout.yaml, token buckets, round-robin queues,
and the share of a shared worker held for each tenant with work.

Pure: time comes in as an argument (or an injected clock), so the rules are tested as properties
(tests/unit/test_tenancy*.py) without sleeping. The API takes submission tokens before touching the
database, and refuses a submission over the rate before reading its body where that answer is already
certain (`early_refusal`, api/gate.py); the controller takes GPU allocation tokens, checks the GPU quota
and keeps each tenant's `reserved_share` of a shared worker where it leases (`Reservations`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from turnout.access import check_tenant_name
from turnout.errors import InvalidInput, RateLimited, number

T = TypeVar("T")
DEFAULT_KEY = "*"


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's limits; None = unlimited. Units are in the names."""

    submit_per_s: float | None = None  # tasks accepted per second (a batch of N counts N)
    gpu_allocations_per_min: float | None = None  # GPU grants per minute, by the allocator
    max_gpus: float | None = None  # GPUs held at once (a share counts its fraction)
    reserved_share: float | None = None  # of each shared worker's CPU, held for the tenant while it has work
    # how long its 429s are held once it keeps sending (RefusalPace); None: the default; 0: never
    refusal_hold_s: float | None = None


@dataclass(frozen=True)
class LimitsTable:
    """`limits:` from turnout.yaml: named tenants, and `"*"` for every tenant not named."""

    default: TenantLimits = field(default_factory=TenantLimits)
    tenants: Mapping[str, TenantLimits] = field(default_factory=dict)

    def of(self, tenant: str) -> TenantLimits:
        return self.tenants.get(tenant, self.default)

    @property
    def any_reserved_share(self) -> bool:
        return any(t.reserved_share is not None for t in (self.default, *self.tenants.values()))


_KEYS = tuple(f.name for f in fields(TenantLimits))
_POSITIVE: tuple[Callable[[float], bool], str] = (lambda v: v > 0, "a number > 0")
_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {  # every other limit: _POSITIVE
    "max_gpus": (lambda v: v >= 0, "a number >= 0"),
    "reserved_share": (lambda v: 0 < v <= 1, "a fraction > 0 and <= 1"),
    "refusal_hold_s": (lambda v: 0 <= v <= 60, "seconds >= 0 and <= 60"),
}


def parse_limits(raw: Any, source: str | None = None) -> LimitsTable:
    """Validate the whole `limits:` section at once; an error names the file and the key (`limits.acme.max_gpus`).

    A named tenant's missing keys take the `"*"` entry's values; with no `"*"` entry, missing means unlimited.
    """
    prefix = f"{source}: " if source else ""
    if raw is None:
        return LimitsTable()
    if not isinstance(raw, dict):
        raise InvalidInput(f"{prefix}limits: expected a mapping of tenant to limits", field="limits")
    parsed: dict[str, dict[str, float]] = {}
    for tenant, entry in raw.items():
        key = f"limits.{tenant}"
        if tenant != DEFAULT_KEY:
            try:
                check_tenant_name(tenant, key)
            except InvalidInput as exc:
                raise InvalidInput(f"{prefix}{exc.message}", field=key) from None
        if entry is None:
            entry = {}
        if not isinstance(entry, dict):
            raise InvalidInput(f"{prefix}{key}: expected a mapping with {', '.join(_KEYS)}", field=key)
        values: dict[str, float] = {}
        for name, value in entry.items():
            where = f"{key}.{name}"
            if name not in _KEYS:
                raise InvalidInput(f"{prefix}{where}: unknown limit (use {', '.join(_KEYS)})", field=where)
            valid, need = _RANGES.get(name, _POSITIVE)
            values[name] = number(value, f"{prefix}{where}", need, valid, field=where)
        parsed[str(tenant)] = values
    default = TenantLimits(**parsed.get(DEFAULT_KEY, {}))
    tenants = {
        name: TenantLimits(**{**parsed.get(DEFAULT_KEY, {}), **values})
        for name, values in parsed.items()
        if name != DEFAULT_KEY
    }
    return LimitsTable(default, tenants)


@dataclass
class TokenBucket:
    """`rate_per_s` tokens a second, holding at most `capacity`.

    A request of n is admitted when the bucket holds n, or, for a request bigger than the whole bucket,
    when the bucket is full (it then goes into debt, so a big batch is never refused for ever and the
    long-run rate still holds). Over any interval of T seconds the admitted total is at most
    capacity + rate_per_s * T + max(0, the largest request - capacity).
    """

    rate_per_s: float
    capacity: float
    level: float
    updated_at: float

    def _refill(self, now: float) -> None:
        if now > self.updated_at:
            self.level = min(self.capacity, self.level + (now - self.updated_at) * self.rate_per_s)
            self.updated_at = now

    def wait_s(self, n: float, now: float) -> float:
        """Seconds until a request of n would be admitted; 0 = now. Takes nothing."""
        self._refill(now)
        need = min(n, self.capacity)
        return 0.0 if self.level >= need - 1e-9 else (need - self.level) / self.rate_per_s

    def take(self, n: float, now: float) -> float:
        """Admit n now (returns 0) or return the seconds to wait, taking nothing."""
        wait = self.wait_s(n, now)
        if wait == 0.0:
            self.level -= n
        return wait


Rule = Callable[[str], "tuple[float, float] | None"]  # tenant -> (rate per second, capacity), None = no limit


class TenantBuckets:
    """One token bucket per tenant, made on first use from `rule` (None: the tenant is not limited)."""

    def __init__(self, rule: Rule, clock: Callable[[], float] = time.monotonic) -> None:
        self.rule = rule
        self.clock = clock
        self._buckets: dict[str, TokenBucket | None] = {}
        self._lock = threading.Lock()

    def _bucket(self, tenant: str, now: float) -> TokenBucket | None:
        if tenant not in self._buckets:
            spec = self.rule(tenant)
            self._buckets[tenant] = None if spec is None else TokenBucket(spec[0], spec[1], spec[1], now)
        return self._buckets[tenant]

    def wait_s(self, tenant: str, n: float = 1) -> float:
        with self._lock:
            now = self.clock()
            bucket = self._bucket(tenant, now)
            return 0.0 if bucket is None else bucket.wait_s(n, now)

    def take(self, tenant: str, n: float = 1) -> float:
        with self._lock:
            now = self.clock()
            bucket = self._bucket(tenant, now)
            return 0.0 if bucket is None else bucket.take(n, now)


FREE_REFUSALS = 10  # a tenant's refusals in any one second answered at once; past them each is held
REFUSAL_HOLD_S = 1.0  # how long a refusal past them waits before it is answered
MAX_HELD = 64  # a tenant's refusals held at once at most; past it they are answered at once


class RefusalPace:
    """How long to hold a tenant's 429 before answering it: nothing while the tenant's clients wait out their
    429s, `hold_s` (or the tenant's `refusal_hold_s` in `limits`) once they keep sending regardless (more than
    `free` refusals in one second).

    A client that ignores Retry-After sends its next submission the moment it hears the last refusal; answering
    at once made its refusals as frequent as the controller and its own host could make them (hundreds a
    second, each a request the event loop handled). Held, each of its connections sends one a `hold_s`, and the
    wait costs nothing but a timer. The refusal is the same 429, its `retry_after_s` less the time held, so a
    client that waits it out waits no longer in all. At most `max_held` of one tenant's are held at once (a
    tenant opening many connections gets the rest answered at once). Pure: the caller passes the clock."""

    def __init__(
        self,
        limits: LimitsTable | None = None,
        *,
        free: int = FREE_REFUSALS,
        hold_s: float = REFUSAL_HOLD_S,
        max_held: int = MAX_HELD,
    ) -> None:
        self.limits = limits or LimitsTable()
        self.free, self.hold_s, self.max_held = free, hold_s, max_held
        self._window: dict[str, tuple[float, int]] = {}  # tenant -> (second it counts in, refusals in it)
        self.held: dict[str, int] = {}  # tenant -> refusals held now

    def refused(self, tenant: str, now: float) -> float:
        """Count a refusal of `tenant` at `now`; the seconds to hold it (0: answer at once). A hold must be
        followed by `released(tenant)` once it is over."""
        start, count = self._window.get(tenant, (now, 0))
        if now - start >= 1.0:
            start, count = now, 0
        self._window[tenant] = (start, count + 1)
        own = self.limits.of(tenant).refusal_hold_s
        hold_s = self.hold_s if own is None else own
        if count < self.free or hold_s <= 0 or self.held.get(tenant, 0) >= self.max_held:
            return 0.0
        self.held[tenant] = self.held.get(tenant, 0) + 1
        return hold_s

    def released(self, tenant: str) -> None:
        left = self.held.get(tenant, 0) - 1
        if left > 0:
            self.held[tenant] = left
        else:
            self.held.pop(tenant, None)


def submit_rule(limits: LimitsTable) -> Rule:
    """Submissions: `submit_per_s` a second, bursts of one second's worth."""

    def rule(tenant: str) -> tuple[float, float] | None:
        rate = limits.of(tenant).submit_per_s
        return None if rate is None else (rate, max(1.0, rate))

    return rule


def gpu_allocation_rule(limits: LimitsTable) -> Rule:
    """GPU allocations: `gpu_allocations_per_min` a minute, bursts of one minute's worth."""

    def rule(tenant: str) -> tuple[float, float] | None:
        per_min = limits.of(tenant).gpu_allocations_per_min
        return None if per_min is None else (per_min / 60.0, max(1.0, per_min))

    return rule


def admit_submission(
    submissions: TenantBuckets, gpu_only: TenantBuckets, tenant: str, n: int, n_gpu_only: int
) -> None:
    """Take a tenant's tokens for n submissions, n_gpu_only of them GPU-only, or raise RateLimited (429).

    Every task counts against `submit_per_s`; a task that can only run on a GPU (`gpu: require`) also
    against `gpu_allocations_per_min`, so GPU work the allocator could not grant soon is refused at the
    door. Both are checked before either is taken: a refused request costs the tenant nothing.
    """
    wait_submit = submissions.wait_s(tenant, n)
    wait_gpu = gpu_only.wait_s(tenant, n_gpu_only) if n_gpu_only else 0.0
    if wait_submit > 0 or wait_gpu > 0:
        raise _refusal(tenant, wait_submit, wait_gpu)
    submissions.take(tenant, n)
    if n_gpu_only:
        gpu_only.take(tenant, n_gpu_only)


def early_refusal(submissions: TenantBuckets, gpu_only: TenantBuckets, tenant: str) -> RateLimited | None:
    """The 429 `admit_submission` would answer to one submission of `tenant`, when its body cannot change it.

    That is when the tenant is over `submit_per_s` for even one task, and its GPU allocation rate would not
    refuse it for longer (a GPU-only task would then be refused naming `gpu`, with that wait). None: the
    answer depends on the body, which the route reads and admits as usual. Takes nothing.
    """
    wait_submit = submissions.wait_s(tenant, 1)
    if wait_submit <= 0 or gpu_only.wait_s(tenant, 1) > wait_submit:
        return None
    return _refusal(tenant, wait_submit, 0.0)


def _refusal(tenant: str, wait_submit: float, wait_gpu: float) -> RateLimited:
    what, field = ("submit_per_s", None) if wait_submit >= wait_gpu else ("gpu_allocations_per_min", "gpu")
    wait = max(wait_submit, wait_gpu)
    return RateLimited(
        f"tenant {tenant!r} is over its {what}; retry after {wait:.2f} s", retry_after_s=wait, field=field
    )


def fair_order(tenants: Iterable[str], active: Mapping[str, int], turn: int) -> list[str]:
    """Whose queue a shared worker looks at first: the tenant holding the fewest active tasks; among equals,
    a rotation by `turn`, so no tenant is always first."""
    names = sorted(tenants)
    if not names:
        return []
    rotation = {name: (i - turn) % len(names) for i, name in enumerate(names)}
    return sorted(names, key=lambda name: (active.get(name, 0), rotation[name]))


def round_robin(sources: Iterable[Iterable[T]], start: int = 0) -> Iterator[T]:
    """One item from each source in turn, beginning at source `start`: one tenant's deep queue cannot
    push another tenant's tasks out of a lease. Sources are read lazily, one item at a time."""
    iters = [iter(s) for s in sources]
    if iters:
        start %= len(iters)
        iters = iters[start:] + iters[:start]
    while iters:
        alive = []
        for it in iters:
            for item in it:
                yield item
                alive.append(it)
                break
        iters = alive


# ---- reserved shares of shared workers -----------------------------------------------------------

RECENT_S = 2.0  # a tenant that submitted this recently still has work: its client may be between two tasks


class RecentTenants:
    """Who submitted in the last `window_s` (by the controller's clock): a client that submits its next task
    as its last one ends has nothing queued in between, yet it has work."""

    def __init__(self, window_s: float = RECENT_S) -> None:
        self.window_s = window_s
        self._last: dict[str, float] = {}

    def saw(self, tenant: str, now: float) -> None:
        self._last[tenant] = now

    def within(self, now: float) -> set[str]:
        for tenant, at in list(self._last.items()):
            if now - at > self.window_s:
                self._last.pop(tenant, None)
        return set(self._last)


@dataclass
class Reservations:
    """The CPU of one shared worker guaranteed to each tenant with work, for one lease request.

    Another tenant may take a task there only if the CPU left free after it still covers what every other
    guaranteed tenant lacks (its guarantee less what it holds there), so that tenant's next task starts at
    once instead of waiting for a slot to free. A tenant below its own guarantee may always take one more
    task. `take` records what the lease takes, so later decisions in the same lease see it. A refusal holds
    for the rest of the lease: what others take after it only leaves less free.
    """

    guaranteed: dict[str, float]  # tenant -> CPU guaranteed to it on this worker
    held: dict[str, float]  # tenant -> CPU its tasks hold there now
    queued: frozenset[str] = frozenset()  # tenants with tasks queued now

    def owed_to_others(self, tenant: str) -> float:
        """CPU that must stay free for the other tenants' guarantees."""
        return sum(max(0.0, g - self.held.get(t, 0.0)) for t, g in self.guaranteed.items() if t != tenant)

    def may_take(self, tenant: str, cpu: float, free_cpu: float) -> bool:
        """May `tenant` take a task needing `cpu` of the `free_cpu` left? (Whether it fits is not asked.)"""
        if self.held.get(tenant, 0.0) < self.guaranteed.get(tenant, 0.0) - 1e-9:
            return True
        owed = self.owed_to_others(tenant)
        return owed <= 1e-9 or free_cpu - cpu >= owed - 1e-9

    def anyone_may_take(self, cpu: float, free_cpu: float) -> bool:
        """May any tenant with tasks queued take a task of at least `cpu` now? If not, a lease here takes
        nothing more, and need not read (further) into the queue to find that out."""
        return free_cpu + 1e-9 >= cpu and any(self.may_take(t, cpu, free_cpu) for t in self.queued)

    def barred(self, cpu: float, free_cpu: float) -> frozenset[str]:
        """The tenants known here (with tasks queued, or a guarantee) that may not take a task of `cpu` now: a
        new task of theirs is nothing to this worker until its room, or who has work, changes. A tenant not
        known here is never barred: its first task changes the guarantees."""
        known = self.queued | self.guaranteed.keys()
        return frozenset(t for t in known if not self.may_take(t, cpu, free_cpu))

    def take(self, tenant: str, cpu: float, free_cpu: float) -> bool:
        """`may_take`, recording the task as held when it may."""
        if not self.may_take(tenant, cpu, free_cpu):
            return False
        self.held[tenant] = self.held.get(tenant, 0.0) + cpu
        return True


def reservations(
    limits: LimitsTable,
    capacity_cpu: float,
    held: Mapping[str, float],
    queued: Collection[str],
    recent: Collection[str] = (),
) -> Reservations | None:
    """What a shared worker of `capacity_cpu` keeps for each tenant with work (tasks `queued`, or a `recent`
    submission): min(its `reserved_share`, 1 / the number of tenants with work) of the worker, so the
    guarantees never add up to more than the worker. None, reserving nothing, when fewer than two tenants
    have work or none of them has a `reserved_share`: a tenant alone is never kept from a free slot."""
    with_work = set(queued) | set(recent)
    if len(with_work) < 2:
        return None
    fair = 1.0 / len(with_work)
    guaranteed = {}
    for tenant in with_work:
        share = limits.of(tenant).reserved_share
        if share is not None:
            guaranteed[tenant] = min(share, fair) * capacity_cpu
    return Reservations(guaranteed, dict(held), frozenset(queued)) if guaranteed else None
