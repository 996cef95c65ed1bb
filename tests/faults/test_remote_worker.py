"""A worker on another network reaches the controller over TLS, and rides out the network failing.

The worker runs in a network namespace of its own, joined to this host by a veth pair the test makes
(`tests/remote.py`); the controller listens on the host end with a certificate from a private CA, which
the worker trusts with `--ca-cert`. Cutting the link (the namespace's end set down) drops every packet
and closes no connection, as a pulled cable or a NAT that forgot its mappings does.

Heartbeats every 2 s make the lease 6 s (three missed heartbeats). A cut shorter than that leaves the task
with its worker: the result made during the cut is kept and sent once the link is back, and committed as
attempt 1. A cut longer than that expires the lease: the task runs again on another worker, the cut-off
worker's late result is refused, and once the link is back that worker reconnects by itself and serves
again. Skipped, with the reason, where this host does not permit network namespaces.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Processes
from tests.faults.conftest import APP, FaultReport, completed_runs, read_runs
from tests.remote import Netns, TlsCluster, private_ca, veth_namespace

HEARTBEAT_S = 2.0
LEASE_S = 3 * HEARTBEAT_S
SHORT_CUT_S = 2.0  # under the lease, even with a heartbeat lost just before the cut
LONG_CUT_S = 10.0  # well over the lease


@pytest.fixture
def remote(tmp_path: Path, processes: Processes) -> Iterator[tuple[TlsCluster, Netns]]:
    """A TLS controller on the host end of a fresh veth pair, and the namespace at its other end."""
    with veth_namespace() as netns:
        cluster = TlsCluster(tmp_path, processes, f"sqlite:///{tmp_path / 'turnout.db'}", heartbeat_s=HEARTBEAT_S,
                             host=netns.host_ip, tls=private_ca(tmp_path, [netns.host_ip]))  # fmt: skip
        cluster.start_controller()
        try:
            yield cluster, netns
        finally:
            processes.stop_all()  # the worker in the namespace goes before the namespace does


def _until(check: Any, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        time.sleep(0.1)


def _worker(cluster: TlsCluster, name: str) -> dict[str, Any]:
    return next(w for w in cluster.api("GET", "/v1/workers").json()["workers"] if w["name"] == name)


def _started(log: Path, task_id: str) -> bool:
    return any(what == "start" and tid == task_id for what, tid, _ in read_runs(log))


def _ended_at(log: Path, task_id: str) -> list[float]:
    return [ts for what, tid, ts in read_runs(log) if what == "end" and tid == task_id]


def test_a_worker_in_another_network_namespace_serves_tasks_over_tls(
    remote: tuple[TlsCluster, Netns], tmp_path: Path
) -> None:
    cluster, netns = remote
    cluster.start_remote_worker(netns, APP, name="far")
    log = tmp_path / "runs.log"
    done = cluster.result(cluster.submit("sleep", {"seconds": 0, "log": str(log)})["id"])
    assert done["state"] == "succeeded" and done["worker"] == _worker(cluster, "far")["id"]
    assert _worker(cluster, "far")["host"]  # registered through the link, from the namespace


def test_a_cut_shorter_than_the_lease_keeps_the_task_and_its_result_is_sent_after_it(
    remote: tuple[TlsCluster, Netns], tmp_path: Path, fault_report: FaultReport
) -> None:
    cluster, netns = remote
    cluster.start_remote_worker(netns, APP, name="far")
    log = tmp_path / "runs.log"
    # Given a task of 0.5 s running on the worker across the link
    task = cluster.submit("sleep", {"seconds": 0.5, "log": str(log)})
    _until(lambda: _started(log, task["id"]))
    # When the link is cut for less than the lease, while the task finishes
    netns.cut()
    try:
        time.sleep(SHORT_CUT_S)  # the fault's length
    finally:
        netns.restore()
    restored = time.time()
    # Then its result, made during the cut, arrives after it and is committed once, as attempt 1
    done = cluster.result(task["id"], wait=60)
    fault_report.recover_s = time.time() - restored
    ended = _ended_at(log, task["id"])
    assert done["state"] == "succeeded" and done["attempts"] == 1, done
    assert len(ended) == 1 and ended[0] < restored  # the result was made while the link was down
    assert _worker(cluster, "far")["state"] == "healthy"
    fault_report.committed_twice = sum(1 for n in completed_runs(log).values() if n > 1)
    fault_report.notes.append("processes and GPUs not at stake here: no process was killed")
    fault_report.check()


def test_a_cut_longer_than_the_lease_moves_the_task_refuses_the_late_result_and_the_worker_comes_back(
    remote: tuple[TlsCluster, Netns], tmp_path: Path, fault_report: FaultReport
) -> None:
    cluster, netns = remote
    cluster.start_remote_worker(netns, APP, name="far")
    far_id = _worker(cluster, "far")["id"]
    log = tmp_path / "runs.log"
    # Given a task of 1 s running on the worker across the link
    task = cluster.submit("sleep", {"seconds": 1, "log": str(log)})
    _until(lambda: _started(log, task["id"]))
    # When the link is cut for longer than the lease, and another worker (on this side) joins meanwhile
    netns.cut()
    cut_at = time.monotonic()
    try:
        cluster.start_remote_worker(None, APP, name="near")
        near_id = _worker(cluster, "near")["id"]
        _until(lambda: _worker(cluster, "far")["state"] == "unhealthy")  # its lease expired
        moved = cluster.result(task["id"], wait=60)
        time.sleep(max(0.0, LONG_CUT_S - (time.monotonic() - cut_at)))  # the fault's length, at least
    finally:
        netns.restore()
    restored = time.monotonic()
    # Then the task ran again on the other worker, and that result is the one committed
    assert moved["state"] == "succeeded" and moved["attempts"] == 2 and moved["worker"] == near_id, moved
    # and once the link is back, the cut-off worker reconnects by itself, its late result refused
    _until(lambda: _worker(cluster, "far")["state"] == "healthy")
    fault_report.recover_s = time.monotonic() - restored
    _until(lambda: len(_ended_at(log, task["id"])) == 2)  # attempt 1 did finish, on the far side
    after = cluster.api("GET", f"/v1/tasks/{task['id']}").json()
    assert (after["attempts"], after["worker"], after["output"]) == (2, near_id, moved["output"])
    # and it serves again: with the near worker drained, the next task runs across the link
    cluster.api("POST", f"/v1/workers/{near_id}/drain")
    again = cluster.result(cluster.submit("sleep", {"seconds": 0, "log": str(log)})["id"], wait=60)
    assert again["state"] == "succeeded" and again["worker"] == far_id
    fault_report.notes.append(
        "the task ran twice by design (at least once); one result was committed; "
        "processes and GPUs not at stake here"
    )
    fault_report.check()
