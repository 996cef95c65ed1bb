"""Two controller replicas on one PostgreSQL database: claims race, clocks disagree, sweeps are shared.

Each replica here is what `turnout controller` builds: its own engine (connection pool) and its own
Controller, on one database. Leases run inside `SqlStore.group()`, as the API's database thread runs them,
so row locks live as long as they do in production.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.pg import fresh_database
from turnout.config import ControllerSettings
from turnout.controller import Controller
from turnout.models import Device, Routing, Task, TaskSpec, TaskState, Variant, WorkerState
from turnout.resources import parse_resources
from turnout.store import SqlStore, open_store
from turnout.store.replicas import DbClock, claim_sweep, refresh_statistics
from turnout.store.runs import RunSample, RunStore

NOOP = Variant("noop", Device.CPU, parse_resources({"cpu": 0.01}))


def _register(ctrl: Controller, name: str, heartbeat_s: float = 5.0) -> str:
    worker = ctrl.register_worker(name=name, host="h", variants=[NOOP], cpu=64.0, memory_bytes=2**34, gpus=[],
                                  strategy="pack", heartbeat_s=heartbeat_s)  # fmt: skip
    return worker.id


@pytest.mark.postgres
def test_leases_racing_on_two_replicas_never_hand_one_task_to_two_workers(pg_url: str) -> None:
    # Given two replicas on one database, six workers (three per replica), and 600 queued tasks
    stores = [open_store(pg_url), open_store(pg_url)]
    try:
        first = Controller(stores[0], ControllerSettings())
        workers = [_register(first, f"w{i}") for i in range(6)]
        first.submit("default", [TaskSpec(capability="noop", input={"n": i}) for i in range(600)])
        leased: dict[str, list[str]] = {w: [] for w in workers}
        start = threading.Barrier(len(workers))
        errors: list[BaseException] = []

        def lease_until_empty(worker_id: str, store: SqlStore) -> None:
            ctrl = Controller(store, ControllerSettings())  # one per thread, as each API thread is its own
            try:
                start.wait(timeout=30)
                empty_rounds = 0
                while empty_rounds < 3:
                    with store.group():
                        got = ctrl.lease(worker_id, max_tasks=7, running=leased[worker_id])
                    leased[worker_id] += [lease.task.id for lease in got.leases]
                    empty_rounds = 0 if got.leases else empty_rounds + 1
            except BaseException as exc:
                errors.append(exc)

        # When all six lease at once, each through its own replica's connections, until the queue is empty
        threads = [threading.Thread(target=lease_until_empty, args=(w, stores[i % 2]), daemon=True)
                   for i, w in enumerate(workers)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
        assert not errors, errors

        # Then every task went to exactly one worker, once, and the store agrees on who holds it
        every = [task_id for ids in leased.values() for task_id in ids]
        assert len(every) == len(set(every)) == 600
        assert sum(1 for ids in leased.values() if ids) >= 2  # the race was real: several workers won some
        holders = {task_id: w for w, ids in leased.items() for task_id in ids}
        for task in stores[1].list_tasks(tenant=None, limit=1000):
            assert task.state in (
                TaskState.LEASED,
                TaskState.RUNNING,
            )  # running: listed by its worker a while
            assert (task.attempts, task.worker_id) == (1, holders[task.id])
    finally:
        for s in stores:
            s.close()


@pytest.mark.postgres
def test_replicas_whose_clocks_disagree_by_seconds_judge_a_heartbeating_worker_alike(pg_url: str) -> None:
    # Given replica A whose clock is 4 s behind and replica B whose clock is 4 s ahead, both reading the
    # database's clock, and B up long enough that its start-up grace is over
    stores = [open_store(pg_url), open_store(pg_url)]
    try:
        clock_a = DbClock(stores[0].engine, local=lambda: time.time() - 4.0)
        clock_b = DbClock(stores[1].engine, local=lambda: time.time() + 4.0)
        a = Controller(stores[0], ControllerSettings(), clock=clock_a)
        b = Controller(stores[1], ControllerSettings(), clock=clock_b)
        b.started_at -= 600
        assert abs(clock_a() - clock_b()) < 0.5  # what each judges by is one clock

        # When a worker (heartbeat every second) registers, takes a task and heartbeats through A,
        # and B runs the sweep that judges silent workers
        worker_id = _register(a, "w", heartbeat_s=1.0)
        task = a.submit("default", [TaskSpec(capability="noop", input={})])[0]
        assert [lease.task.id for lease in a.lease(worker_id, max_tasks=1).leases] == [task.id]
        a.heartbeat(worker_id)
        b.reap()

        # Then B finds the worker alive (by its own skewed clock the heartbeat would be 8 s old), and its
        # task stays leased to it
        worker = stores[1].get_worker(worker_id)
        assert worker is not None and worker.state is WorkerState.HEALTHY
        held = stores[1].get_task(task.id)
        assert held is not None and (held.state, held.worker_id) == (TaskState.LEASED, worker_id)
    finally:
        for s in stores:
            s.close()


@pytest.mark.postgres
def test_a_sweep_whose_replica_stops_is_taken_over_within_one_interval(pg_url: str) -> None:
    stores = [open_store(pg_url), open_store(pg_url)]
    try:
        _claims_take_turns(stores[0], stores[1])
    finally:
        for s in stores:
            s.close()


def test_on_sqlite_the_one_controller_always_sweeps_and_its_claims_write_nothing(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'sweeps.db'}")
    try:
        assert all(claim_sweep(store, "reap", "a", 100.0 + i / 10, 1.0) for i in range(3))
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT count(*) FROM sweeps").scalar_one() == 0
    finally:
        store.close()


def _claims_take_turns(store_a: SqlStore, store_b: SqlStore) -> None:
    # Given replica A that ran the sweep at t=100 (interval 1 s)
    assert claim_sweep(store_a, "reap", "a", 100.0, 1.0)
    # Then B may not run it in the same round, while A keeps it on its own timer
    assert not claim_sweep(store_b, "reap", "b", 100.3, 1.0)
    assert claim_sweep(store_a, "reap", "a", 100.5, 1.0)
    # When A stops sweeping, B takes over once a round has passed without it, and A then waits its turn
    assert claim_sweep(store_b, "reap", "b", 101.5, 1.0)
    assert not claim_sweep(store_a, "reap", "a", 101.6, 1.0)
    # and another sweep's claim is its own
    assert claim_sweep(store_a, "files", "a", 101.6, 1.0)


@pytest.mark.postgres
def test_a_queue_filled_faster_than_autovacuum_looks_is_leased_through_the_order_index(pg_url: str) -> None:
    # Given 3,000 tasks queued at once into a fresh database (its statistics say the table is empty)
    store = open_store(pg_url)
    try:
        ctrl = Controller(store, ControllerSettings())
        _register(ctrl, "w")
        for _ in range(3):
            ctrl.submit("default", [TaskSpec(capability="noop", input=None) for _ in range(1000)])
        store.engine.dispose()  # its sessions end, and report what they changed (else within 10 s)
        # When a replica refreshes the statistics that went stale
        deadline = time.monotonic() + 30
        while not refresh_statistics(store):
            assert time.monotonic() < deadline, "the tasks table was never analysed"
            time.sleep(0.1)
        assert not refresh_statistics(store)  # fresh now: nothing to do
        # Then the lease's read walks the lease-order index and stops, instead of sorting the whole queue
        with store.engine.connect() as conn:
            plan = "\n".join(r[0] for r in conn.exec_driver_sql(
                "EXPLAIN SELECT * FROM tasks WHERE state = 'queued' AND capability IN ('noop') "
                "ORDER BY priority DESC, created_at, id LIMIT 200 FOR UPDATE SKIP LOCKED"))  # fmt: skip
        assert "ix_tasks_queue_order" in plan and "Sort" not in plan, plan
    finally:
        store.close()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SqlStore]:
    if request.param == "sqlite":
        store = open_store(f"sqlite:///{tmp_path / 'profiles.db'}")
        try:
            yield store
        finally:
            store.close()
        return
    with fresh_database() as url:
        store = open_store(url)
        try:
            yield store
        finally:
            store.close()


def test_samples_folded_in_one_write_make_the_profile_that_one_write_each_makes(any_store: SqlStore) -> None:
    # Given the same five finished tasks of one capability (one with a cold start, one with a GPU peak)
    samples = [RunSample(1.0), RunSample(2.0, cold_start_s=5.0), RunSample(0.5),
               RunSample(3.0, peak_gpu_memory_bytes=2**30), RunSample(1.5, cold_start_s=1.0, peak_rss_bytes=7)]  # fmt: skip
    runs = RunStore(any_store)
    # When they are folded into one profile at once, and into another one at a time
    assert runs.record_profiles("cap", "gpu", "H100", samples, now=10.0)
    for s in samples:
        runs.record_profile("one", "gpu", "H100", run_s=s.run_s, cold_start_s=s.cold_start_s, now=10.0,
                            peak_gpu_memory_bytes=s.peak_gpu_memory_bytes, peak_rss_bytes=s.peak_rss_bytes)  # fmt: skip
    # Then both profiles are the same
    together, alone = (next(p for p in runs.profiles() if p.capability == c) for c in ("cap", "one"))
    assert together.samples == alone.samples == 5
    assert together.run_s == pytest.approx(alone.run_s) and together.cold_start_s == pytest.approx(
        alone.cold_start_s
    )
    assert (
        (together.peak_gpu_memory_bytes, together.peak_rss_bytes)
        == (alone.peak_gpu_memory_bytes, 7)
        == (2**30, 7)
    )


@pytest.mark.postgres
def test_a_profile_another_replica_is_writing_is_left_out_not_waited_for(pg_url: str) -> None:
    stores = [open_store(pg_url), open_store(pg_url)]
    try:
        runs_a, runs_b = RunStore(stores[0]), RunStore(stores[1])
        runs_a.record_profiles("noop", "cpu", None, [RunSample(1.0)], now=1.0)
        outcome: list[bool] = []
        # Given replica A folding samples into the noop profile in a transaction still open
        with stores[0].group():
            assert runs_a.record_profiles("noop", "cpu", None, [RunSample(1.0)] * 3, now=2.0)
            # When replica B folds its own samples of the same profile meanwhile
            other = threading.Thread(
                target=lambda: outcome.append(
                    runs_b.record_profiles("noop", "cpu", None, [RunSample(9.0)], now=2.0)
                ),
                daemon=True,
            )
            other.start()
            other.join(timeout=30)
            # Then B does not wait for A's commit: it leaves its samples out, while A's transaction is open
            assert not other.is_alive() and outcome == [False]
        (profile,) = runs_b.profiles()
        assert profile.samples == 4 and profile.run_s == pytest.approx(1.0)
        # And once A has committed, B's next samples go in
        assert runs_b.record_profiles("noop", "cpu", None, [RunSample(9.0)], now=3.0)
        assert runs_a.profiles()[0].samples == 5
    finally:
        for s in stores:
            s.close()


def _queued(i: int) -> Task:
    now = time.time() + i * 1e-3
    spec = TaskSpec(capability="noop", input={"n": i})
    return Task(
        id=f"t_{i:06d}", tenant="default", spec=spec, state=TaskState.QUEUED, created_at=now, queued_at=now
    )


def test_many_conditional_updates_in_one_call_apply_exactly_where_their_conditions_hold(
    any_store: SqlStore,
) -> None:
    # Given eight queued tasks, four of them already leased (attempt 1)
    any_store.insert_tasks([_queued(i) for i in range(8)])
    lease = {"state": TaskState.LEASED, "attempts": 1, "worker_id": "w", "routing": Routing(device="cpu")}
    leased = any_store.update_tasks([(f"t_{i:06d}", (TaskState.QUEUED,), 0, lease) for i in (4, 5, 6, 7)])
    assert leased == ["t_000004", "t_000005", "t_000006", "t_000007"]
    # When one call, on eight distinct tasks, leases four (one already leased: its condition fails) and
    # reports on four in two shapes: a success, a failure, a stale attempt's and a queued task's reports
    # (both refused); `cost_usd` is NULL in every row
    done = {"state": TaskState.SUCCEEDED, "output": {"ok": True}, "cost_usd": None, "finished_at": 5.0}
    failed = {"state": TaskState.FAILED, "output": None, "cost_usd": None, "finished_at": 6.0}
    changes = [
        *[
            (f"t_{i:06d}", (TaskState.QUEUED,), 0, {**lease, "routing": Routing(undelivered=i)})
            for i in (0, 1, 2, 5)
        ],
        ("t_000004", (TaskState.LEASED, TaskState.RUNNING), 1, done),
        ("t_000006", (TaskState.LEASED, TaskState.RUNNING), 1, failed),
        ("t_000007", (TaskState.LEASED, TaskState.RUNNING), 0, done),
        ("t_000003", (TaskState.LEASED, TaskState.RUNNING), 1, done),
    ]
    won = any_store.update_tasks(changes)
    # Then exactly the changes whose condition held are applied, and their ids come back in call order
    assert won == ["t_000000", "t_000001", "t_000002", "t_000004", "t_000006"]
    tasks = {t.id: t for t in any_store.get_tasks([f"t_{i:06d}" for i in range(8)])}
    states = [TaskState.LEASED] * 3 + [TaskState.QUEUED, TaskState.SUCCEEDED, TaskState.LEASED, TaskState.FAILED,
                                       TaskState.LEASED]  # fmt: skip
    assert [tasks[f"t_{i:06d}"].state for i in range(8)] == states
    assert [tasks[f"t_{i:06d}"].routing for i in (0, 1, 2, 5)] == [
        Routing(undelivered=0),
        Routing(undelivered=1),
        Routing(undelivered=2),
        Routing(device="cpu"),
    ]
    assert tasks["t_000004"].output == {"ok": True} and tasks["t_000004"].finished_at == 5.0
    assert tasks["t_000006"].finished_at == 6.0 and tasks["t_000006"].cost_usd is None


@pytest.mark.postgres
def test_a_sweep_claim_meeting_another_replicas_open_claim_does_not_wait_for_it(pg_url: str) -> None:
    stores = [open_store(pg_url), open_store(pg_url)]
    try:
        assert claim_sweep(stores[0], "reap", "a", 100.0, 1.0)
        outcome: list[bool] = []
        # Given replica A claiming the next round in a transaction still open (its sweep under way)
        with stores[0].group():
            assert claim_sweep(stores[0], "reap", "a", 101.0, 1.0)
            # When replica B, whose turn it would be by the clock, asks meanwhile
            other = threading.Thread(
                target=lambda: outcome.append(claim_sweep(stores[1], "reap", "b", 102.5, 1.0)), daemon=True
            )
            other.start()
            other.join(timeout=30)
            # Then B is told no at once, without waiting for A's commit
            assert not other.is_alive() and outcome == [False]
        # And once A's transaction is over, B takes its turn
        assert claim_sweep(stores[1], "reap", "b", 102.6, 1.0)
    finally:
        for s in stores:
            s.close()
