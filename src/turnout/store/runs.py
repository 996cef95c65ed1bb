"""Pipeline runs and routing profiles in the same database as tasks, through the same connections.

Kept apart from `sql.py` (tasks, workers, tokens) because they are another idea; every method joins the
caller's `group()` transaction when there is one, so a stage's result and the next stage's task are one commit.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from turnout.models import GpuMode, TaskState
from turnout.pipelines import PipelineRun, RunState, Stage
from turnout.profiles import Profile, RunSample, fold
from turnout.store import schema
from turnout.store.sql import RawTable, SqlStore, sqlite_of

R = schema.pipeline_runs
T = schema.tasks
_NOT_ENDED = [s.value for s in TaskState if not s.terminal]  # queued, leased, running
P = schema.profiles
# hot statements, built once (as in sql.py): a chained report reads and moves its run in the same commit
_GET_RUNS = sa.select(R).where(R.c.id.in_(sa.bindparam("ids", expanding=True)))
RUNS = RawTable(R)  # on SQLite, through the driver itself (sql.RawTable)


@functools.lru_cache(maxsize=64)
def _sqlite_run_update(keys: tuple[str, ...]) -> str:
    """`_run_update` as SQLite text: the values, then the id and the task count."""
    sets = ", ".join(f"{k} = ?" for k in keys)
    return (f"UPDATE pipeline_runs SET {sets} WHERE id = ? AND state = 'running'"
            " AND coalesce(json_array_length(task_ids), 0) = ?")  # fmt: skip


@functools.lru_cache(maxsize=64)
def _run_update(keys: tuple[str, ...]) -> sa.Update:
    """UPDATE pipeline_runs SET <keys> WHERE id = :_id AND state = 'running' AND its task list has :_tasks
    entries, built once per shape: one statement (json_array_length is SQLite's and PostgreSQL's alike)."""
    query = R.update().where(
        R.c.id == sa.bindparam("_id"),
        R.c.state == RunState.RUNNING.value,
        sa.func.coalesce(sa.func.json_array_length(R.c.task_ids), 0) == sa.bindparam("_tasks"),
    )
    return query.values({k: sa.bindparam(f"v_{k}", type_=R.c[k].type) for k in keys})


class RunStore:
    def __init__(self, store: SqlStore) -> None:
        self.store = store

    # ---- runs --------------------------------------------------------------------------------

    @property
    def _sqlite(self) -> bool:
        return self.store.dialect == "sqlite"

    def insert_run(self, run: PipelineRun) -> None:
        with self.store._write() as conn:
            if self._sqlite:
                RUNS.insert_rows(conn, [_run_row(run)])
            else:
                conn.execute(R.insert(), [_run_row(run)])

    def get_run(self, run_id: str) -> PipelineRun | None:
        found = self.get_runs([run_id])
        return found[0] if found else None

    def get_runs(self, run_ids: Sequence[str]) -> list[PipelineRun]:
        if not run_ids:
            return []
        with self.store._read() as conn:
            if self._sqlite:
                ids = list(run_ids)
                return [_run(r) for r in RUNS.rows(conn, RUNS.by_ids(len(ids)), ids)]
            return [_run(r) for r in conn.execute(_GET_RUNS, {"ids": list(run_ids)})]

    def list_runs(self, *, tenant: str | None, state: str | None = None, limit: int = 50,
                  cursor: str | None = None) -> list[PipelineRun]:  # fmt: skip
        query = sa.select(R).order_by(R.c.id.desc()).limit(limit)
        if tenant is not None:
            query = query.where(R.c.tenant == tenant)
        if state:
            query = query.where(R.c.state == state)
        if cursor:
            query = query.where(R.c.id < cursor)
        with self.store._read() as conn:
            return [_run(r) for r in conn.execute(query)]

    def runs_to_move_on(self, limit: int = 1000) -> list[PipelineRun]:
        """Running runs with no stage queued or in flight: a stage of each ended without its run moving on
        (a timeout, a cancel, `no_capacity`, a move-on lost to a race). A run whose stage still waits or runs
        is not read: the sweep's cost follows the runs that need it, not every run under way."""
        waiting = sa.exists().where(T.c.pipeline_run_id == R.c.id, T.c.state.in_(_NOT_ENDED))
        query = (
            sa.select(R).where(R.c.state == RunState.RUNNING.value, ~waiting).order_by(R.c.id).limit(limit)
        )
        with self.store._read() as conn:
            return [_run(r) for r in conn.execute(query)]

    def update_run(self, run_id: str, expect_tasks: int, values: dict[str, Any]) -> bool:
        """Change a running run whose task list still has `expect_tasks` entries (so two controllers, or a
        result and the sweep, never both queue the next stage)."""
        values = {k: (v.value if isinstance(v, RunState) else v) for k, v in values.items()}
        if "task_ids" in values:
            values["task_ids"] = list(values["task_ids"])
        with self.store._write() as conn:
            if self._sqlite:
                bound = [*(RUNS.value(k, v) for k, v in values.items()), run_id, expect_tasks]
                return bool(sqlite_of(conn).execute(_sqlite_run_update(tuple(values)), bound).rowcount)
            params = {"_id": run_id, "_tasks": expect_tasks, **{f"v_{k}": v for k, v in values.items()}}
            return bool(conn.execute(_run_update(tuple(values)), params).rowcount)

    def cost_by_tenant(self) -> list[tuple[str, str, float]]:
        """(capability, tenant, summed cost_usd) over every priced task: one grouped scan."""
        T = schema.tasks
        query = (
            sa.select(T.c.capability, T.c.tenant, sa.func.sum(T.c.cost_usd))
            .where(T.c.cost_usd.is_not(None))
            .group_by(T.c.capability, T.c.tenant)
        )
        with self.store._read() as conn:
            return [(c, t, float(v or 0.0)) for c, t, v in conn.execute(query)]

    def run_counts(self) -> list[tuple[str, str, int]]:
        """(pipeline, state, runs)."""
        query = sa.select(R.c.pipeline, R.c.state, sa.func.count()).group_by(R.c.pipeline, R.c.state)
        with self.store._read() as conn:
            return [(p, s, int(n)) for p, s, n in conn.execute(query)]

    # ---- profiles ----------------------------------------------------------------------------

    def record_profile(self, capability: str, device: str, gpu_model: str | None, *, run_s: float,
                       cold_start_s: float | None, peak_gpu_memory_bytes: int | None, peak_rss_bytes: int | None,
                       now: float) -> None:  # fmt: skip
        """Fold one finished task into its (capability, device, GPU model) profile."""
        sample = RunSample(run_s, cold_start_s, peak_gpu_memory_bytes, peak_rss_bytes)
        self.record_profiles(capability, device, gpu_model, [sample], now)

    def record_profiles(
        self, capability: str, device: str, gpu_model: str | None, samples: Sequence[RunSample], now: float
    ) -> bool:
        """Fold finished tasks, oldest first, into their (capability, device, GPU model) profile: one read and
        one write however many there are. Returns whether they were folded in.

        On PostgreSQL the profile's row is read `FOR UPDATE SKIP LOCKED`. Every completion of a capability
        writes the same row, so replicas waiting for each other's row lock would take turns at every
        completion; instead, samples that meet another replica's open transaction on that row are left
        out. A profile is an estimate, and the other replica is folding in samples of the same work.
        """
        if not samples:
            return True
        key = (P.c.capability == capability, P.c.device == device, P.c.gpu_model == (gpu_model or ""))
        postgres = self.store.dialect == "postgresql"
        read = sa.select(P).where(*key)
        with self.store._write() as conn:
            row = conn.execute(read.with_for_update(skip_locked=True) if postgres else read).first()
            if row is None and postgres and conn.execute(sa.select(P.c.samples).where(*key)).first():
                return False  # another replica holds the row now
            folded = fold(row, samples)
            if row is not None:
                conn.execute(P.update().where(*key).values(**folded, updated_at=now))
                return True
            insert = (pg_insert if postgres else sqlite_insert)(P).values(
                capability=capability, device=device, gpu_model=gpu_model or "", **folded, updated_at=now
            )
            # two replicas making the first sample's row at once: the second's samples are left out
            conn.execute(insert.on_conflict_do_nothing(index_elements=["capability", "device", "gpu_model"]))
            return True

    def profiles(self) -> list[Profile]:
        with self.store._read() as conn:
            return [Profile(r.capability, r.device, r.gpu_model or None, r.samples, r.run_s, r.cold_start_s,
                            r.peak_gpu_memory_bytes, r.peak_rss_bytes) for r in conn.execute(sa.select(P))]  # fmt: skip


def _run_row(run: PipelineRun) -> dict[str, Any]:
    return {
        "id": run.id, "tenant": run.tenant, "pipeline": run.pipeline, "state": run.state.value, "input": run.input,
        "gpu_mode": run.gpu.value if run.gpu else None, "stages": [s.to_dict() for s in run.stages],
        "task_ids": list(run.task_ids), "output": run.output, "error": run.error, "created_at": run.created_at,
        "finished_at": run.finished_at,
    }  # fmt: skip


def _run(r: Any) -> PipelineRun:
    return PipelineRun(
        id=r.id, tenant=r.tenant, pipeline=r.pipeline, state=RunState(r.state), input=r.input or {},
        gpu=GpuMode(r.gpu_mode) if r.gpu_mode else None, stages=tuple(Stage.from_dict(s) for s in r.stages),
        task_ids=tuple(r.task_ids or ()), created_at=r.created_at, output=r.output, error=r.error,
        finished_at=r.finished_at,
    )  # fmt: skip
