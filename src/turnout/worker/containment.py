"""Kernel mechanisms that end a task's processes with no cooperation from them, probed once per worker.

A Python-level guard (a signal handler, a watcher thread) cannot run while a handler holds the GIL in C
code, and a process group does not hold a child that called `setsid`. So each process the worker starts
(a warm runner, a guarded command) gets, where the host allows:

    pdeathsig      PR_SET_PDEATHSIG=SIGKILL, set in the forked child before exec: the kernel kills it the
                   moment the worker's spawning thread (the event loop's, which lives as long as the worker)
                   dies, GIL or not. Linux only.
    cgroup         a cgroup v2 directory of its own, joined before exec, so every descendant is in it,
                   `setsid` or not; `cgroup.kill` ends them all at once on cancel or timeout. On the
                   worker's death a warden process (one per worker, holding no task state) kills the
                   worker's whole cgroup subtree; a worker that starts removes what dead workers of this
                   host left behind. Needs a writable cgroup2 hierarchy with `cgroup.kill` (Linux >= 5.14).
    pid_namespace  `unshare --pid --fork --kill-child --mount-proc`: the runner or guard is PID 1 of a new
                   namespace, and when PID 1 dies the kernel kills everything in it. Needs CAP_SYS_ADMIN.
                   The task then sees namespace pids (`os.getpid()` is 1 in the runner), so `auto` uses it
                   only where no cgroup can be had.

The process group (`process_group`) is always there as before. The setting (`turnout worker --containment`,
env `TURNOUT_CONTAINMENT`) is `auto` (pdeathsig, plus cgroup where it works, else pid_namespace), `none`,
or a comma list of the names above. Each completion carries what was actually applied to its process, and
the task stores it as `isolation`:

    {"process_group": true, "pdeathsig": true, "pid_namespace": false,
     "cgroup": "/sys/fs/cgroup/unified/turnout/d7fbfa13-4242-918273/p3"}      # null where none

Cgroups live under `<cgroup2 mount><this process's cgroup>/turnout/<worker tag>/p<N>`; the worker tag
(`<boot id>-<pid>-<start ticks>`) tells a later worker whether the one that made a directory still lives.
It also labels a worker's Docker containers (`docker.py`).

    python -m turnout.worker.containment warden WORKER_CGROUP_DIR FD    (started by the worker itself)
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnout.errors import InvalidInput

log = logging.getLogger("turnout.worker")
MECHANISMS = ("pdeathsig", "cgroup", "pid_namespace")
PR_SET_PDEATHSIG = 1
UNSHARE_ARGS = ("--pid", "--fork", "--kill-child", "--mount-proc", "--propagation", "slave")
EMPTY_WAIT_S = 5.0  # how long a killed cgroup may take to empty before it is left to the warden or a sweep
Isolation = dict[str, Any]


# ---- what the host allows --------------------------------------------------------------------------


@dataclass(frozen=True)
class HostSupport:
    """What this host lets the worker apply; `why_not` says why each absent mechanism is absent."""

    pdeathsig: bool
    cgroup_base: Path | None  # where this worker makes its cgroups, or None
    pid_namespace: bool
    unshare: str | None = None  # the unshare executable that worked
    why_not: dict[str, str] = field(default_factory=dict)

    def has(self, mechanism: str) -> bool:
        return {"pdeathsig": self.pdeathsig, "cgroup": self.cgroup_base is not None,
                "pid_namespace": self.pid_namespace}[mechanism]  # fmt: skip


NOTHING = HostSupport(pdeathsig=False, cgroup_base=None, pid_namespace=False)


def cgroup2_mount(mountinfo: str) -> Path | None:
    """The first cgroup2 mount point in /proc/self/mountinfo text (`... - cgroup2 SOURCE OPTIONS`)."""
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        if sep and right.split(" ", 1)[0] == "cgroup2":
            fields = left.split()
            if len(fields) >= 5:
                return Path(_unescape(fields[4]))
    return None


def own_cgroup(proc_cgroup: str) -> str | None:
    """This process's cgroup v2 path from /proc/self/cgroup text (the `0::PATH` line)."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return None


def _unescape(path: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        path = path.replace(code, char)
    return path


def probe(unshare: str = "unshare") -> HostSupport:
    """Try each mechanism for real, once: a capability that is only assumed would make `isolation` lie."""
    if not sys.platform.startswith("linux"):
        why = "not Linux"
        return HostSupport(False, None, False, why_not=dict.fromkeys(MECHANISMS, why))
    why: dict[str, str] = {}
    pdeathsig = _prctl_function() is not None
    if not pdeathsig:
        why["pdeathsig"] = "prctl is not callable from this Python"
    base, why_cgroup = _probe_cgroup()
    if why_cgroup:
        why["cgroup"] = why_cgroup
    exe, why_ns = _probe_pid_namespace(unshare)
    if why_ns:
        why["pid_namespace"] = why_ns
    return HostSupport(pdeathsig, base, exe is not None, exe, why)


def _probe_cgroup() -> tuple[Path | None, str]:
    try:
        mount = cgroup2_mount(Path("/proc/self/mountinfo").read_text())
        own = own_cgroup(Path("/proc/self/cgroup").read_text())
    except OSError as exc:
        return None, f"cannot read /proc ({exc.strerror})"
    if mount is None or own is None:
        return None, "no cgroup2 hierarchy is mounted"
    base = mount / own.lstrip("/") / "turnout"
    try:
        base.mkdir(exist_ok=True)
    except OSError as exc:
        return None, f"cannot make {base} ({exc.strerror})"
    if not (base / "cgroup.kill").exists():
        return None, "the kernel has no cgroup.kill (Linux < 5.14)"
    if not os.access(base, os.W_OK):
        return None, f"{base} is not writable"
    return base, ""


def _probe_pid_namespace(unshare: str) -> tuple[str | None, str]:
    exe = shutil.which(unshare)
    if exe is None:
        return None, f"no {unshare} executable"
    try:
        done = subprocess.run([exe, *UNSHARE_ARGS, "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{unshare} did not run ({exc})"
    if done.returncode != 0:
        return None, f"{unshare} refused: {done.stderr.decode(errors='replace').strip()[:200]}"
    return exe, ""


def _prctl_function() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# ---- the setting ---------------------------------------------------------------------------------


def parse_setting(text: str) -> frozenset[str] | None:
    """`auto` -> None (decided by the host), `none` -> nothing, else a comma list of mechanism names."""
    value = text.strip().lower()
    if value == "auto":
        return None
    if value in ("none", ""):
        return frozenset()
    names = frozenset(n.strip() for n in value.split(",") if n.strip())
    unknown = sorted(names - set(MECHANISMS))
    if unknown:
        raise InvalidInput(f"containment: unknown mechanism {unknown[0]!r} (expected auto, none, or a comma "
                           f"list of {', '.join(MECHANISMS)})", field="containment")  # fmt: skip
    return names


def choose(support: HostSupport, wanted: frozenset[str] | None) -> frozenset[str]:
    """The mechanisms to apply: `auto` avoids a PID namespace where a cgroup does the same job unseen."""
    if wanted is None:
        wanted = frozenset(
            {"pdeathsig", "cgroup"} if support.has("cgroup") else {"pdeathsig", "pid_namespace"}
        )
    return frozenset(m for m in wanted if support.has(m))


# ---- the worker's identity -----------------------------------------------------------------------


def _boot_id() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:8]
    return "noboot"


def _start_ticks(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat: with the pid, names one process for the life of the boot."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 else None


def worker_tag(pid: int | None = None) -> str:
    """`<boot id>-<pid>-<start ticks>` of this (or that) process: unique on a host across reboots."""
    pid = os.getpid() if pid is None else pid
    return f"{_boot_id()}-{pid}-{_start_ticks(pid) or 0}"


def owner_alive(tag: str) -> bool | None:
    """Whether the worker that made `tag` still runs; None when `tag` is not a worker tag at all."""
    parts = tag.split("-")
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    boot, pid, ticks = parts
    return boot == _boot_id() and _start_ticks(int(pid)) == ticks


# ---- cgroups -------------------------------------------------------------------------------------


def kill_cgroup(path: Path) -> bool:
    """SIGKILL every process in `path` and below it, `setsid` or not. False where there was nothing to kill."""
    try:
        (path / "cgroup.kill").write_text("1")
        return True
    except OSError:
        return False


def populated(path: Path) -> bool:
    try:
        return "populated 1" in (path / "cgroup.events").read_text()
    except OSError:
        return False


def remove_cgroup(path: Path) -> bool:
    """rmdir `path` and its children, deepest first; True once it is gone. A populated one stays."""
    with contextlib.suppress(OSError):
        for child in sorted((p for p in path.iterdir() if p.is_dir()), key=lambda p: p.name):
            remove_cgroup(child)
    try:
        path.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def destroy_cgroup(path: Path, wait_s: float = EMPTY_WAIT_S) -> bool:
    """Kill everything in `path`, wait (bounded) for it to empty, remove it."""
    kill_cgroup(path)
    deadline = time.monotonic() + wait_s
    while populated(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    return remove_cgroup(path)


def in_cgroup(pid: int, path: Path, base: Path) -> bool:
    """Whether process `pid` is in cgroup `path` (checked after it started: the join cannot fail silently)."""
    try:
        own = own_cgroup(Path(f"/proc/{pid}/cgroup").read_text())
        mount = cgroup2_mount(Path("/proc/self/mountinfo").read_text())
    except OSError:
        return False
    return mount is not None and own is not None and mount / own.lstrip("/") == path


def sweep_stale(base: Path, own_tag: str) -> list[Path]:
    """Kill and remove the cgroups of workers of this host that are gone; returns what was removed."""
    removed = []
    with contextlib.suppress(OSError):
        for path in sorted(base.iterdir()):
            if path.is_dir() and path.name != own_tag and owner_alive(path.name) is False:
                if destroy_cgroup(path, wait_s=2.0):
                    removed.append(path)
                else:
                    log.warning("could not remove the stale cgroup %s of a dead worker", path)
    return removed


# ---- one launch ----------------------------------------------------------------------------------


@dataclass
class Launch:
    """How to start one process: an argv prefix, what the forked child does before exec, its cgroup."""

    prefix: list[str]
    preexec: Callable[[], None] | None
    pdeathsig: bool
    pid_namespace: bool
    cgroup: Path | None
    base: Path | None = None

    def confirm(self, pid: int) -> Isolation:
        """What was applied to the started process `pid`; a cgroup it did not join is removed, not claimed."""
        if self.cgroup is not None and self.base is not None and not in_cgroup(pid, self.cgroup, self.base):
            log.warning("process %d did not join its cgroup %s; running without one", pid, self.cgroup)
            remove_cgroup(self.cgroup)
            self.cgroup = None
        return {"process_group": True, "pdeathsig": self.pdeathsig, "pid_namespace": self.pid_namespace,
                "cgroup": str(self.cgroup) if self.cgroup else None}  # fmt: skip

    def abandon(self) -> None:
        """The process did not start: nothing will use its cgroup."""
        if self.cgroup is not None:
            remove_cgroup(self.cgroup)
            self.cgroup = None


def _child_setup(worker_pid: int, prctl: Any, cgroup_procs: str | None) -> Callable[[], None]:
    """Runs in the forked child before exec: nothing here may take a lock another thread could hold, so it
    is raw syscalls only (the prctl function is resolved in the parent)."""

    def setup() -> None:
        if cgroup_procs is not None:
            with contextlib.suppress(OSError):  # `confirm` checks the result from outside
                fd = os.open(cgroup_procs, os.O_WRONLY)
                try:
                    os.write(fd, b"0")
                finally:
                    os.close(fd)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != worker_pid:  # the worker died before the signal was armed
                os._exit(137)

    return setup


class Containment:
    """What this worker applies to each process it starts. One per worker process (see `current`)."""

    def __init__(self, support: HostSupport, wanted: frozenset[str] | None = None) -> None:
        self.support = support
        self.mechanisms = choose(support, wanted)
        self.tag = worker_tag()
        self.worker_dir: Path | None = None
        self._started = False
        self._counter = itertools.count(1)
        self._warden: subprocess.Popen[bytes] | None = None
        self._warden_w: int | None = None
        self._prctl = _prctl_function() if "pdeathsig" in self.mechanisms else None
        for name in sorted(set(wanted or ()) - self.mechanisms):
            log.warning(
                "containment %s is not available here: %s", name, support.why_not.get(name, "unknown")
            )

    def describe(self) -> str:
        return ", ".join(sorted(self.mechanisms)) or "process groups only"

    def start(self) -> None:
        """Once, as the worker starts: remove dead workers' cgroups, make ours, start the warden."""
        if self._started:
            return
        self._started = True
        base = self.support.cgroup_base
        if "cgroup" not in self.mechanisms or base is None:
            return
        for path in sweep_stale(base, self.tag):
            log.info("removed the cgroup %s left by a worker that died", path)
        worker_dir = base / self.tag
        try:
            worker_dir.mkdir(exist_ok=True)
            self._warden, self._warden_w = start_warden(worker_dir)
        except OSError as exc:
            log.warning("cannot set up cgroups in %s (%s); running without them", worker_dir, exc)
            remove_cgroup(worker_dir)
            self.mechanisms = self.mechanisms - {"cgroup"}
            return
        self.worker_dir = worker_dir

    def launch(self) -> Launch:
        """The wrapping for one new process; makes its cgroup."""
        self.start()
        cgroup: Path | None = None
        if self.worker_dir is not None:
            cgroup = self.worker_dir / f"p{next(self._counter)}"
            try:
                cgroup.mkdir()
            except OSError as exc:
                log.warning("cannot make the cgroup %s (%s)", cgroup, exc.strerror)
                cgroup = None
        ns = "pid_namespace" in self.mechanisms and self.support.unshare is not None
        prefix = [str(self.support.unshare), *UNSHARE_ARGS, "--"] if ns else []
        procs = str(cgroup / "cgroup.procs") if cgroup else None
        preexec = _child_setup(os.getpid(), self._prctl, procs) if (self._prctl or procs) else None
        return Launch(prefix, preexec, self._prctl is not None, ns, cgroup, self.support.cgroup_base)

    def close(self) -> None:
        """Tell the warden the worker is done: it kills what is left in our cgroups and removes them."""
        if self._warden_w is not None:
            with contextlib.suppress(OSError):
                os.close(self._warden_w)
            self._warden_w = None


_current: Containment | None = None


def configure(setting: str = "auto") -> Containment:
    """Probe this host and fix what this worker applies; call once as the worker starts."""
    global _current
    wanted = parse_setting(setting)
    _current = Containment(probe() if wanted != frozenset() else NOTHING, wanted)
    _current.start()
    log.info("task processes are contained by: %s", _current.describe())
    return _current


def current() -> Containment:
    """The worker's containment; `auto` on first use where `configure` was not called (an embedded worker)."""
    return _current or configure("auto")


# ---- the warden ----------------------------------------------------------------------------------


def start_warden(worker_dir: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A process that outlives the worker by a moment: when the pipe whose write end only the worker holds
    reaches EOF (the worker exited, however), it kills and removes `worker_dir`. Its own session, so a
    signal to the worker's process group does not take it too."""
    read_end, write_end = os.pipe()
    try:
        warden = subprocess.Popen(
            [sys.executable, "-m", "turnout.worker.containment", "warden", str(worker_dir), str(read_end)],
            pass_fds=(read_end,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    return warden, write_end


def warden_main(worker_dir: Path, fd: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        while os.read(fd, 4096):
            pass
    return 0 if destroy_cgroup(worker_dir) else 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "warden":
        sys.exit(warden_main(Path(sys.argv[2]), int(sys.argv[3])))
    print("usage: python -m turnout.worker.containment warden WORKER_CGROUP_DIR FD", file=sys.stderr)
    sys.exit(2)
