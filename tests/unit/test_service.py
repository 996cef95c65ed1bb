"""The service's database thread and its liveness rules, on a real SQLite file with a fake clock.

Group commit must never answer success for a change that is not on disk; heartbeats count when they
arrive, not when the database gets to them; a worker whose held connection closed for good has its tasks
re-queued at once, and one that reconnects, or a controller that is itself stopping, changes nothing.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from turnout.api.service import Service
from turnout.auth import TokenBook
from turnout.config import ControllerSettings
from turnout.controller import Controller
from turnout.errors import StorageUnavailable
from turnout.models import Device, TaskSpec, TaskState, Variant, Worker, WorkerState
from turnout.resources import parse_resources
from turnout.store import SqlStore, open_store

COUNT = Variant("count", Device.CPU, parse_resources({"cpu": 0.1}))


class FakeClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def run_with_service(
    store: SqlStore, clock: FakeClock, body: Callable[[Service], Awaitable[None]], **options: Any
) -> None:
    """Run `body` against a Service on `store`, stopping the service (and its database thread) however it ends."""

    async def main() -> None:
        service = Service(Controller(store, ControllerSettings(), clock=clock), TokenBook(store), auth=False,
                          **options)  # fmt: skip
        try:
            await body(service)
        finally:
            await service.stop()

    asyncio.run(main())


async def until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        await asyncio.sleep(0.02)


async def register(service: Service, heartbeat_s: float = 1.0) -> Worker:
    worker = await service.call(service.controller.register_worker, name="w", host="h", variants=[COUNT], cpu=1.0,
                                memory_bytes=2**30, gpus=[], strategy="pack", heartbeat_s=heartbeat_s)  # fmt: skip
    service.registered(worker)
    return worker


def spec(text: str = "x", **options: Any) -> TaskSpec:
    return TaskSpec(capability="count", input={"text": text}, **options)


# ---- group commit ----------------------------------------------------------------------------------


def test_a_group_that_hits_a_full_disk_acknowledges_only_changes_that_are_on_disk(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'full.db'}")
    max_pages: dict[str, int] = {}

    @sa.event.listens_for(store.engine, "connect")
    def cap(dbapi_conn: Any, _record: Any) -> None:  # SQLITE_FULL, as a full disk gives it, past this size
        if "pages" in max_pages:
            dbapi_conn.execute(f"PRAGMA max_page_count={max_pages['pages']}")

    async def body(service: Service) -> None:
        ctrl = service.controller
        await register(service)
        with store.engine.connect() as conn:
            max_pages["pages"] = int(conn.exec_driver_sql("PRAGMA page_count").scalar_one()) + 20
        store.engine.dispose()
        # Given three submissions queued behind a slow call, so they share one group (one transaction),
        # where the middle one needs more room than the database has left
        gate = threading.Event()
        slow = asyncio.ensure_future(service.call(gate.wait, 10))
        calls = [asyncio.ensure_future(service.call(ctrl.submit, "default", [spec(text)]))
                 for text in ("small-1", "big" * 150_000, "small-2")]  # fmt: skip
        await asyncio.sleep(0.05)  # let them queue
        gate.set()
        await slow
        outcomes = await asyncio.gather(*calls, return_exceptions=True)

        # Then every caller told success finds its task on disk, and the one that did not fit hears 503
        with sa.create_engine(store.url).connect() as conn:
            on_disk = {r[0] for r in conn.exec_driver_sql("SELECT id FROM tasks")}
        succeeded = [o[0].id for o in outcomes if isinstance(o, list)]
        assert succeeded and set(succeeded) <= on_disk, (outcomes, on_disk)
        big = outcomes[1]
        assert isinstance(big, StorageUnavailable), big
        assert big.type == "storage_unavailable" and big.retry_after_s > 0
        assert "INSERT" not in big.message and "sqlite" not in big.message.lower()
        assert len(on_disk) == len(succeeded)  # nothing of the refused one

        # When room returns, the same submission is taken, with no restart
        del max_pages["pages"]
        store.engine.dispose()
        again = await service.call(ctrl.submit, "default", [spec("big" * 150_000)])
        assert store.get_task(again[0].id) is not None

    run_with_service(store, FakeClock(), body)


def test_a_call_that_fails_on_its_own_leaves_the_rest_of_its_group_committed(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'ok.db'}")

    async def body(service: Service) -> None:
        ctrl = service.controller
        await register(service)
        gate = threading.Event()
        slow = asyncio.ensure_future(service.call(gate.wait, 10))
        first = asyncio.ensure_future(service.call(ctrl.submit, "default", [spec("a")]))
        bad = asyncio.ensure_future(service.call(ctrl.cancel, None, "t_missing"))
        last = asyncio.ensure_future(service.call(ctrl.submit, "default", [spec("b")]))
        await asyncio.sleep(0.05)
        gate.set()
        await slow
        assert (await first)[0].state is TaskState.QUEUED
        with pytest.raises(Exception, match="not found"):
            await bad
        ids = [(await first)[0].id, (await last)[0].id]
        assert all(store.get_task(i) is not None for i in ids)

    run_with_service(store, FakeClock(), body)


def test_a_call_alone_in_its_group_that_fails_after_writing_keeps_nothing_and_answers_its_error(
    tmp_path: Path,
) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'one.db'}")

    def submit_then_fail(ctrl: Controller) -> None:
        ctrl.submit("default", [spec("written, then undone")])
        raise LookupError("the call failed after its write")

    async def body(service: Service) -> None:
        ctrl = service.controller
        await register(service)
        # Given a call that writes and then raises, alone in its group (no savepoint around it)
        with pytest.raises(LookupError, match="after its write"):
            await service.call(submit_then_fail, ctrl)
        # Then its write was rolled back, and the next call alone commits as usual
        assert store.list_tasks(tenant=None) == []
        [task] = await service.call(ctrl.submit, "default", [spec("kept")])
        assert store.get_task(task.id) is not None

    run_with_service(store, FakeClock(), body)


@pytest.mark.postgres
def test_a_group_whose_postgres_connection_dies_is_run_again_call_by_call(tmp_path: Path) -> None:
    from tests.contract.test_store import PG_URL, _fresh_pg_database
    from turnout.store.sql import normalise_url

    url, name = _fresh_pg_database()
    store = open_store(url)

    def lose_the_connection() -> None:  # what a restarted or failed-over PostgreSQL does to a session
        with store._write() as conn:
            conn.exec_driver_sql("SELECT pg_terminate_backend(pg_backend_pid())")

    async def body(service: Service) -> None:
        ctrl = service.controller
        await register(service)
        gate = threading.Event()
        slow = asyncio.ensure_future(service.call(gate.wait, 10))
        first = asyncio.ensure_future(service.call(ctrl.submit, "default", [spec("a")]))
        killer = asyncio.ensure_future(service.call(lose_the_connection))
        last = asyncio.ensure_future(service.call(ctrl.submit, "default", [spec("b")]))
        await asyncio.sleep(0.05)
        gate.set()
        await slow
        with pytest.raises(StorageUnavailable):
            await killer
        ids = [(await first)[0].id, (await last)[0].id]  # acknowledged, each in a transaction of its own
        assert all(store.get_task(i) is not None for i in ids)

    try:
        run_with_service(store, FakeClock(), body)
    finally:
        admin = sa.create_engine(normalise_url(PG_URL), isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


# ---- heartbeats ------------------------------------------------------------------------------------


def test_heartbeats_waiting_behind_a_slow_write_still_keep_their_worker_and_its_task(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'beats.db'}")
    clock = FakeClock()

    async def body(service: Service) -> None:
        ctrl = service.controller
        worker = await register(service, heartbeat_s=1.0)
        task = (await service.call(ctrl.submit, "default", [spec()]))[0]
        assert (await service.call(ctrl.lease, worker.id, max_tasks=1)).leases
        # Given a write that holds the database thread, and the sweep queued behind it
        gate = threading.Event()
        stuck = asyncio.ensure_future(service.call(gate.wait, 30))
        await asyncio.sleep(0.05)
        sweep = asyncio.ensure_future(service.call(ctrl.reap, service.heard))
        # When the worker beats for ten periods meanwhile: each beat is answered though the database waits
        for _ in range(10):
            clock.now += 1.0
            state, _ = await asyncio.wait_for(service.heartbeat(worker.id, metrics=None, quarantined=None), 2)
            assert state == "healthy"
        gate.set()
        await stuck
        await sweep
        # Then the sweep, judging on when the beats arrived, leaves the worker and its task alone
        assert store.get_worker(worker.id).state is WorkerState.HEALTHY  # type: ignore[union-attr]
        after = store.get_task(task.id)
        assert after is not None and after.state is TaskState.LEASED and after.worker_id == worker.id

    run_with_service(store, clock, body, heartbeat_answer_s=0.05)


def test_a_worker_silent_for_three_heartbeats_is_judged_lost_and_its_task_requeued(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'silent.db'}")
    clock = FakeClock()

    async def body(service: Service) -> None:
        ctrl = service.controller
        worker = await register(service, heartbeat_s=1.0)
        task = (await service.call(ctrl.submit, "default", [spec()]))[0]
        assert (await service.call(ctrl.lease, worker.id, max_tasks=1)).leases
        clock.now += 2.9
        assert not await service.call(ctrl.reap, service.heard)
        clock.now += 0.2
        assert await service.call(ctrl.reap, service.heard)
        assert store.get_worker(worker.id).state is WorkerState.UNHEALTHY  # type: ignore[union-attr]
        after = store.get_task(task.id)
        assert after is not None and after.state is TaskState.QUEUED

    run_with_service(store, clock, body)


def test_a_restarted_controller_gives_every_worker_three_heartbeats_before_judging_it(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'restart.db'}"
    clock = FakeClock()
    first = Controller(open_store(url), ControllerSettings(), clock=clock)
    worker = first.register_worker(name="w", host="h", variants=[COUNT], cpu=1.0, memory_bytes=2**30, gpus=[],
                                   strategy="pack", heartbeat_s=1.0)  # fmt: skip
    first.submit("default", [spec()])
    assert first.lease(worker.id, max_tasks=1).leases
    first.store.close()
    # Given the controller was down for a minute, and a new one starts on the same database
    clock.now += 60
    second = Controller(open_store(url), ControllerSettings(), clock=clock)
    clock.now += 2.9
    second.reap()
    assert second.store.get_worker(worker.id).state is WorkerState.HEALTHY  # type: ignore[union-attr]
    # When the worker still says nothing for three heartbeats after the start, it is judged
    clock.now += 0.2
    second.reap()
    assert second.store.get_worker(worker.id).state is WorkerState.UNHEALTHY  # type: ignore[union-attr]
    second.store.close()


# ---- the held connection ---------------------------------------------------------------------------


def test_a_worker_whose_connection_closes_for_good_has_its_tasks_requeued_at_once(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'line.db'}")

    async def body(service: Service) -> None:
        ctrl = service.controller
        worker = await register(service)
        task = (await service.call(ctrl.submit, "default", [spec()]))[0]
        assert (await service.call(ctrl.lease, worker.id, max_tasks=1)).leases
        service.lifeline_opened(worker.id)
        service.lifeline_closed(worker.id, by_peer=True)
        await until(lambda: store.get_task(task.id).state is TaskState.QUEUED)  # type: ignore[union-attr]
        assert store.get_worker(worker.id).state is WorkerState.UNHEALTHY  # type: ignore[union-attr]
        requeued = store.get_task(task.id)
        assert requeued is not None and requeued.routing is not None
        assert (requeued.routing.last_error or {})["message"] == "worker connection closed"

    run_with_service(store, FakeClock(), body, reconnect_grace_s=0.05)


@pytest.mark.parametrize("how", ["reconnects", "controller stopping", "heartbeat after close"])
def test_a_closed_connection_that_is_not_a_dead_worker_changes_nothing(tmp_path: Path, how: str) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'alive.db'}")
    clock = FakeClock()

    async def body(service: Service) -> None:
        ctrl = service.controller
        worker = await register(service)
        task = (await service.call(ctrl.submit, "default", [spec()]))[0]
        assert (await service.call(ctrl.lease, worker.id, max_tasks=1)).leases
        service.lifeline_opened(worker.id)
        if how == "controller stopping":
            service.closing.set()
        service.lifeline_closed(worker.id, by_peer=how != "controller stopping")
        if how == "reconnects":
            service.lifeline_opened(worker.id)
        if how == "heartbeat after close":
            clock.now += 0.5
            await service.heartbeat(worker.id, metrics=None, quarantined=None)
        # the grace passes, and the judgement (if one were coming) is made on the database thread
        await asyncio.sleep(0.2)
        await service.call(lambda: None)
        assert store.get_worker(worker.id).state is WorkerState.HEALTHY  # type: ignore[union-attr]
        assert store.get_task(task.id).state is TaskState.LEASED  # type: ignore[union-attr]

    run_with_service(store, clock, body, reconnect_grace_s=0.05)


# ---- leases whose answer was lost --------------------------------------------------------------------


def test_a_lease_the_worker_never_lists_returns_to_the_queue_without_spending_a_retry(tmp_path: Path) -> None:
    clock = FakeClock()
    ctrl = Controller(open_store(f"sqlite:///{tmp_path / 'lost.db'}"), ControllerSettings(), clock=clock)
    worker = ctrl.register_worker(name="w", host="h", variants=[COUNT], cpu=1.0, memory_bytes=2**30, gpus=[],
                                  strategy="pack", heartbeat_s=1.0)  # fmt: skip
    task = ctrl.submit("default", [spec(max_retries=0)])[0]
    assert ctrl.lease(worker.id, max_tasks=1).leases  # the answer that never arrives
    # Within the grace, a lease request that does not list it yet changes nothing (it may be on its way)
    clock.now += 1.0
    ctrl.lease(worker.id, max_tasks=0, running=[])
    assert ctrl.get_task(None, task.id).state is TaskState.LEASED
    # After it, the lease is taken back: queued, its capacity free, no retry spent (max_retries=0 still runs)
    clock.now += 3.0
    ctrl.lease(worker.id, max_tasks=0, running=[])
    back = ctrl.get_task(None, task.id)
    assert back.state is TaskState.QUEUED and back.worker_id is None
    again = ctrl.lease(worker.id, max_tasks=1, running=[]).leases
    assert [le.task.id for le in again] == [task.id] and again[0].task.attempts == 2
    ctrl.store.close()


def test_a_lease_the_worker_lists_is_never_taken_back_however_long_it_runs(tmp_path: Path) -> None:
    clock = FakeClock()
    ctrl = Controller(open_store(f"sqlite:///{tmp_path / 'held.db'}"), ControllerSettings(), clock=clock)
    worker = ctrl.register_worker(name="w", host="h", variants=[COUNT], cpu=1.0, memory_bytes=2**30, gpus=[],
                                  strategy="pack", heartbeat_s=1.0)  # fmt: skip
    task = ctrl.submit("default", [spec()])[0]
    assert ctrl.lease(worker.id, max_tasks=1).leases
    for _ in range(5):
        clock.now += 60
        ctrl.heartbeat(worker.id)
        ctrl.lease(worker.id, max_tasks=0, running=[task.id])
    assert ctrl.get_task(None, task.id).worker_id == worker.id
    assert ctrl.get_task(None, task.id).state in (TaskState.LEASED, TaskState.RUNNING)
    ctrl.store.close()


class RecordingBus:
    """Stands in for the LISTEN/NOTIFY bus (store/notify.py): records what this replica publishes."""

    sender = "replica-a"

    def __init__(self) -> None:
        self.published: list[str] = []

    def publish(self, name: str) -> None:
        self.published.append(name)

    def close(self) -> None:
        pass


def test_every_wake_up_a_lease_poll_waits_on_crosses_to_the_other_replicas_and_back(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    bus = RecordingBus()

    async def body(service: Service) -> None:
        # Given a full worker's poll (it waits on `changes` and its own signal) and a free one's (`queue`)
        mine = service.worker_signal("w_1")
        waits = {"changes": service.changes.current(), "queue": service.queue_changed.current(),
                 "w=w_1": mine.current(), "tasks": service.tasks_changed.current(),
                 "events": service.events_added.current()}  # fmt: skip
        # When this replica fires each, every one is published for the other replicas
        service.changed()
        mine.notify()
        service.events_added.notify()
        assert set(bus.published) >= set(waits)
        # and when another replica's names arrive, each wakes the same waiters here, publishing nothing back
        for name in waits:
            event = {"changes": service.changes, "queue": service.queue_changed, "w=w_1": mine,
                     "tasks": service.tasks_changed, "events": service.events_added}[name].current()  # fmt: skip
            before = len(bus.published)
            service._remote({name})
            assert event.is_set(), name
            assert len(bus.published) == before
        assert all(e.is_set() for e in waits.values())

    try:
        run_with_service(store, FakeClock(), body, bus=bus)
    finally:
        store.close()
