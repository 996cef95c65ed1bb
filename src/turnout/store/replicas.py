"""What several controller replicas on one database need to agree: one clock, and who runs each sweep.

**The database's clock.** Leases and liveness are judged by comparing times that different replicas
wrote (a heartbeat stored by one, judged by another). Replicas whose clocks disagree by seconds would
judge the same worker differently, so on PostgreSQL every replica reads time as the database server's
clock: `DbClock` measures its offset from the local clock (the sample with the shortest round trip of
a few) when it starts and again every `refresh_s` on a thread of its own, and `clock()` is the local
clock plus that offset: no query on any hot path, and never a wait on the event loop.

**Fresh statistics.** A queue that fills in seconds (a batch of thousands into a new or quiet database)
outruns autovacuum's ANALYZE, which may look a minute later: the planner then believes a handful of rows
are queued and sorts them all on every lease instead of reading the lease-order index, a cost that grows
with the queue. `refresh_statistics` runs ANALYZE on the tasks table once enough of it changed since
the last one; on its own connection, never waiting for a lock (autovacuum may hold it), by one replica.

**Sweep claims.** The periodic sweep (silent workers, overdue tasks, placement timeouts) is safe to run on
every replica, since each change is a conditional update, but running it everywhere is wasted work and
contention. `claim_sweep` lets one replica per interval run it: a conditional update of the sweep's row
in `sweeps`, in the sweep's own transaction, so a sweep whose transaction is lost gives its claim back,
and a replica that dies simply stops claiming: another takes over within one interval. A row another
replica's transaction holds is skipped, not waited for: that replica is sweeping now.

**One lease at a time per worker.** A worker may ask for work twice at once (its long poll, and the lease its
completion carries), perhaps through two replicas. `hold_worker` makes the second wait for the first's commit,
so each computes the worker's free room from what the other leased: it is never given more than it holds.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import sqlalchemy as sa

from turnout.store import schema
from turnout.store.base import Store
from turnout.store.sql import SqlStore

log = logging.getLogger("turnout.replicas")
Clock = Callable[[], float]


class DbClock:
    """Epoch seconds by the database server's clock, read locally: `local()` plus a measured offset."""

    SAMPLES = 3

    def __init__(self, engine: sa.Engine, *, local: Clock = time.time, refresh_s: float = 10.0) -> None:
        self.engine = engine
        self.local = local
        self.refresh_s = refresh_s
        self.offset_s = 0.0
        self.round_trip_s: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.measure()

    def __call__(self) -> float:
        return self.local() + self.offset_s

    def measure(self) -> float:
        """Measure the offset now (the sample with the shortest round trip); returns it."""
        best: tuple[float, float] | None = None
        with self.engine.connect() as conn:
            for _ in range(self.SAMPLES):
                sent = self.local()
                server = float(
                    conn.exec_driver_sql("SELECT extract(epoch from clock_timestamp())").scalar_one()
                )
                back = self.local()
                if best is None or back - sent < best[0]:
                    best = (back - sent, server - (sent + back) / 2)
        assert best is not None  # SAMPLES >= 1
        self.round_trip_s, self.offset_s = best
        return self.offset_s

    def start(self) -> None:
        """Re-measure every `refresh_s` on a daemon thread (clocks drift; an NTP step moves ours)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._refresh_forever, name="turnout-dbclock", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _refresh_forever(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                before = self.offset_s
                after = self.measure()
                if abs(after - before) > 0.5:
                    log.warning("this host's clock moved %.3f s against the database's", before - after)
            except Exception as exc:  # keep the last offset: a database that is away now has not moved
                log.debug("could not read the database's clock: %s", exc)


def clock_for(store: Store) -> Clock:
    """The clock a controller on `store` judges by: the database's on PostgreSQL, the local one on SQLite
    (one controller per SQLite file, so there is nobody to disagree with)."""
    if not isinstance(store, SqlStore) or store.dialect != "postgresql":
        return time.time
    clock = DbClock(store.engine)
    clock.start()
    if abs(clock.offset_s) > 1.0:
        log.warning("this host's clock is %.3f s off the database's; judging times by the database's",
                    -clock.offset_s)  # fmt: skip
    return clock


def claim_sweep(store: Store, name: str, holder: str, now: float, interval_s: float) -> bool:
    """Whether this replica (`holder`) runs sweep `name` now: nobody ran it in the last ~interval.

    Runs in the caller's transaction (inside `SqlStore.group()`): if the sweep's transaction is lost, so
    is the claim. 10 % of slack lets the claimant of the last round claim the next one on its own timer.
    SQLite has one controller per file: every claim is granted, with no write (an idle controller's sweep
    must not cost a commit, an fsync, twice a second).
    """
    if not isinstance(store, SqlStore) or store.dialect != "postgresql":
        return True
    sw = schema.sweeps
    due = now - interval_s * 0.9
    # the row, unless another replica's transaction holds it (its sweep is under way): not waited for, or
    # this replica's one database thread would stand still until the other's group commits
    free = sa.select(sw.c.name).where(sw.c.name == name).with_for_update(skip_locked=True).scalar_subquery()
    with store._write() as conn:
        claimed = conn.execute(
            sw.update()
            .where(sw.c.name == free, sa.or_(sw.c.swept_at <= due, sw.c.holder == holder))
            .values(holder=holder, swept_at=now)
        ).rowcount
        if claimed:
            return True
        if conn.execute(sa.select(sw.c.name).where(sw.c.name == name)).first() is not None:
            return False  # another replica swept a moment ago, or sweeps now
        with contextlib.suppress(sa.exc.IntegrityError), conn.begin_nested():
            conn.execute(sw.insert().values(name=name, holder=holder, swept_at=now))
            return True
        return False  # another replica made the row first, just now


LEASE_LOCK_SPACE = 0x7475726E  # "turn": this application's advisory locks, apart from anyone else's


def hold_worker(store: Store, worker_id: str) -> None:
    """Hold `worker_id`'s leasing until the caller's transaction ends (inside `SqlStore.group()`).

    PostgreSQL: a transaction-scoped advisory lock, so heartbeats and other writes to the worker's row never
    wait on it, only another lease for the same worker (two ids that hash alike merely take turns). SQLite has
    one controller per file, whose database thread already runs one call at a time: nothing to hold.
    """
    if not isinstance(store, SqlStore) or store.dialect != "postgresql":
        return
    with store._write() as conn:
        conn.execute(
            sa.text("SELECT pg_advisory_xact_lock(:space, hashtext(:worker))"),
            {"space": LEASE_LOCK_SPACE, "worker": worker_id},
        )


ANALYZE_MIN_CHANGES = 1000  # rows changed since the last ANALYZE before the tasks table is analysed again
ANALYZE_FRACTION = 0.2  # ... and at least this share of its live rows


def refresh_statistics(store: Store) -> bool:
    """ANALYZE the tasks table if it changed much since its statistics were taken (PostgreSQL only);
    returns whether it did. Runs on a connection of its own (call it off the database thread)."""
    if not isinstance(store, SqlStore) or store.dialect != "postgresql":
        return False
    with store.engine.connect() as conn:
        row = conn.exec_driver_sql(
            "SELECT n_mod_since_analyze, n_live_tup FROM pg_stat_user_tables WHERE relname = 'tasks'"
        ).first()
        if row is None or row[0] < max(ANALYZE_MIN_CHANGES, ANALYZE_FRACTION * row[1]):
            return False
        try:
            conn.exec_driver_sql(
                "SET lock_timeout = '200ms'"
            )  # autovacuum or another replica has it: next time
            conn.exec_driver_sql("ANALYZE tasks")
            conn.commit()
        except sa.exc.DBAPIError as exc:
            conn.rollback()
            log.debug("ANALYZE tasks skipped: %s", str(exc).splitlines()[0])
            return False
        finally:
            with contextlib.suppress(sa.exc.DBAPIError):
                conn.exec_driver_sql("RESET lock_timeout")
                conn.commit()
    return True
