"""Batches and escalation under tenancy, on the controller itself (a real SQLite file, a fake clock, no
worker processes).

A batch is one tenant's: one handler call sees every input of its batch. Its riders hold their leader's one
grant, so a batch counts once against `max_gpus`, takes one GPU allocation, and its grant stays held, and
audited as held, until its last task ends, even when its leader is cancelled first. An escalation endpoint
is a GPU: a tenant at its `max_gpus` does not escalate around it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from turnout.config import ControllerSettings
from turnout.controller import Controller
from turnout.gpu.devices import GpuDevice
from turnout.models import Completion, Device, GpuMode, TaskSpec, Variant
from turnout.resources import parse_resources
from turnout.store import SqlStore, open_store
from turnout.tenancy import LimitsTable, TenantLimits

GiB = 2**30
EMBED = Variant("embed", Device.GPU, parse_resources({"gpu": 1, "cpu": 0.5}), max_batch_size=4)
NAP = Variant("nap", Device.GPU, parse_resources({"gpu": 1, "cpu": 0.5}))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlStore]:
    s = open_store(f"sqlite:///{tmp_path / 'turnout.db'}")
    try:
        yield s
    finally:
        s.close()


def controller(store: SqlStore, gpus: int, limits: LimitsTable | None = None) -> tuple[Controller, str]:
    settings = ControllerSettings(tenant_limits=limits or LimitsTable())
    ctrl = Controller(store, settings, clock=FakeClock())
    devices = [GpuDevice(i, f"GPU-{i}", "Fake GPU", 24 * GiB).to_dict() for i in range(gpus)]
    worker = ctrl.register_worker(name="w", host="h", variants=[EMBED, NAP], cpu=8.0, memory_bytes=32 * GiB,
                                  gpus=devices, strategy="pack")  # fmt: skip
    return ctrl, worker.id


def submit(ctrl: Controller, tenant: str, n: int, capability: str = "embed") -> list[str]:
    specs = [TaskSpec(capability, {"i": i}, gpu=GpuMode.REQUIRE) for i in range(n)]
    return [t.id for t in ctrl.submit(tenant, specs)]


def audit(ctrl: Controller, kind: str) -> list[tuple[str, int]]:
    return [(r["body"]["task"], r["body"]["attempt"]) for r in ctrl.store.list_audit(kind=kind)]


def test_two_tenants_queued_together_get_a_batch_each(store: SqlStore) -> None:
    ctrl, wid = controller(store, gpus=2)
    ids = {"acme": submit(ctrl, "acme", 3), "globex": submit(ctrl, "globex", 3)}
    leases = ctrl.lease(wid, max_tasks=10).leases
    assert len(leases) == 6
    tenant_of = {tid: tenant for tenant, tids in ids.items() for tid in tids}
    batches: dict[str | None, set[str]] = {}
    for lease in leases:
        batches.setdefault(lease.batch, set()).add(tenant_of[lease.task.id])
    assert sorted(batches.values(), key=sorted) == [{"acme"}, {"globex"}]
    assert len(audit(ctrl, "gpu_allocated")) == 2  # one grant per batch


def test_a_batch_counts_once_against_max_gpus(store: SqlStore) -> None:
    ctrl, wid = controller(store, gpus=2, limits=LimitsTable(TenantLimits(max_gpus=1)))
    submit(ctrl, "acme", 4)
    assert len(ctrl.lease(wid, max_tasks=10).leases) == 4  # one batch on one GPU
    assert store.gpu_use_by_tenant() == {"acme": 1.0}
    nap = submit(ctrl, "acme", 1, "nap")
    assert ctrl.lease(wid, max_tasks=10).leases == []  # at its quota: the second GPU is not the tenant's
    assert store.get_task(nap[0]).state.value == "queued"  # type: ignore[union-attr]


def test_a_batchs_gpu_stays_held_until_its_last_task_ends_though_its_leader_is_cancelled(
    store: SqlStore,
) -> None:
    ctrl, wid = controller(store, gpus=1)
    submit(ctrl, "acme", 3)
    leases = ctrl.lease(wid, max_tasks=10).leases
    leader = next(le for le in leases if le.batch == le.task.id)
    riders = [le for le in leases if le is not leader]
    ctrl.cancel("acme", leader.task.id)
    assert audit(ctrl, "gpu_released") == []  # its riders' process still runs on that GPU
    other = submit(ctrl, "globex", 1, "nap")
    assert ctrl.lease(wid, max_tasks=10, running=[le.task.id for le in riders]).leases == []  # not free
    done = [Completion(le.task.id, le.task.attempts, True, {"ok": 1}, run_s=0.1) for le in riders]
    accepted, _ = ctrl.complete(wid, done)
    assert sorted(accepted) == sorted(le.task.id for le in riders)
    # exactly one release, for the one allocation: the leader's task and attempt
    assert audit(ctrl, "gpu_released") == audit(ctrl, "gpu_allocated") == [(leader.task.id, 1)]
    assert [le.task.id for le in ctrl.lease(wid, max_tasks=10).leases] == other  # free now


def test_the_worker_never_hands_two_tenants_leases_to_one_call_whatever_the_answer_says() -> None:
    from turnout.worker.executors import groups

    leases = [{"id": "a", "tenant": "acme", "batch": "a"}, {"id": "b", "tenant": "globex", "batch": "a"},
              {"id": "c", "tenant": "acme", "batch": "a"}, {"id": "d", "tenant": "acme", "batch": None}]  # fmt: skip
    assert [[lease["id"] for lease in group] for group in groups(leases)] == [["a", "c"], ["b"], ["d"]]


def test_escalation_holds_a_tenant_at_its_gpu_quota_and_counts_what_endpoints_hold(store: SqlStore) -> None:
    from turnout.escalation import Endpoint, EscalationSettings, claim

    endpoint = Endpoint("embed", "http", "http://cloud.invalid/embed", "http-embed")
    settings = ControllerSettings(tenant_limits=LimitsTable(tenants={"acme": TenantLimits(max_gpus=1)}),
                                  escalation=EscalationSettings(after_s=0.0, endpoints=(endpoint,)))  # fmt: skip
    clock = FakeClock()
    ctrl = Controller(store, settings, clock=clock)
    ctrl.register_worker(name="cpu-only", host="h", variants=[EMBED], cpu=1.0, memory_bytes=GiB, gpus=[],
                         strategy="pack")  # fmt: skip
    submit(ctrl, "acme", 3)
    submit(ctrl, "globex", 2)
    claimed = claim(ctrl, clock.now)
    # acme's own max_gpus holds its other tasks queued (an endpoint is a GPU); globex has no quota
    assert sorted(t.tenant for t in claimed) == ["acme", "globex", "globex"]
    assert store.gpu_use_by_tenant() == {"acme": 1.0, "globex": 2.0}
    assert claim(ctrl, clock.now) == []
