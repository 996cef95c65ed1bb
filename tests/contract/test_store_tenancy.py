"""The tenancy half of the store contract, on every backend (the `store` fixture of test_store.py)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from tests.contract.test_store import _task
from turnout.models import TaskState
from turnout.store import SqlStore, Store
from turnout.store.migrations import MIGRATIONS, migrate


def test_queued_tenants_are_those_with_queued_tasks_only(store: Store) -> None:
    store.insert_tasks([_task(1, tenant="acme"), _task(2, tenant="acme"), _task(3, tenant="globex"),
                        _task(4, tenant="initech")])  # fmt: skip
    store.update_tasks([("t_000004", (TaskState.QUEUED,), None, {"state": TaskState.CANCELLED})])
    assert store.queued_tenants() == ["acme", "globex"]


def test_a_tenants_queue_holds_only_its_tasks_in_priority_then_age_order(store: Store) -> None:
    store.insert_tasks(
        [_task(1, tenant="acme"), _task(2, tenant="globex"), _task(3, tenant="acme", priority=5)]
    )
    assert [t.id for t in store.queued_tasks(["cap"], tenant="acme")] == ["t_000003", "t_000001"]
    assert [t.id for t in store.queued_tasks(["cap"], tenant="globex")] == ["t_000002"]
    assert [t.id for t in store.queued_tasks(["cap"], tenant="nobody")] == []


def test_gpu_use_counts_only_active_tasks_that_hold_gpus(store: Store) -> None:
    store.insert_tasks([_task(i, tenant="acme") for i in range(3)] + [_task(3, tenant="globex")])
    grant = {"uuids": ["GPU-0"], "indices": [0], "memory_bytes": 0, "exclusive": True}
    store.update_tasks([
        ("t_000000", (TaskState.QUEUED,), None, {"state": TaskState.LEASED, "gpus": grant, "alloc": {"gpu_share": 1.0}}),
        ("t_000001", (TaskState.QUEUED,), None, {"state": TaskState.RUNNING, "gpus": grant, "alloc": {"gpu_share": 0.25}}),
        ("t_000002", (TaskState.QUEUED,), None, {"state": TaskState.SUCCEEDED, "gpus": grant, "alloc": {"gpu_share": 1.0}}),
        ("t_000003", (TaskState.QUEUED,), None, {"state": TaskState.LEASED, "alloc": {"cpu": 1}}),
    ])  # fmt: skip
    assert store.gpu_use_by_tenant() == {"acme": 1.25}


def test_tokens_list_by_tenant_without_their_hashes(store: Store) -> None:
    store.insert_token("k_1", "h1", "admin", "*", 1.0)
    store.insert_token("k_2", "h2", "submit", "acme", 2.0)
    store.insert_token("k_3", "h3", "read", "globex", 3.0)
    assert [t["id"] for t in store.list_tokens()] == ["k_1", "k_2", "k_3"]
    assert store.list_tokens("acme") == [
        {"id": "k_2", "role": "submit", "tenant": "acme", "created_at": 2.0, "revoked_at": None}
    ]


def test_a_worker_credential_is_written_once_and_read_back(store: Store) -> None:
    store.insert_worker_credential("w_1", "hash", "k_1", "acme", 1.0)
    store.insert_worker_credential("w_2", "hash2", "k_2", "*", 1.0)
    assert store.get_worker_credential("w_1") == {"worker_id": "w_1", "secret_hash": "hash", "token_id": "k_1",
                                                  "tenant": "acme", "created_at": 1.0}  # fmt: skip
    assert store.get_worker_credential("w_9") is None
    assert store.worker_tenants() == {"w_1": "acme", "w_2": "*"}
    with pytest.raises(sa.exc.IntegrityError):  # one credential per worker id, for good
        store.insert_worker_credential("w_1", "other", "k_9", "globex", 2.0)
    assert store.get_worker_credential("w_1")["secret_hash"] == "hash"  # type: ignore[index]


def test_audit_filters_by_tenant_kind_time_and_pages_by_id(store: Store) -> None:
    store.append_audit([(1.0, "gpu_allocated", "acme", {"n": 1}), (2.0, "gpu_released", "acme", {"n": 2}),
                        (3.0, "gpu_allocated", "globex", {"n": 3}), (4.0, "worker_lost", None, {"n": 4})])  # fmt: skip
    assert [r["body"]["n"] for r in store.list_audit(tenant="acme")] == [1, 2]
    assert [r["body"]["n"] for r in store.list_audit(kind="gpu_allocated")] == [1, 3]
    assert [r["body"]["n"] for r in store.list_audit(since=3.0)] == [3, 4]
    first = store.list_audit(limit=2)
    assert [r["body"]["n"] for r in store.list_audit(after_id=first[-1]["id"])] == [3, 4]


def test_upgrading_makes_the_old_default_admin_the_operator_and_no_one_else(sql_store: SqlStore) -> None:
    store = sql_store
    store.insert_token("k_old", "h1", "admin", "default", 1.0)
    store.insert_token("k_acme", "h2", "admin", "acme", 1.0)
    store.insert_token("k_sub", "h3", "submit", "default", 1.0)
    with store.engine.begin() as conn:  # as a database from before migration 5
        conn.execute(sa.text("DELETE FROM schema_migrations WHERE version = 5"))
    assert migrate(store.engine) == MIGRATIONS[-1][0]
    tenants = {t["id"]: t["tenant"] for t in store.list_tokens()}
    assert tenants == {"k_old": "*", "k_acme": "acme", "k_sub": "default"}
