"""Idempotency keys and known capabilities, over every store; the race on one key, on PostgreSQL.

A key names one request: repeating the request answers its first task, anything else under that key is an
IdempotencyConflict, and two controllers racing on a key both answer the task that won.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import sqlalchemy as sa

from tests.contract import test_store as contract
from turnout.errors import IdempotencyConflict
from turnout.models import Task
from turnout.store import SqlStore, Store, open_store
from turnout.store.sql import normalise_url


def _keyed(i: int, key: str, n: int | None = None, tenant: str = "default") -> Task:
    """Task number `i` under `key`; its input is {"n": n} (default i): the same n is the same request."""
    task = contract._task(i, key=key, tenant=tenant)
    return replace(task, spec=replace(task.spec, input={"n": i if n is None else n}))


def _rows(store: Store) -> int:
    return len(store.list_tasks(tenant=None, limit=1000))


def test_the_same_request_under_a_key_answers_the_first_task_and_stores_nothing(store: Store) -> None:
    first = store.insert_tasks([_keyed(1, "k", n=7)])[0]
    again = store.insert_tasks([_keyed(2, "k", n=7)])[0]
    assert again == first
    assert _rows(store) == 1


def test_another_request_under_a_taken_key_is_a_conflict_and_its_batch_is_not_stored(store: Store) -> None:
    first = store.insert_tasks([_keyed(1, "k", n=7)])[0]
    with pytest.raises(IdempotencyConflict) as caught:
        store.insert_tasks([_keyed(2, "fresh"), _keyed(3, "k", n=8)])
    assert (caught.value.index, caught.value.task_id, caught.value.field) == (1, first.id, "idempotency_key")
    assert _rows(store) == 1
    assert store.get_task("t_000002") is None


def test_a_key_repeated_within_one_batch_follows_the_same_rule(store: Store) -> None:
    same = store.insert_tasks([_keyed(1, "k", n=1), _keyed(2, "k", n=1)])
    assert [t.id for t in same] == ["t_000001", "t_000001"]
    with pytest.raises(IdempotencyConflict) as caught:
        store.insert_tasks([_keyed(3, "j", n=1), _keyed(4, "j", n=2)])
    assert (caught.value.index, caught.value.earlier) == (1, 0)  # the key's first use is in the batch itself
    assert "t_000003" not in caught.value.message  # a task the refused batch never made is not named


def test_keys_belong_to_their_tenant(store: Store) -> None:
    ours = store.insert_tasks([_keyed(1, "k", n=1)])[0]
    theirs = store.insert_tasks([_keyed(2, "k", n=2, tenant="acme")])[0]
    assert theirs.id != ours.id
    assert theirs.tenant == "acme"


def test_capabilities_once_remembered_stay_known(store: Store) -> None:
    assert store.known_capabilities() == set()
    store.remember_capabilities(["shout", "count"], time.time())
    store.remember_capabilities(["shout", "classify"], time.time())  # again: no duplicate, no error
    assert store.known_capabilities() == {"shout", "count", "classify"}


# ---- the race, on PostgreSQL ---------------------------------------------------------------------


@pytest.fixture
def pg_store() -> Iterator[SqlStore]:
    """A PostgreSQL store on a fresh database (skipped where none answers, failed under CI=true)."""
    url, name = contract._fresh_pg_database()
    s = open_store(url)
    try:
        yield s
    finally:
        s.close()
        admin = sa.create_engine(normalise_url(contract.PG_URL), isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _wait_for_a_lock_waiter(store: SqlStore, timeout_s: float = 20) -> None:
    """Until some session of this database waits on a lock (the second insert, on the unique index)."""
    deadline = time.monotonic() + timeout_s
    query = sa.text(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    while True:
        with store.engine.connect() as conn:
            if conn.execute(query).scalar_one():
                return
        assert time.monotonic() < deadline, "the second insert never waited on the first"
        time.sleep(0.01)


def _race(store: SqlStore, winner: Task, loser: Task) -> Task | BaseException:
    """Insert `winner` in an open transaction; insert `loser` from another thread, which then waits on the
    unique index; commit the winner. Returns what the loser's insert answered or raised."""
    inserted, commit = threading.Event(), threading.Event()
    outcome: list[Task | BaseException] = []

    def first() -> None:
        with store.group():
            store.insert_tasks([winner])
            inserted.set()
            commit.wait(timeout=30)

    def second() -> None:
        try:
            outcome.append(store.insert_tasks([loser])[0])
        except BaseException as exc:
            outcome.append(exc)

    a = threading.Thread(target=first, daemon=True)
    b = threading.Thread(target=second, daemon=True)
    a.start()
    try:
        assert inserted.wait(timeout=30)
        b.start()
        _wait_for_a_lock_waiter(store)
    finally:
        commit.set()
        a.join(timeout=30)
        if b.ident is not None:
            b.join(timeout=30)
    assert len(outcome) == 1, outcome
    return outcome[0]


@pytest.mark.postgres
def test_a_submit_that_loses_the_race_on_a_key_answers_the_winners_task(pg_store: SqlStore) -> None:
    winner = _keyed(1, "race", n=1)
    answered = _race(pg_store, winner, _keyed(2, "race", n=1))
    assert isinstance(answered, Task) and answered.id == winner.id
    assert _rows(pg_store) == 1


@pytest.mark.postgres
def test_a_different_request_that_loses_the_race_on_a_key_is_a_conflict(pg_store: SqlStore) -> None:
    winner = _keyed(1, "race", n=1)
    answered = _race(pg_store, winner, _keyed(2, "race", n=2))
    assert isinstance(answered, IdempotencyConflict) and answered.task_id == winner.id
    assert _rows(pg_store) == 1


@pytest.fixture(params=[pytest.param("postgres", marks=pytest.mark.postgres), "memory"])
def concurrent_store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """A store several threads write at once: PostgreSQL (as several controllers do), and the memory store."""
    if request.param == "memory":
        yield open_store("memory://")
        return
    yield request.getfixturevalue("pg_store")


def test_many_concurrent_submits_of_one_request_make_one_task(concurrent_store: Store) -> None:
    pg_store = concurrent_store
    start = threading.Barrier(8)
    answers: list[Task | BaseException] = []

    def submit(i: int) -> None:
        start.wait(timeout=30)
        try:
            answers.append(pg_store.insert_tasks([_keyed(i, "burst", n=0)])[0])
        except BaseException as exc:
            answers.append(exc)

    threads = [threading.Thread(target=submit, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(isinstance(a, Task) for a in answers) and len(answers) == 8, answers
    assert len({a.id for a in answers if isinstance(a, Task)}) == 1
    assert _rows(pg_store) == 1
