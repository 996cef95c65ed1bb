"""What the host allows, decided from its own files; cgroups made, killed and swept for real where it can.

The probe reads /proc/self/mountinfo and /proc/self/cgroup: parsed here from text. The cgroup tests use the
real cgroup2 hierarchy (skipped where this host has none) inside a directory of their own, removed at the
end whatever happens; their processes are real and killed in teardown.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from turnout.errors import InvalidInput
from turnout.worker import containment
from turnout.worker.containment import Containment, HostSupport
from turnout.worker.processes import ProtocolProcess
from turnout.worker.sandboxed import LIMITS_PREFIX, limits_cgroup_name, sweep_limits

SUPPORT = containment.probe()
needs_cgroup = pytest.mark.skipif(
    SUPPORT.cgroup_base is None, reason=f"no cgroup here: {SUPPORT.why_not.get('cgroup')}"
)

# this host's layout: cgroup v1 controllers under a tmpfs, the v2 hierarchy at .../unified
MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""


# ---- probing from the host's files ---------------------------------------------------------------


def test_the_cgroup2_mount_is_found_in_mountinfo_not_assumed() -> None:
    assert containment.cgroup2_mount(MOUNTINFO) == Path("/sys/fs/cgroup/unified")
    systemd = "29 22 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
    assert containment.cgroup2_mount(systemd) == Path("/sys/fs/cgroup")  # optional fields before " - "
    escaped = "29 22 0:26 / /mnt/my\\040cgroups rw - cgroup2 none rw\n"
    assert containment.cgroup2_mount(escaped) == Path("/mnt/my cgroups")
    assert containment.cgroup2_mount(MOUNTINFO.replace("cgroup2 cgroup2", "cgroup cgroup")) is None


def test_our_own_cgroup_is_the_v2_line_of_proc_self_cgroup() -> None:
    assert containment.own_cgroup("4:memory:/x\n0::/\n") == "/"
    assert containment.own_cgroup("0::/system.slice/turnout.service\n") == "/system.slice/turnout.service"
    assert containment.own_cgroup("4:memory:/x\n1:cpu:/\n") is None  # cgroup v1 only


def test_the_setting_names_mechanisms_and_a_typo_is_refused_naming_the_option() -> None:
    assert containment.parse_setting("auto") is None
    assert containment.parse_setting("none") == frozenset()
    assert containment.parse_setting("pdeathsig, cgroup") == {"pdeathsig", "cgroup"}
    with pytest.raises(InvalidInput) as err:
        containment.parse_setting("pdeathsig,cgroups")
    assert err.value.field == "containment" and "'cgroups'" in err.value.message


def test_auto_prefers_a_cgroup_and_takes_a_pid_namespace_only_without_one() -> None:
    both = HostSupport(
        pdeathsig=True, cgroup_base=Path("/cg/turnout"), pid_namespace=True, unshare="/bin/unshare"
    )
    no_cgroup = HostSupport(pdeathsig=True, cgroup_base=None, pid_namespace=True, unshare="/bin/unshare")
    assert containment.choose(both, None) == {"pdeathsig", "cgroup"}
    assert containment.choose(no_cgroup, None) == {"pdeathsig", "pid_namespace"}
    assert containment.choose(containment.NOTHING, None) == frozenset()
    # asked for explicitly: applied where the host allows, never claimed where it does not
    assert containment.choose(no_cgroup, frozenset({"cgroup", "pid_namespace"})) == {"pid_namespace"}


def test_a_worker_tag_says_whether_its_worker_still_lives() -> None:
    assert containment.owner_alive(containment.worker_tag()) is True
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        tag = containment.worker_tag(child.pid)
        assert containment.owner_alive(tag) is True
    finally:
        child.kill()
        child.wait()
    assert containment.owner_alive(tag) is False
    _boot, pid, ticks = containment.worker_tag().split("-")
    assert containment.owner_alive(f"00000000-{pid}-{ticks}") is False  # the same pid in another boot
    assert containment.owner_alive("not-a-tag") is None and containment.owner_alive("cgroup.procs") is None


# ---- real cgroups --------------------------------------------------------------------------------


@pytest.fixture
def scratch_base() -> Iterator[Path]:
    """A cgroup directory of this test's own, standing in for `<cgroup2>/turnout`; destroyed at the end."""
    assert SUPPORT.cgroup_base is not None
    base = SUPPORT.cgroup_base / f"test-{uuid.uuid4().hex[:12]}"
    base.mkdir()
    try:
        yield base
    finally:
        containment.destroy_cgroup(base)


def start_in(cgroup: Path, *, setsid: bool = True) -> subprocess.Popen[bytes]:
    """A sleeper that joined `cgroup` before exec (and left its process group, as an escapee does)."""
    procs = str(cgroup / "cgroup.procs")

    def join() -> None:
        Path(procs).write_text("0")

    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], preexec_fn=join, start_new_session=setsid
    )


def wait_exit(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> int | None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        return proc.wait(timeout=timeout_s)
    return None


@needs_cgroup
def test_killing_a_cgroup_ends_a_process_that_left_its_group(scratch_base: Path) -> None:
    cgroup = scratch_base / "p1"
    cgroup.mkdir()
    proc = start_in(cgroup)
    try:
        assert containment.in_cgroup(proc.pid, cgroup, scratch_base)
        assert containment.destroy_cgroup(cgroup)
        assert wait_exit(proc) == -9
        assert not cgroup.exists()
    finally:
        proc.kill()
        proc.wait()


@needs_cgroup
def test_a_starting_worker_removes_only_the_cgroups_of_dead_workers(scratch_base: Path) -> None:
    dead_worker = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_tag = containment.worker_tag(dead_worker.pid)  # read while it runs: its start ticks
    dead_worker.wait()
    live_tag = containment.worker_tag()
    for tag in (dead_tag, live_tag, "not-a-worker"):
        (scratch_base / tag / "p1").mkdir(parents=True)
    orphan = start_in(scratch_base / dead_tag / "p1")  # what a SIGKILLed worker left running
    survivor = start_in(scratch_base / live_tag / "p1")
    try:
        removed = containment.sweep_stale(scratch_base, own_tag="someone-else")
        assert removed == [scratch_base / dead_tag]
        assert wait_exit(orphan) == -9
        assert survivor.poll() is None
        assert (scratch_base / live_tag / "p1").exists() and (scratch_base / "not-a-worker").exists()
    finally:
        for proc in (orphan, survivor):
            proc.kill()
            proc.wait()


@needs_cgroup
def test_a_protocol_process_that_is_killed_takes_its_setsid_children_and_its_cgroup(tmp_path: Path) -> None:
    """In-process, with this host's containment: kill() reaches what left the group, and cleans up."""
    pidfile = tmp_path / "escapee"
    program = (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import os, time; os.setsid(); time.sleep(600)'])\n"
        f"open({str(pidfile)!r} + '.part', 'w').write(str(child.pid))\n"
        f"os.replace({str(pidfile)!r} + '.part', {str(pidfile)!r})\n"
        "time.sleep(600)\n"
    )
    contain = Containment(SUPPORT, frozenset({"pdeathsig", "cgroup"}))

    async def scenario() -> tuple[dict[str, object] | None, int]:
        proc = ProtocolProcess([sys.executable, "-c", program], dict(os.environ), contain=contain)
        await proc.start()
        try:
            deadline = time.monotonic() + 10
            while not pidfile.exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            escapee = int(pidfile.read_text())
            proc.kill()
            await proc.close()
            return proc.isolation, escapee
        finally:
            proc.kill()

    try:
        isolation, escapee = asyncio.run(scenario())
        assert isolation is not None and isolation["pdeathsig"] is True
        cgroup = Path(str(isolation["cgroup"]))
        assert cgroup.parent == contain.worker_dir
        deadline = time.monotonic() + 10
        while _running(escapee) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _running(escapee)
        assert not cgroup.exists()
    finally:
        if pidfile.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pidfile.read_text()), 9)
        contain.close()  # the warden removes this test's worker directory


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_process_keeps_the_isolation_its_maker_recorded_beside_what_containment_applied() -> None:
    """A sandbox (or a container) records its keys before start; containment's are added at start, and a key
    both know (`pid_namespace`) is the maker's, which describes the program itself."""
    contain = Containment(containment.NOTHING, frozenset())

    async def scenario() -> dict[str, object] | None:
        proc = ProtocolProcess([sys.executable, "-c", "pass"], dict(os.environ), contain=contain)
        proc.isolation = {"mode": "sandbox", "pid_namespace": True, "network": False}
        await proc.start()
        await proc.close()
        return proc.isolation

    assert asyncio.run(scenario()) == {"process_group": True, "pdeathsig": False, "pid_namespace": True,
                                       "cgroup": None, "mode": "sandbox", "network": False}  # fmt: skip


@needs_cgroup
def test_a_starting_sandbox_host_removes_the_limits_cgroups_of_dead_workers_only(scratch_base: Path) -> None:
    """A sandboxed program joins a limits cgroup under the worker's own cgroup, outside containment's subtree:
    after a SIGKILLed worker nothing else removes it (nor kills what it holds)."""
    dead_worker = subprocess.Popen([sys.executable, "-c", "pass"])
    dead = f"{LIMITS_PREFIX}{containment.worker_tag(dead_worker.pid)}-0badc0de"
    dead_worker.wait()
    mine = limits_cgroup_name()
    for name in (dead, mine, f"{LIMITS_PREFIX}not-a-tag", "p1"):
        (scratch_base / name).mkdir()
    orphan = start_in(scratch_base / dead)  # what the dead worker's sandboxed program left running
    survivor = start_in(scratch_base / mine)
    try:
        assert sweep_limits(scratch_base) == [scratch_base / dead]
        assert wait_exit(orphan) == -9 and survivor.poll() is None
        assert all((scratch_base / name).is_dir() for name in (mine, f"{LIMITS_PREFIX}not-a-tag", "p1"))
    finally:
        for proc in (orphan, survivor):
            proc.kill()
            proc.wait()
