"""A task's `isolation` (what held its processes on the worker) is stored with it and survives an upgrade.

A real SQLite file each time; the end-to-end path (a worker reporting it) is in
tests/faults/test_containment.py.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import sqlalchemy as sa

from turnout.api.schemas import ResultIn, task_out
from turnout.models import Task, TaskSpec, TaskState
from turnout.store import open_store
from turnout.store.migrations import MIGRATIONS

ISOLATION = {"process_group": True, "pdeathsig": True, "pid_namespace": False, "cgroup": "/cg/turnout/w/p1"}


def a_task() -> Task:
    now = time.time()
    return Task(
        id="t_1",
        tenant="default",
        spec=TaskSpec("cap", {}),
        state=TaskState.QUEUED,
        created_at=now,
        queued_at=now,
    )


def test_a_tasks_isolation_reads_back_as_written_and_is_null_until_reported(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    try:
        store.insert_tasks([a_task()])
        assert store.get_task("t_1").isolation is None  # type: ignore[union-attr]
        store.update_tasks([("t_1", [TaskState.QUEUED], None, {"isolation": ISOLATION})])
        task = store.get_task("t_1")
        assert task is not None and task.isolation == ISOLATION
        assert task_out(task)["isolation"] == ISOLATION
    finally:
        store.close()


def test_a_database_from_before_the_column_gains_it_and_keeps_its_tasks(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    store = open_store(f"sqlite:///{path}")
    store.insert_tasks([a_task()])
    store.close()
    engine = sa.create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:  # as a release before migration 3 left it
        conn.execute(sa.text("ALTER TABLE tasks DROP COLUMN isolation"))
        conn.execute(sa.text("DELETE FROM schema_migrations WHERE version = 3"))
    engine.dispose()

    store = open_store(f"sqlite:///{path}")
    try:
        task = store.get_task("t_1")
        assert task is not None and task.isolation is None
        store.update_tasks([("t_1", [TaskState.QUEUED], None, {"isolation": ISOLATION})])
        assert replace(task, isolation=ISOLATION) == store.get_task("t_1")
    finally:
        store.close()


def test_a_completion_may_carry_isolation_and_need_not() -> None:
    with_it = ResultIn.model_validate(
        {"task_id": "t", "attempt": 1, "status": "succeeded", "isolation": ISOLATION}
    )
    assert with_it.isolation == ISOLATION
    assert ResultIn.model_validate({"task_id": "t", "attempt": 1, "status": "failed"}).isolation is None


def test_a_database_that_numbered_the_column_6_takes_3_as_a_no_op_and_gains_the_rest(tmp_path: Path) -> None:
    """The sandbox work first added `isolation` as migration 6: such a database keeps its column and its tasks."""
    path = tmp_path / "sandbox-branch.sqlite"
    store = open_store(f"sqlite:///{path}")
    store.insert_tasks([a_task()])
    store.update_tasks([("t_1", [TaskState.QUEUED], None, {"isolation": ISOLATION})])
    store.close()
    engine = sa.create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:  # as that build left it: 1, 2 and 6, no capabilities table
        conn.execute(sa.text("DROP TABLE capabilities"))
        conn.execute(sa.text("DELETE FROM schema_migrations WHERE version NOT IN (1, 2, 6)"))
    engine.dispose()

    store = open_store(f"sqlite:///{path}")
    try:
        assert store.schema_version == MIGRATIONS[-1][0]  # and the migrations after 6 (7: pipelines) applied
        task = store.get_task("t_1")
        assert task is not None and task.isolation == ISOLATION
        with store.engine.connect() as conn:
            assert {r[0] for r in conn.execute(sa.text("SELECT version FROM schema_migrations"))} >= {
                3,
                4,
                6,
                8,
                9,
            }
            assert conn.execute(sa.text("SELECT COUNT(*) FROM capabilities")).scalar() == 0
    finally:
        store.close()


def test_a_database_of_issue_9s_branch_that_recorded_101_takes_7_as_a_no_op(tmp_path: Path) -> None:
    """Issue 9's branch numbered its migration 101; merged, it is 7. Such a database keeps its runs and
    profiles, gains 5 and 6, and finds 7 adds nothing: it adds only what is missing."""
    from turnout.store.runs import RunStore

    path = tmp_path / "issue-9-branch.sqlite"
    store = open_store(f"sqlite:///{path}")
    RunStore(store).record_profile("cap", "cpu", None, run_s=1.5, cold_start_s=None, peak_gpu_memory_bytes=None,
                                   peak_rss_bytes=None, now=1.0)  # fmt: skip
    store.close()
    engine = sa.create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:  # as that branch left it: 1 to 4, and 101
        conn.execute(sa.text("DELETE FROM schema_migrations WHERE version > 4"))
        conn.execute(
            sa.text("INSERT INTO schema_migrations (version, name, applied_at) VALUES (101, 'x', 1.0)")
        )
    engine.dispose()

    store = open_store(f"sqlite:///{path}")
    try:
        assert store.schema_version == MIGRATIONS[-1][0]  # 9 since issue 11's sweeps (8) and files (9)
        assert [p.run_s for p in RunStore(store).profiles()] == [1.5]
        with store.engine.connect() as conn:
            assert {r[0] for r in conn.execute(sa.text("SELECT version FROM schema_migrations"))} >= {
                5,
                6,
                7,
                101,
            }
    finally:
        store.close()
