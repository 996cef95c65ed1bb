"""Memory, CPU and process-count limits for one sandboxed program: cgroup v2 where it can, rlimits where not.

The worker makes a cgroup for the program under its own cgroup on a writable cgroup v2 hierarchy, with the
controllers that hierarchy offers (`memory.max`, `cpu.max`, `pids.max`). A limit whose controller is not
there (a hybrid host keeps memory and pids on v1) falls back: memory to `RLIMIT_DATA` (the private writable
memory a process maps; unlike `RLIMIT_AS` it leaves CUDA's large address-space reservations alone); CPU and
process count have no per-task rlimit that holds for root, so they are recorded as not applied.

The program itself enters its cgroup and takes its rlimits before anything of it runs:

    python -m turnout.worker.limits SPEC_JSON -- COMMAND [ARG ...]

joins `SPEC_JSON["cgroup"]`, sets `SPEC_JSON["rlimits"]`, then execs COMMAND, which inherits both.
What was applied is recorded on the task (`isolation.limits`).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import secrets
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CGROUP_PERIOD_US = 100_000
PIDS_MAX = 4096  # a fork bomb stops here; a program that really needs more threads is rare among ML workers
WANTED = ("memory", "cpu", "pids")


@dataclass(frozen=True)
class Limits:
    """What one program may use: from its preset's resources (0 = no limit asked)."""

    memory_bytes: int = 0
    cpu: float = 0.0
    pids: int = PIDS_MAX


@dataclass(frozen=True)
class LimitPlan:
    """Files to write in the program's cgroup, rlimits to set in it, and the record of both."""

    cgroup_files: dict[str, str] = field(default_factory=dict)
    rlimits: dict[str, int] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)


def plan_limits(limits: Limits, controllers: frozenset[str]) -> LimitPlan:
    """Which mechanism applies each limit, given the cgroup controllers available to the program's cgroup."""
    files: dict[str, str] = {}
    rlimits: dict[str, int] = {}
    record: dict[str, Any] = {}
    if limits.memory_bytes > 0:
        if "memory" in controllers:
            files["memory.max"] = str(limits.memory_bytes)
            files["memory.swap.max"] = "0"
            record["memory"] = {"bytes": limits.memory_bytes, "via": "cgroup"}
        else:
            rlimits["RLIMIT_DATA"] = limits.memory_bytes
            record["memory"] = {"bytes": limits.memory_bytes, "via": "rlimit"}
    if limits.cpu > 0 and "cpu" in controllers:
        quota = max(1000, round(limits.cpu * CGROUP_PERIOD_US))
        files["cpu.max"] = f"{quota} {CGROUP_PERIOD_US}"
        record["cpu"] = {"cores": limits.cpu, "via": "cgroup"}
    if limits.pids > 0 and "pids" in controllers:
        files["pids.max"] = str(limits.pids)
        record["pids"] = {"max": limits.pids, "via": "cgroup"}
    return LimitPlan(files, rlimits, record)


# ---- the host's cgroup v2 hierarchy -----------------------------------------------------------------


def own_cgroup_dir(mountinfo: str, proc_cgroup: str) -> Path | None:
    """This process's cgroup directory on the cgroup v2 hierarchy, from /proc/self/{mountinfo,cgroup}."""
    mount = None
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        if right.split(" ", 1)[0] == "cgroup2":
            fields = left.split()
            if len(fields) >= 5 and fields[3] == "/":  # the hierarchy's root is mounted here
                mount = fields[4]
                break
    path = next((line[3:] for line in proc_cgroup.splitlines() if line.startswith("0::")), None)
    if mount is None or path is None:
        return None
    return Path(mount) / path.lstrip("/")


def cgroup_parent() -> Path | None:
    """Where this worker can make its programs' cgroups: its own cgroup v2 directory, if writable."""
    try:
        parent = own_cgroup_dir(
            Path("/proc/self/mountinfo").read_text(), Path("/proc/self/cgroup").read_text()
        )
    except OSError:
        return None
    return parent if parent is not None and os.access(parent, os.W_OK) else None


def enable_controllers(parent: Path) -> frozenset[str]:
    """The wanted controllers that children of `parent` get, enabling each one that is offered but not on.

    Enabling fails where `parent` holds processes and is not the root (cgroup v2's no-internal-process rule);
    what fails is simply not available, and its limit falls back.
    """
    try:
        offered = set((parent / "cgroup.controllers").read_text().split())
    except OSError:
        return frozenset()
    enabled = set(_read(parent / "cgroup.subtree_control").split())
    for name in WANTED:
        if name in offered and name not in enabled:
            with contextlib.suppress(OSError):
                (parent / "cgroup.subtree_control").write_text(f"+{name}")
                enabled.add(name)
    return frozenset(enabled & set(WANTED))


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@dataclass
class TaskCgroup:
    """A program's own cgroup (or none), and the limits applied to it."""

    path: Path | None
    plan: LimitPlan

    def spec(self) -> str:
        """The argument of `python -m turnout.worker.limits`."""
        return json.dumps({"cgroup": str(self.path) if self.path else None, "rlimits": self.plan.rlimits})

    def record(self) -> dict[str, Any]:
        return {**self.plan.record, "cgroup": str(self.path) if self.path else None}

    def remove(self, timeout_s: float = 5.0) -> None:
        """Kill whatever is left in it and remove it (a cgroup can be removed only once it is empty)."""
        if self.path is None:
            return
        if (
            self.path / "cgroup.kill"
        ).exists():  # Linux >= 5.14; before it, the PID namespace did the killing
            with contextlib.suppress(OSError):
                (self.path / "cgroup.kill").write_text("1")
        deadline = time.monotonic() + timeout_s
        while self.path.exists():
            try:
                self.path.rmdir()
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.02)


def make_cgroup(limits: Limits, parent: Path | None, name: str | None = None) -> TaskCgroup:
    """A cgroup under `parent` with the limits its controllers can hold; rlimits for the rest."""
    if parent is None:
        return TaskCgroup(None, plan_limits(limits, frozenset()))
    controllers = enable_controllers(parent)
    if not controllers:
        return TaskCgroup(None, plan_limits(limits, frozenset()))
    path = parent / (name or f"turnout-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        path.mkdir()
    except OSError:
        return TaskCgroup(None, plan_limits(limits, frozenset()))
    plan = plan_limits(limits, controllers)
    for fname, value in plan.cgroup_files.items():
        try:
            (path / fname).write_text(value)
        except OSError:
            if fname != "memory.swap.max":  # no swap accounting: memory.max still holds
                return _without(limits, controllers, fname, path)
    return TaskCgroup(path, plan)


def _without(limits: Limits, controllers: frozenset[str], failed: str, path: Path) -> TaskCgroup:
    """Plan again without the controller whose file could not be written."""
    left = controllers - {failed.split(".")[0]}
    plan = plan_limits(limits, left)
    for fname, value in plan.cgroup_files.items():
        with contextlib.suppress(OSError):
            (path / fname).write_text(value)
    return TaskCgroup(path, plan)


# ---- inside the program's process, before it execs ---------------------------------------------------


def enter(spec: Mapping[str, Any]) -> None:
    """Join the cgroup and set the rlimits of `spec`; raises OSError when the cgroup cannot be joined."""
    if spec.get("cgroup"):
        Path(spec["cgroup"], "cgroup.procs").write_text(str(os.getpid()))
    for name, value in (spec.get("rlimits") or {}).items():
        resource.setrlimit(getattr(resource, name), (int(value), int(value)))


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m turnout.worker.limits SPEC_JSON -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    try:
        enter(json.loads(argv[0]))
    except (OSError, ValueError) as exc:
        print(f"turnout: cannot apply the sandbox's limits: {exc}", file=sys.stderr)
        return 126
    try:
        os.execv(argv[2], argv[2:])
    except OSError as exc:
        print(f"turnout: cannot run {argv[2]!r}: {exc.strerror or exc}", file=sys.stderr)
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
