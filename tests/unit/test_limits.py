"""Limits of a sandboxed program: cgroup v2 where its controllers are, rlimits (memory) where not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from turnout.worker.limits import Limits, make_cgroup, own_cgroup_dir, plan_limits

GIB = 2**30
ALL = frozenset({"memory", "cpu", "pids"})


@pytest.mark.parametrize(
    ("limits", "controllers", "files", "rlimits", "record"),
    [
        (Limits(GIB, 1.5, 64), ALL,
         {"memory.max": str(GIB), "memory.swap.max": "0", "cpu.max": "150000 100000", "pids.max": "64"}, {},
         {"memory": {"bytes": GIB, "via": "cgroup"}, "cpu": {"cores": 1.5, "via": "cgroup"},
          "pids": {"max": 64, "via": "cgroup"}}),
        (Limits(GIB, 1.0, 64), frozenset(), {}, {"RLIMIT_DATA": GIB}, {"memory": {"bytes": GIB, "via": "rlimit"}}),
        (Limits(GIB, 0.5, 64), frozenset({"pids"}), {"pids.max": "64"}, {"RLIMIT_DATA": GIB},
         {"memory": {"bytes": GIB, "via": "rlimit"}, "pids": {"max": 64, "via": "cgroup"}}),
        (Limits(0, 0.0, 0), ALL, {}, {}, {}),
        (Limits(0, 0.001, 0), ALL, {"cpu.max": "1000 100000"}, {}, {"cpu": {"cores": 0.001, "via": "cgroup"}}),
    ],
    ids=["all by cgroup", "no cgroup: memory by rlimit, cpu and pids not applied", "partial", "nothing asked",
         "tiny cpu share keeps the kernel's minimum quota"],
)  # fmt: skip
def test_each_limit_goes_to_the_mechanism_that_can_hold_it(
    limits: Limits, controllers: frozenset[str], files: dict, rlimits: dict, record: dict
) -> None:
    plan = plan_limits(limits, controllers)
    assert (plan.cgroup_files, plan.rlimits, plan.record) == (files, rlimits, record)


def test_a_program_asking_nothing_still_gets_the_process_cap_where_a_cgroup_can_hold_it() -> None:
    assert plan_limits(Limits(), ALL).cgroup_files == {"pids.max": "4096"}
    assert plan_limits(Limits(), frozenset()).record == {}


HYBRID = """\
24 23 0:22 / /sys/fs/cgroup ro,nosuid,nodev,noexec - tmpfs tmpfs ro,mode=755
27 24 0:25 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate
28 24 0:26 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory
"""
PURE = "30 25 0:27 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw\n"
BIND_OF_SUBTREE = "30 25 0:27 /user.slice /mnt/cg rw - cgroup2 cgroup2 rw\n"


@pytest.mark.parametrize(
    ("mountinfo", "proc_cgroup", "expected"),
    [
        (HYBRID, "4:memory:/x\n0::/\n", Path("/sys/fs/cgroup/unified")),
        (PURE, "0::/system.slice/turnout.service\n", Path("/sys/fs/cgroup/system.slice/turnout.service")),
        (HYBRID.splitlines()[0] + "\n", "0::/\n", None),
        (BIND_OF_SUBTREE, "0::/user.slice/x\n", None),
        (PURE, "4:memory:/x\n", None),
    ],
    ids=["hybrid host", "pure cgroup v2", "no cgroup2 mount", "only a subtree mounted", "no v2 membership"],
)
def test_own_cgroup_directory_is_found_from_mountinfo_and_proc_cgroup(
    mountinfo: str, proc_cgroup: str, expected: Path | None
) -> None:
    assert own_cgroup_dir(mountinfo, proc_cgroup) == expected


def fake_parent(tmp_path: Path, controllers: str) -> Path:
    parent = tmp_path / "cg"
    parent.mkdir()
    (parent / "cgroup.controllers").write_text(controllers + "\n")
    (parent / "cgroup.subtree_control").write_text("")
    return parent


def test_a_task_cgroup_gets_the_limit_files_and_is_removed_after(tmp_path: Path) -> None:
    parent = fake_parent(tmp_path, "cpuset cpu io memory pids")
    cgroup = make_cgroup(Limits(GIB, 2.0, 100), parent, name="t1")
    assert cgroup.path == parent / "t1"
    assert (parent / "t1" / "memory.max").read_text() == str(GIB)
    assert (parent / "t1" / "cpu.max").read_text() == "200000 100000"
    assert (parent / "t1" / "pids.max").read_text() == "100"
    assert cgroup.record()["memory"] == {"bytes": GIB, "via": "cgroup"}
    assert json.loads(cgroup.spec()) == {"cgroup": str(parent / "t1"), "rlimits": {}}
    for f in (parent / "t1").iterdir():  # a real cgroup's files go with it; a stand-in's must go first
        f.unlink()
    cgroup.remove()
    assert not (parent / "t1").exists()


def test_a_hierarchy_without_the_memory_controller_falls_back_to_an_rlimit_and_says_so(
    tmp_path: Path,
) -> None:
    parent = fake_parent(tmp_path, "hugetlb")
    cgroup = make_cgroup(Limits(GIB, 1.0, 100), parent)
    assert cgroup.path is None
    assert cgroup.record() == {"memory": {"bytes": GIB, "via": "rlimit"}, "cgroup": None}
    assert json.loads(cgroup.spec())["rlimits"] == {"RLIMIT_DATA": GIB}


def test_no_writable_hierarchy_means_rlimits_only() -> None:
    cgroup = make_cgroup(Limits(GIB, 1.0, 100), None)
    assert (cgroup.path, cgroup.plan.rlimits) == (None, {"RLIMIT_DATA": GIB})


def test_the_limits_wrapper_sets_the_rlimit_then_runs_the_command() -> None:
    spec = json.dumps({"cgroup": None, "rlimits": {"RLIMIT_DATA": 512 * 2**20}})
    probe = "import resource; print(resource.getrlimit(resource.RLIMIT_DATA)[0])"
    done = subprocess.run([sys.executable, "-m", "turnout.worker.limits", spec, "--", sys.executable, "-c", probe],
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == 512 * 2**20


def test_a_cgroup_that_cannot_be_joined_stops_the_command_before_it_runs(tmp_path: Path) -> None:
    spec = json.dumps({"cgroup": str(tmp_path / "missing"), "rlimits": {}})
    done = subprocess.run([sys.executable, "-m", "turnout.worker.limits", spec, "--", sys.executable, "-c",
                           "print('ran')"], capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == 126
    assert "cannot apply the sandbox's limits" in done.stderr and "ran" not in done.stdout
