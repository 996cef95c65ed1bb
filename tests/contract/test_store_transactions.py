"""Transactions, on every backend: a group commits together, a savepoint undoes only its own writes, and a
method that fails leaves nothing behind. The API's database thread (api/service.py) relies on all three."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy.exc import IntegrityError

from tests.contract.test_store import _task
from turnout.models import TaskState
from turnout.pipelines import PipelineRun, RunState, Stage
from turnout.store import Store
from turnout.store.files import FileRecord


class Boom(Exception):
    pass


def _everything(store: Store, i: int) -> None:
    """One write of every kind, all keyed by `i`."""
    store.insert_tasks([_task(i)])
    store.update_tasks([(f"t_{i:06d}", (TaskState.QUEUED,), 0, {"priority": 7})])
    store.remember_capabilities([f"cap{i}"], 1.0)
    store.insert_token(f"k_{i}", f"h{i}", "read", "acme", 1.0)
    store.insert_worker_credential(f"w_{i}", "s", f"k_{i}", "acme", 1.0)
    store.append_events([(f"t_{i:06d}", 1.0, {"event": "log"})])
    store.append_audit([(1.0, "token_created", "acme", {"i": i})])
    store.runs.insert_run(
        PipelineRun(f"r_{i}", "acme", "p", RunState.RUNNING, {}, None, (Stage("cap"),), (), 1.0)
    )
    store.runs.record_profile(f"cap{i}", "cpu", None, run_s=1.0, cold_start_s=None, peak_gpu_memory_bytes=None,
                              peak_rss_bytes=None, now=1.0)  # fmt: skip
    store.files.insert(FileRecord(f"f_{i}", "acme", None, 1, "00" * 32, 1.0))


def _kept(store: Store, i: int) -> list[bool]:
    """Which of `_everything(i)`'s writes are there."""
    task = store.get_task(f"t_{i:06d}")
    return [
        task is not None and task.spec.priority == 7,
        f"cap{i}" in store.known_capabilities(),
        store.get_token(f"k_{i}") is not None,
        store.get_worker_credential(f"w_{i}") is not None,
        store.last_event_seq(f"t_{i:06d}") == 1,
        any(r["body"] == {"i": i} for r in store.list_audit()),
        store.runs.get_run(f"r_{i}") is not None,
        any(p.capability == f"cap{i}" for p in store.runs.profiles()),
        store.files.get(f"f_{i}") is not None,
    ]


def test_a_savepoint_that_raises_undoes_only_its_own_writes(store: Store) -> None:
    with store.group() as conn:
        _everything(store, 1)
        with pytest.raises(Boom), store.savepoint(conn):
            _everything(store, 2)
            raise Boom
        with store.savepoint(conn):
            _everything(store, 3)
        assert store.intact(conn)
    assert _kept(store, 1) == [True] * 9
    assert _kept(store, 2) == [False] * 9
    assert _kept(store, 3) == [True] * 9


def test_a_statement_the_database_refuses_in_a_savepoint_leaves_the_group_going(store: Store) -> None:
    """A refused write (a duplicate id) leaves a PostgreSQL transaction unusable until it rolls back to the
    savepoint, and SQLite with the savepoint's other writes: both are undone, and the group goes on."""
    store.insert_token("k_1", "h1", "read", "acme", 1.0)
    with store.group() as conn:
        _everything(store, 2)
        with pytest.raises(IntegrityError), store.savepoint(conn):
            _everything(store, 3)
            store.insert_token("k_1", "h-other", "read", "acme", 1.0)  # the id is taken
        _everything(store, 4)
        assert store.intact(conn)
    assert _kept(store, 2) == [True] * 9
    assert _kept(store, 3) == [False] * 9
    assert _kept(store, 4) == [True] * 9


def test_a_group_that_raises_keeps_nothing(store: Store) -> None:
    _everything(store, 1)
    with pytest.raises(Boom), store.group():
        _everything(store, 2)
        store.update_tasks([("t_000001", (TaskState.QUEUED,), None, {"state": TaskState.CANCELLED})])
        raise Boom
    assert _kept(store, 2) == [False] * 9
    assert store.get_task("t_000001").state is TaskState.QUEUED  # type: ignore[union-attr]


def test_a_batch_of_events_that_fails_leaves_the_sequence_as_it_was(store: Store) -> None:
    store.append_events([("a", 1.0, {"event": "log"})])
    with pytest.raises(Boom), store.group():
        store.append_events([("a", 2.0, {"event": "log"}), ("b", 2.0, {"event": "log"})])
        raise Boom
    assert store.append_events([("a", 3.0, {"event": "finish"})]) == {"a": 2}
    assert store.last_event_seq("b") == 0


def test_a_group_is_one_transaction_for_its_thread_and_commits_on_exit(store: Store) -> None:
    """What the group wrote is there for everyone once it ends (another thread reads it then)."""
    with store.group():
        store.insert_tasks([_task(1)])
        store.update_tasks([("t_000001", (TaskState.QUEUED,), 0, {"state": TaskState.LEASED, "attempts": 1})])
    seen: list[object] = []
    reader = threading.Thread(target=lambda: seen.append(store.get_task("t_000001")))
    reader.start()
    reader.join(timeout=30)
    assert len(seen) == 1 and seen[0] is not None and seen[0].state is TaskState.LEASED  # type: ignore[attr-defined]
