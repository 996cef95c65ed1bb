"""The memory store against SQLite, side by side: the same random sequence of submissions, conditional
changes and sweeps applied to both must answer alike at every step, and leave the same state.

The example-based suite (test_store*.py) pins each method down; this one looks for what those examples did
not think of, in the interplay of keys, tenants, guards and the queue's order. Seeded: the same
sequences every run, and a failure names its seed and step.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

from turnout.errors import IdempotencyConflict
from turnout.gpu.allocation import GpuGrant
from turnout.models import Allocation, Device, GpuMode, Routing, Task, TaskSpec, TaskState
from turnout.resources import parse_resources
from turnout.store import MemoryStore, SqlStore, Store
from turnout.store import sql as sql_backend
from turnout.store.base import QueuedKind

TENANTS = ("acme", "globex")
CAPS = ("shout", "count")
STATES = list(TaskState)
SEQUENCES = 20  # seeds 0..19: the same sequences every run
STEPS = 25
GRANT = GpuGrant(("GPU-0",), (0,), 0, True, "Fake GPU", False)


def random_spec(rng: random.Random) -> tuple[str, TaskSpec]:
    resources = rng.choice([None, {"memory": "1Gi"}, {"gpu": 0.25}])  # each its own kind for the sweep
    spec = TaskSpec(
        capability=rng.choice(CAPS),
        input={"n": rng.randint(0, 2)},
        gpu=rng.choice([GpuMode.PREFER, GpuMode.NEVER]),
        resources=parse_resources(resources) if resources else None,
        resource_keys=frozenset(resources or ()),
        priority=rng.randint(0, 2),
        placement_timeout_s=rng.choice([1.0, 5.0]),
        idempotency_key=rng.choice([None, None, "k1", "k2"]),
    )
    return rng.choice(TENANTS), spec


VALUES: list[dict[str, Any]] = [
    {"state": TaskState.LEASED, "worker_id": "w1", "device": Device.GPU, "gpus": GRANT, "alloc": Allocation(gpu_share=0.5)},
    {"state": TaskState.LEASED, "worker_id": "cloud:x", "device": Device.GPU},  # an escalation endpoint holds it
    {"state": TaskState.RUNNING, "started_at": 7.0, "worker_id": "w2", "alloc": Allocation(batch="b", gpu_share=0.25),
     "gpus": GRANT},
    {"state": TaskState.RUNNING, "worker_id": "w2", "alloc": Allocation(batch="b"), "gpus": GRANT},  # rides on batch b
    {"state": TaskState.SUCCEEDED, "output": {"ok": [1, None]}, "run_s": 1.5, "cost_usd": 0.25},
    {"state": TaskState.FAILED, "error": {"type": "timeout"}, "run_s": 9.0},
    {"state": TaskState.QUEUED, "worker_id": None, "gpus": None, "routing": Routing(last_error={"type": "gpu_oom"})},
    {"state": TaskState.CANCELLED, "finished_at": 3.0},
]  # fmt: skip


def random_op(rng: random.Random, inserted: int) -> tuple[Any, ...]:
    """An insert of 1-3 tasks, a conditional change of one task, or a sweep of one kind's placement clock."""
    kind = rng.choice(["insert", "update", "update", "update", "sweep"])
    if kind == "insert":
        return ("insert", [random_spec(rng) for _ in range(rng.randint(1, 3))])
    if kind == "update":
        states = rng.sample(STATES, rng.randint(1, 3))
        return ("update", rng.randint(1, max(1, inserted + 1)), states, rng.choice([None, 0, 1, 2]),
                rng.randrange(len(VALUES)), rng.random() < 0.5)  # fmt: skip
    return ("sweep", rng.choice(CAPS), rng.choice(["prefer", "never"]), rng.randrange(3), rng.random() < 0.3,
            rng.choice([100.0, 102.0, 110.0]))  # fmt: skip


def observe(store: Store) -> dict[str, Any]:
    """Everything a reader can see, in a form that does not depend on an order the contract leaves open."""
    return {
        "tasks": store.list_tasks(tenant=None, limit=1000),
        "queue": [t.id for t in store.queued_tasks(None, limit=1000)],
        "queue_acme": [t.id for t in store.queued_tasks(["shout"], limit=2, widen_to=3, tenant="acme")],
        "tenants": store.queued_tenants(),
        "active": store.active_by_tenant(),
        "active_tasks": sorted(t.id for t in store.active_tasks()),
        "gpu_use": store.gpu_use_by_tenant(),
        "depths": store.queue_depths(),
        "stats": sorted(store.task_stats(run_s_buckets=(1.0, 5.0)), key=repr),
        "kinds": sorted(store.queued_kinds(), key=lambda k: (k[:2], k.resources or "", k.sample_id)),
        "unusual": sorted(t.id for t in store.queued_unusual()),
        "costs": sorted(store.runs.cost_by_tenant()),
    }


def apply(store: Store, op: tuple[Any, ...], counter: list[int]) -> Any:
    """Run one operation; returns what it answered (or the error it raised, as a comparable value)."""
    kind = op[0]
    if kind == "insert":
        tasks = []
        for tenant, spec in op[1]:
            counter[0] += 1
            n = counter[0]
            tasks.append(Task(id=f"t_{n:06d}", tenant=tenant, spec=spec, state=TaskState.QUEUED,
                              created_at=100.0 + n % 4, queued_at=100.0 + n))  # fmt: skip
        try:
            return [t.id for t in store.insert_tasks(tasks)]
        except IdempotencyConflict as exc:
            return ("conflict", exc.index, exc.task_id)
    if kind == "update":
        _, n, states, attempts, which, bump = op
        values = dict(VALUES[which])
        task = store.get_task(f"t_{n:06d}")
        alloc = values.get("alloc")
        if alloc is not None and alloc.batch is not None and task is not None:  # a batch is one tenant's
            values["alloc"] = replace(alloc, batch=f"b-{task.tenant}")
        if bump:
            values["attempts"] = (attempts or 0) + 1
        return store.update_tasks([(f"t_{n:06d}", states, attempts, values)])
    _, cap, mode, which_kind, servable, now = op
    error = {"type": "no_capacity", "message": "nobody"}
    # one of the kinds of (cap, mode) there are, by their tenant and overrides (none: one with no tasks)
    kinds = sorted((k for k in store.queued_kinds() if k[1:3] == (cap, mode)),
                   key=lambda k: (k.tenant, k.resources or ""))  # fmt: skip
    kind = kinds[which_kind % len(kinds)] if kinds else QueuedKind("default", cap, mode, None, "t_000000")
    return sorted(store.mark_servable(kind._replace(sample_id=""), servable, now, error))


def test_memory_answers_as_sqlite_for_random_sequences_of_submits_changes_and_sweeps(tmp_path: Path) -> None:
    sqlite: SqlStore = sql_backend.open_store(f"sqlite:///{tmp_path / 'diff.db'}")
    try:
        for seed in range(SEQUENCES):
            rng = random.Random(seed)
            memory = MemoryStore()
            _reset(sqlite)
            counters: tuple[list[int], list[int]] = ([0], [0])
            for step in range(STEPS):
                op = random_op(rng, counters[0][0])
                said = [apply(s, op, c) for s, c in zip((sqlite, memory), counters, strict=True)]
                where = f"sequence {seed}, step {step}: {op!r}"
                assert said[0] == said[1], f"{where} answered differently"
                assert observe(sqlite) == observe(memory), f"{where} left different state"
    finally:
        sqlite.close()


def _reset(store: SqlStore) -> None:
    """An empty tasks table for the next sequence (a fresh database per sequence costs a migration each)."""
    with store.group() as conn:
        conn.exec_driver_sql("DELETE FROM tasks")
