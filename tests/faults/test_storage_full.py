"""A full disk under the controller's SQLite database: 503 `storage_unavailable`, nothing half-accepted,
and service again on its own once there is room.

The database lives on a small tmpfs mounted for the test (the host must allow `mount`; where it does not,
the tests are skipped with the reason). The disk is filled with a file; deleting the file gives room back.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Cluster, Processes, free_port
from tests.contract.test_store import as_before_migration_10
from tests.faults.conftest import FaultReport, completed_runs, gpus_left_allocated
from turnout.models import Task, TaskSpec, TaskState
from turnout.store import SqlStore

APP = "tests.apps.testapp:app"
DISK = "32m"


def fill(disk: Path) -> Path:
    """Write a file until the disk has no room left; returns it (delete it to free the room)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        block = b"\0" * 65536
        while True:
            try:
                os.write(fd, block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(block) == 512:
                    return filler
                block = block[: len(block) // 2]  # the last scraps too
    finally:
        os.close(fd)


@contextlib.contextmanager
def small_disk(where: Path, size: str = DISK) -> Iterator[Path]:
    """A freshly mounted tmpfs of `size` at `where` (skips the test where the host does not permit `mount`);
    unmounted afterwards. Stop what holds files open on it first."""
    where.mkdir(exist_ok=True)
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
                                 capture_output=True, text=True)  # fmt: skip
        problem = (
            (mounted.stderr.strip() or f"mount exited {mounted.returncode}") if mounted.returncode else ""
        )
    except FileNotFoundError:
        problem = "no mount command"
    if problem:  # only where the host does not permit it: where it does, the test runs (CI included)
        pytest.skip(f"cannot mount a tmpfs for the database here: {problem}")
    try:
        yield where
    finally:
        with contextlib.suppress(OSError):
            (where / "filler").unlink()
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture
def cluster_on_small_disk(tmp_path: Path) -> Iterator[tuple[Cluster, Path]]:
    """A controller whose home (and SQLite database) is a freshly mounted tmpfs of DISK bytes."""
    with small_disk(tmp_path / "home") as home:
        procs = Processes()
        try:
            cluster = Cluster(tmp_path, procs, f"sqlite:///{home / 'turnout.db'}")
            cluster.start_controller()
            yield cluster, home
        finally:
            procs.stop_all()  # the controller holds the database open: stop it before unmounting


@pytest.mark.parametrize("room", [0, 512 * 1024], ids=["no room", "room to open, not to rebuild"])
def test_an_upgrade_on_a_full_disk_changes_nothing_says_so_in_one_line_and_runs_once_there_is_room(
    tmp_path: Path, fault_report: FaultReport, room: int
) -> None:
    """Migration 10 rebuilds the tasks table, so it needs room for a second copy: on a full disk (with no
    room at all, or room to open the database but not for the copy, so the rebuild fails halfway) the
    controller stops before serving, with one line that says what to do, and the database is as it was;
    once there is room, the same command upgrades it, every task kept."""
    with small_disk(tmp_path / "disk", "16m") as disk:
        url = f"sqlite:///{disk / 'turnout.db'}"
        store = SqlStore(url)
        tasks = [Task(id=f"t_{i:06d}", tenant="default", spec=TaskSpec("cap", {"text": "x" * 1000, "n": i}),
                      state=TaskState.SUCCEEDED, created_at=1.0 + i, queued_at=1.0 + i, output={"n": i})
                 for i in range(1500)]  # fmt: skip
        store.insert_tasks(tasks)
        store.close()
        old_order = as_before_migration_10(disk / "turnout.db")
        filler = fill(disk)
        os.truncate(filler, max(0, filler.stat().st_size - room))
        argv = [sys.executable, "-m", "turnout.cli", "controller", "--db", url, "--port", str(free_port()),
                "--home", str(tmp_path / "home")]  # fmt: skip
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert out.returncode == 2, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr
        assert "its disk is full" in out.stderr and "free space on that disk" in out.stderr, out.stderr
        if room:  # it opened, and the rebuild ran out of room while writing: the migration itself was undone
            assert "database or disk is full" in out.stderr, out.stderr
        filler.unlink()  # room to read (SQLite's shared-memory file) before anything opens it to write
        with contextlib.closing(sqlite3.connect(disk / "turnout.db")) as db:
            assert [row[1] for row in db.execute("PRAGMA table_info(tasks)")] == old_order
            assert db.execute("SELECT MAX(version) FROM schema_migrations").fetchone() == (9,)
            assert db.execute("SELECT COUNT(*) FROM tasks").fetchone() == (1500,)
        started = time.monotonic()
        store = SqlStore(url)  # what the controller opens first
        try:
            fault_report.recover_s = time.monotonic() - started  # the upgrade, once there is room
            assert store.schema_version >= 10
            kept = store.get_tasks([t.id for t in tasks])
        finally:
            store.close()
        with contextlib.closing(sqlite3.connect(disk / "turnout.db")) as db:
            assert [row[1] for row in db.execute("PRAGMA table_info(tasks)")][-3:] == [
                "error",
                "output",
                "input",
            ]
    fault_report.accepted_lost = len(tasks) - sum(1 for t in kept if t in tasks)
    fault_report.notes.append("the upgrade refused on a full disk in one line, the database unchanged; "
                              f"{len(tasks)} tasks rebuilt once there was room")  # fmt: skip
    fault_report.check()


def ids_listed(cluster: Cluster) -> set[str]:
    return {t["id"] for t in cluster.api("GET", "/v1/tasks", params={"limit": 1000}).json()["tasks"]}


def test_a_full_disk_refuses_submissions_with_503_and_service_resumes_when_room_returns(
    cluster_on_small_disk: tuple[Cluster, Path], tmp_path: Path, fault_report: FaultReport
) -> None:
    cluster, disk = cluster_on_small_disk
    log = tmp_path / "runs.log"  # off the small disk
    cluster.start_worker(APP, name="w", extra=["--cpus", "0.05"])  # too small to run any
    accepted = {
        cluster.submit("logged_sleep", {"log": str(log), "n": i}, placement_timeout_s=600)["id"]
        for i in range(20)
    }

    filler = fill(disk)
    refused = []
    spec = {"capability": "logged_sleep", "placement_timeout_s": 600}
    for body, path in [
        ({**spec, "input": {"n": "one"}}, "/v1/tasks"),
        ({"tasks": [{**spec, "input": {"n": i, "pad": "x" * 2000}} for i in range(50)]}, "/v1/tasks/batch"),
    ]:
        resp = cluster.api("POST", path, json=body)
        refused.append(resp)
        assert resp.status_code == 503, resp.text
        error = resp.json()["error"]
        assert error["type"] == "storage_unavailable"
        assert int(resp.headers["Retry-After"]) >= 1
        assert "INSERT" not in error["message"] and "sqlite" not in error["message"].lower()
    assert ids_listed(cluster) == accepted  # nothing of the refused submissions, all of the earlier ones
    assert cluster.api("GET", "/healthz").status_code == 200

    filler.unlink()
    freed_at = time.monotonic()
    deadline = freed_at + 20
    while True:  # the controller recovers on its own: no restart
        resp = cluster.api("POST", "/v1/tasks", json={**spec, "input": {"log": str(log), "n": "after"}})
        if resp.status_code == 201 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    recover_s = time.monotonic() - freed_at
    assert resp.status_code == 201, resp.text
    assert ids_listed(cluster) == accepted | {resp.json()["id"]}
    assert next(w for w in cluster.api("GET", "/v1/workers").json()["workers"])["state"] == "healthy"

    # every task answered 201, before the disk filled or after, is there and runs exactly once
    accepted.add(resp.json()["id"])
    cluster.start_worker(APP, name="runner", extra=["--cpus", "1"])
    missing = accepted - ids_listed(cluster)
    states = [cluster.result(tid, wait=60)["state"] for tid in accepted - missing]
    fault_report.recover_s = recover_s  # from freeing the disk to the first submission answered 201
    fault_report.accepted_lost = len(missing) + sum(1 for state in states if state != "succeeded")
    fault_report.committed_twice = sum(1 for n in completed_runs(log).values() if n > 1)
    fault_report.gpus_left_allocated = gpus_left_allocated(cluster)
    fault_report.notes.append(
        f"{len(accepted)} accepted; a task and a batch of 50 refused 503; no process killed"
    )
    fault_report.check()
    assert set(completed_runs(log)) == accepted


def test_a_worker_heartbeating_through_a_full_disk_keeps_its_task_which_completes_once(
    cluster_on_small_disk: tuple[Cluster, Path], tmp_path: Path
) -> None:
    cluster, disk = cluster_on_small_disk
    runs = tmp_path / "runs.log"  # off the small disk
    cluster.start_worker(APP, name="w")
    task = cluster.submit("count", {"log": str(runs), "sleep": 6}, timeout_s=120)
    deadline = time.monotonic() + 30
    while not runs.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runs.exists(), "the task did not start"

    filler = fill(disk)  # the heartbeats' own writes fail now, for longer than three heartbeats
    full_until = time.monotonic() + 4 * cluster.heartbeat_s
    while time.monotonic() < full_until:
        workers = cluster.api("GET", "/v1/workers").json()["workers"]
        assert [w["state"] for w in workers] == ["healthy"]
        time.sleep(0.2)
    filler.unlink()

    done = cluster.result(task["id"], wait=60)
    assert done["state"] == "succeeded" and done["attempts"] == 1, done
    assert len(runs.read_text().splitlines()) == 1
    assert [w["state"] for w in cluster.api("GET", "/v1/workers").json()["workers"]] == ["healthy"]
