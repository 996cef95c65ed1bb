"""Task processes never outlive their worker, even when they do nothing to help (worker/containment.py).

Real workers, real escapees: a Python handler blocked in C while holding the GIL (so no Python-level guard
of its process can run), children that call `setsid` (so no process-group kill reaches them), and a
daemon that also left the handler's process tree. Each is found from outside by a marker in its argv; the
`marked` fixture kills whatever a failing test left behind. The worker-SIGKILL and cancel tests report the
fault: processes still alive, and seconds from the kill until none is.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import Cluster
from tests.faults.conftest import FaultReport, gpus_left_allocated
from turnout.worker import containment

APP = "tests.apps.containment_app:app"
SUPPORT = containment.probe()
needs_cgroup = pytest.mark.skipif(
    SUPPORT.cgroup_base is None, reason=f"no cgroup here: {SUPPORT.why_not.get('cgroup')}"
)
needs_pid_namespace = pytest.mark.skipif(
    not SUPPORT.pid_namespace, reason=f"no PID namespace here: {SUPPORT.why_not.get('pid_namespace')}"
)
# the two ways the kernel can hold a task's whole tree (`auto` picks the cgroup where it can)
KERNEL_SETTINGS = [
    pytest.param("auto", marks=needs_cgroup, id="cgroup"),
    pytest.param("pdeathsig,pid_namespace", marks=needs_pid_namespace, id="pid_namespace"),
]

# A command worker that starts the same escapees as the Python app, says `ready`, and hangs.
COMMAND = textwrap.dedent("""
    import json, subprocess, sys, time
    ESCAPEE = '''
    import os, sys, time
    mode = sys.argv[2]
    if mode in ("setsid", "daemon"):
        os.setsid()
    if mode == "daemon" and os.fork():
        os._exit(0)
    time.sleep(600)
    '''
    for line in sys.stdin:
        marker = json.loads(line)["marker"]
        for mode in ("plain", "setsid", "daemon"):
            subprocess.Popen([sys.executable, "-c", ESCAPEE, marker, mode], stdin=subprocess.DEVNULL)
        print(json.dumps({"event": "worker", "status": "ready"}), flush=True)
        time.sleep(600)
""")


# ---- finding processes from outside ------------------------------------------------------------------


def marked_pids(marker: str) -> list[int]:
    """Processes whose argv holds `marker`, zombies excluded (they are dead, only not yet reaped)."""
    needle = marker.encode()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (
                needle in (entry / "cmdline").read_bytes()
                and (entry / "stat").read_text().rpartition(")")[2].split()[0] != "Z"
            ):
                out.append(int(entry.name))
        except OSError:
            continue
    return out


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            continue
    return out


def wait_for(what: str, check: Any, timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """The pids of `pids` still alive after `timeout_s` (empty when all died in time)."""
    deadline = time.monotonic() + timeout_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive(pids)


def report_processes(
    fault_report: FaultReport,
    cluster: Cluster,
    task_id: str,
    pids: list[int],
    killed_at: float,
    timeout_s: float = 10.0,
) -> None:
    """Fill in and check `fault_report`: which of `pids` outlived the kill (seconds from `killed_at` until
    none did), and whether the task still reached an end (a clear failure is not a loss; a task left
    `running` for a dead handler is). The handlers here never return, so none can complete twice."""
    left = wait_gone(pids, timeout_s)
    fault_report.recover_s = None if left else time.monotonic() - killed_at
    done = cluster.result(task_id, wait=30)
    fault_report.accepted_lost = int(done["state"] not in ("succeeded", "failed", "cancelled"))
    fault_report.processes_left = len(left)
    fault_report.gpus_left_allocated = gpus_left_allocated(cluster)
    error = (done.get("error") or {}).get("type")
    ending = f"{done['state']} {error}" if error and error != done["state"] else done["state"]
    fault_report.notes.append(f"{len(pids)} processes watched; task {ending}")
    if left:
        fault_report.notes.append(f"alive: {left}")
    fault_report.check()


def descendants(pid: int, reaper: list[psutil.Process]) -> tuple[list[int], list[int]]:
    """The task processes under a worker (its children's trees) and its wardens, which must exit by
    themselves; all are handed to `reaper` for teardown."""
    tree, wardens = [], []
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            reaper.append(child)
            (wardens if "turnout.worker.containment" in " ".join(child.cmdline()) else tree).append(child.pid)
    return tree, wardens


@pytest.fixture
def marker() -> Iterator[str]:
    """A unique argv marker for one test's escapees; whatever still carries it at teardown is SIGKILLed."""
    mark = f"turnout-escapee-{uuid.uuid4().hex}"
    try:
        yield mark
    finally:
        for pid in marked_pids(mark):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def reaper() -> Iterator[list[psutil.Process]]:
    """Processes a test saw under a worker; any still running at teardown is SIGKILLed (psutil checks the
    start time, so a reused pid is never hit)."""
    seen: list[psutil.Process] = []
    try:
        yield seen
    finally:
        for proc in seen:
            with contextlib.suppress(psutil.Error):
                proc.kill()


def command_presets(tmp: Path) -> Path:
    program = tmp / "escaping.py"
    program.write_text(COMMAND)
    doc = {
        "models": {"escaping": {"inference": {"command": [sys.executable, str(program)], "mode": "one-off"}}}
    }
    path = tmp / "presets.yaml"
    path.write_text(json.dumps(doc))
    return path


def start_command_worker(cluster: Cluster, name: str, containment_setting: str = "auto") -> Any:
    extra = ["--presets", str(command_presets(cluster.tmp)), "--containment", containment_setting]
    return cluster.start_worker(name=name, extra=extra)


def submit_and_wait_ready(cluster: Cluster, marker: str, **options: Any) -> dict[str, Any]:
    """Submit an `escaping` task and wait until its three escapees are running."""
    task = cluster.submit("escaping", {"marker": marker}, max_retries=0, **options)
    wait_for("the three escapees", lambda: len(marked_pids(marker)) == 3)
    return task


# ---- a Python handler that holds the GIL ---------------------------------------------------------


@pytest.mark.parametrize("setting", KERNEL_SETTINGS)
def test_a_handler_holding_the_gil_and_its_setsid_children_die_with_a_sigkilled_worker(
    cluster: Cluster,
    tmp_path: Path,
    marker: str,
    reaper: list[psutil.Process],
    setting: str,
    fault_report: FaultReport,
) -> None:
    worker = cluster.start_worker(APP, name="victim", extra=["--containment", setting])
    ready = tmp_path / "ready"
    task = cluster.submit("hold_gil", {"marker": marker, "ready": str(ready)}, max_retries=0)
    wait_for("the handler to block holding the GIL", ready.exists)
    escapees = wait_for("three escapees", lambda: (p := marked_pids(marker)) and len(p) == 3 and p)
    tree, wardens = descendants(worker.pid, reaper)  # runner (and unshare), sentinel, children under it

    os.kill(worker.pid, signal.SIGKILL)  # the worker alone: nothing else is signalled by the test
    killed_at = time.monotonic()
    worker.wait(timeout=10)

    report_processes(fault_report, cluster, task["id"], sorted({*escapees, *tree, *wardens}), killed_at)
    assert wait_gone(escapees) == [], f"escaped the worker's death ({setting})"
    assert wait_gone(tree) == [], "a process of the handler's tree outlived the worker"
    assert wait_gone(wardens) == [], "the warden stays only as long as its cleanup takes"


# ---- a command worker's setsid children: worker death, cancel, timeout ---------------------------


@pytest.mark.parametrize("setting", KERNEL_SETTINGS)
def test_setsid_children_of_a_command_die_with_a_sigkilled_worker(
    cluster: Cluster, marker: str, setting: str
) -> None:
    worker = start_command_worker(cluster, "victim", setting)
    submit_and_wait_ready(cluster, marker)
    escapees = marked_pids(marker)
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(timeout=10)
    assert wait_gone(escapees) == []


@pytest.mark.parametrize("setting", KERNEL_SETTINGS)
def test_cancelling_a_command_kills_its_setsid_children(
    cluster: Cluster, marker: str, setting: str, fault_report: FaultReport
) -> None:
    start_command_worker(cluster, "w", setting)
    task = submit_and_wait_ready(cluster, marker)
    escapees = marked_pids(marker)
    resp = cluster.api("POST", f"/v1/tasks/{task['id']}/cancel")
    cancelled_at = time.monotonic()
    assert resp.status_code == 200, resp.text
    report_processes(fault_report, cluster, task["id"], escapees, cancelled_at, timeout_s=15)
    assert wait_gone(escapees, timeout_s=15) == []


@needs_cgroup
def test_a_timeout_kills_a_commands_setsid_children_and_says_what_held_them(
    cluster: Cluster, marker: str
) -> None:
    start_command_worker(cluster, "w")
    task = submit_and_wait_ready(cluster, marker, timeout_s=2)
    escapees = marked_pids(marker)
    done = cluster.result(task["id"], wait=30)
    assert done["state"] == "failed" and done["error"]["type"] == "timeout", done
    assert wait_gone(escapees) == []
    isolation = done["isolation"]
    assert isolation["process_group"] and isolation["pdeathsig"] and not isolation["pid_namespace"]
    assert isolation["cgroup"].startswith(str(SUPPORT.cgroup_base) + "/")
    wait_for("its cgroup to be removed once emptied", lambda: not Path(isolation["cgroup"]).exists())


@needs_pid_namespace
def test_a_timeout_in_a_pid_namespace_takes_the_whole_namespace(cluster: Cluster, marker: str) -> None:
    start_command_worker(cluster, "w", "pdeathsig,pid_namespace")
    task = submit_and_wait_ready(cluster, marker, timeout_s=2)
    escapees = marked_pids(marker)
    done = cluster.result(task["id"], wait=30)
    assert done["state"] == "failed" and done["error"]["type"] == "timeout", done
    assert wait_gone(escapees) == []
    assert done["isolation"]["pid_namespace"] is True and done["isolation"]["cgroup"] is None


# ---- what the task record says -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        pytest.param("auto", {"pdeathsig": True, "pid_namespace": False, "cgroup": True}, marks=needs_cgroup),
        pytest.param(
            "pdeathsig,pid_namespace",
            {"pdeathsig": True, "pid_namespace": True, "cgroup": False},
            marks=needs_pid_namespace,
        ),
        pytest.param("none", {"pdeathsig": False, "pid_namespace": False, "cgroup": False}),
    ],
)
def test_each_task_records_the_isolation_its_worker_applied(
    cluster: Cluster, setting: str, expected: dict[str, bool]
) -> None:
    cluster.start_worker(APP, name="w", extra=["--containment", setting])
    done = cluster.result(cluster.submit("quick", {})["id"])
    assert done["state"] == "succeeded", done
    isolation = done["isolation"]
    got = {"pdeathsig": isolation["pdeathsig"], "pid_namespace": isolation["pid_namespace"],
           "cgroup": isolation["cgroup"] is not None}  # fmt: skip
    assert got == expected and isolation["process_group"] is True


def test_with_containment_off_a_timeout_still_kills_the_process_group(cluster: Cluster, marker: str) -> None:
    """The old guarantee stands alone: the group dies on timeout; only its `plain` member was in it."""
    start_command_worker(cluster, "w", containment_setting="none")
    task = submit_and_wait_ready(cluster, marker, timeout_s=2)
    plain = [p for p in marked_pids(marker) if "plain" in " ".join(psutil.Process(p).cmdline())]
    done = cluster.result(task["id"], wait=30)
    assert done["state"] == "failed" and done["error"]["type"] == "timeout", done
    assert done["isolation"] == {
        "process_group": True,
        "pdeathsig": False,
        "pid_namespace": False,
        "cgroup": None,
        "mode": "none",  # the preset's own isolation: no sandbox
    }
    assert len(plain) == 1 and wait_gone(plain) == []
