"""A command worker's program in its sandbox: one working directory, one cgroup, one record per process.

A one-off preset starts a process per task, so each task gets its own working directory (removed when the
process is gone); a session's process keeps one for the tasks it serves. The chain that runs is

    guard (lifeline) -> limits (joins the cgroup, sets rlimits, execs) -> bwrap -> the program

so the program dies with the worker (the guard), cannot outgrow its limits (inherited), and sees only
what `sandbox.bwrap_argv` gives it. The guard starts under the worker's containment (`containment.py`)
like any command's; where the sandbox makes a limits cgroup, the program moves there from containment's
(`isolation.limits.cgroup`; both are killed when the process is). The process's `isolation` is
containment's record with the sandbox's keys over it (`pid_namespace` is then bubblewrap's: always true).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnout.worker.containment import destroy_cgroup, owner_alive, worker_tag
from turnout.worker.guard import guarded_argv
from turnout.worker.limits import Limits, TaskCgroup, cgroup_parent, make_cgroup
from turnout.worker.processes import ProtocolProcess
from turnout.worker.sandbox import (
    MASKED_FILES,
    PRIVATE_SCAN,
    Bwrap,
    Isolation,
    SandboxPlan,
    bwrap_argv,
    command_binds,
    device_binds,
    existing,
    private_paths,
    system_binds,
)

log = logging.getLogger("turnout.worker")
LIMITS_PREFIX = "turnout-limits-"  # a sandboxed program's limits cgroup, under the worker's own cgroup


def default_workroot() -> Path:
    return Path(tempfile.gettempdir()) / f"turnout-sandbox-{os.getuid()}"


@dataclass(frozen=True)
class SandboxOptions:
    """The worker's sandbox settings (`turnout worker --isolation ... --sandbox-dev-dir ...`)."""

    default: Isolation = Isolation.NONE  # for presets that do not say
    dev_dir: Path = Path("/dev")  # where the GPUs' device nodes are (tests point it at stand-in nodes)
    workroot: Path = field(default_factory=default_workroot)
    gpu_minors: Mapping[int, int] = field(default_factory=dict)  # GPU index -> device minor, from discovery


@dataclass(frozen=True)
class SandboxHost:
    """What this host offers a sandbox, found once per worker."""

    bwrap: Bwrap
    options: SandboxOptions
    cgroup_parent: Path | None
    ro_binds: tuple[str, ...]
    symlinks: tuple[tuple[str, str], ...]
    masks: tuple[str, ...] = ()  # files only the worker's user may read (sandbox.private_paths), and
    masked_dirs: tuple[str, ...] = ()  # directories only it may enter: none of them is a tenant's to see


def sandbox_host(options: SandboxOptions, bwrap: Bwrap) -> SandboxHost | str:
    """The host's sandbox facts, or why sandboxes cannot start here (their tasks then fail, saying so)."""
    root = options.workroot
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = root.lstat()
    except OSError as exc:
        return f"cannot make the sandboxes' directory {root}: {exc.strerror or exc}"
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        # in a shared /tmp another user could have made it first, to read or swap tasks' files
        return f"the sandboxes' directory {root} must be a directory of this user with mode 0700"
    sweep(root)
    parent = cgroup_parent()
    if parent is not None:
        sweep_limits(parent)
    binds, links = system_binds()
    files, dirs = private_paths(r for r in PRIVATE_SCAN if r in binds)  # not through a link: it is one inside
    return SandboxHost(bwrap, options, parent, binds, links, tuple(sorted({*MASKED_FILES, *files})), dirs)


def limits_cgroup_name() -> str:
    """A sandboxed program's limits cgroup, named by this worker's tag (`sweep_limits`) and a random part."""
    return f"{LIMITS_PREFIX}{worker_tag()}-{secrets.token_hex(4)}"


def sweep_limits(parent: Path) -> list[Path]:
    """Kill and remove the limits cgroups under `parent` of sandboxed programs whose worker is gone.

    They lie outside containment's `turnout/<tag>` subtree (a program joins its limits cgroup, leaving
    containment's), so the warden of a SIGKILLed worker neither kills nor removes them, and containment's
    own sweep does not see them. Judged by the worker tag in the name, as containment's are."""
    removed = []
    with contextlib.suppress(OSError):
        for path in sorted(parent.iterdir()):
            if not path.name.startswith(LIMITS_PREFIX) or not path.is_dir():
                continue
            tag = path.name[len(LIMITS_PREFIX) :].rpartition("-")[0]
            if owner_alive(tag) is False:
                if destroy_cgroup(path, wait_s=2.0):
                    removed.append(path)
                else:
                    log.warning("could not remove the limits cgroup %s of a dead worker", path)
    return removed


def task_file_binds(env: Mapping[str, str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(input files to bind read-only, the output directory to bind writable) of a task started with its files
    (TURNOUT_INPUT_FILES, TURNOUT_OUTPUT_DIR, worker/files.py): the sandbox shows it these and nothing else of
    the worker's scratch. A session process is started before its tasks: it gets none."""
    try:
        inputs = json.loads(env.get("TURNOUT_INPUT_FILES") or "{}")
    except ValueError:
        inputs = {}
    paths = tuple(sorted({str(p) for p in inputs.values() if isinstance(p, str) and os.path.isabs(p)}))
    out = env.get("TURNOUT_OUTPUT_DIR")
    return existing(paths), existing([out] if out and os.path.isabs(out) else [])


def sweep(workroot: Path) -> None:
    """Remove working directories left by workers that died (named `<worker pid>-...`)."""
    for entry in workroot.iterdir():
        pid = entry.name.split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(entry, ignore_errors=True)


class SandboxedProcess(ProtocolProcess):
    """A `ProtocolProcess` whose program runs in bubblewrap, with its own directory, cgroup and record."""

    def __init__(self, host: SandboxHost, command: Sequence[str], env: dict[str, str], *, gpu_indices: Sequence[int],
                 network: bool, limits: Limits, read_only: Sequence[str] = (), **options: Any) -> None:  # fmt: skip
        super().__init__([], env, **options)
        self.host = host
        self.command = list(command)
        self.gpu_indices = list(gpu_indices)
        self.network = network
        self.limits = limits
        self.read_only = list(read_only)
        self.workdir: Path | None = None
        self.cgroup: TaskCgroup | None = None
        self._cleaned = False

    async def start(self) -> None:
        opts = self.host.options
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=opts.workroot))
        try:
            self.cgroup = make_cgroup(self.limits, self.host.cgroup_parent, limits_cgroup_name())
            command, needed = command_binds(self.command, self.env, os.getcwd())
            minors = [opts.gpu_minors[i] for i in self.gpu_indices if i in opts.gpu_minors]
            devices = device_binds(opts.dev_dir, minors)
            links = self.host.symlinks
            inputs, outputs = task_file_binds(self.env)
            ro = [p for p in (*needed, *existing(self.read_only), *inputs)
                  if not any(p == link or p.startswith(link + "/") for _, link in links)]  # fmt: skip
            plan = SandboxPlan(
                bwrap=self.host.bwrap.path, command=command, workdir=str(self.workdir),
                workroot=str(opts.workroot), devices=devices, ro_binds=_outermost_first(self.host.ro_binds, ro),
                symlinks=links, masks=existing(self.host.masks), masked_dirs=existing(self.host.masked_dirs),
                rw_binds=outputs, tmpfs_bytes=self.limits.memory_bytes if self.host.bwrap.sizes_tmpfs else 0,
                network=self.network,
                drop_caps=os.geteuid() == 0,
            )  # fmt: skip
            self.argv = guarded_argv([sys.executable, "-m", "turnout.worker.limits", self.cgroup.spec(), "--",
                                      *bwrap_argv(plan)])  # fmt: skip
            self.env = {**self.env, "HOME": str(self.workdir), "TMPDIR": "/tmp"}
            self.isolation = {
                "mode": Isolation.SANDBOX.value, "sandbox": self.host.bwrap.version,
                "devices": [inside for _, inside in devices], "gpu_minors": minors,
                "network": self.network, "pid_namespace": True,
                "writable": [str(self.workdir), *outputs, "/tmp (private)"],
                "tmpfs_bytes": plan.tmpfs_bytes or None,  # /tmp's and /dev/shm's size; None: the kernel's default
                "limits": self.cgroup.record(),
            }  # fmt: skip
            await super().start()
        except BaseException:
            self._cleanup()
            raise

    def kill(self) -> None:
        super().kill()
        if self.proc is None or self.proc.returncode is not None:
            # the guard is gone, and with it the sandbox's PID namespace: nothing writes here any more
            try:
                asyncio.get_running_loop().run_in_executor(None, self._cleanup)
            except RuntimeError:  # no loop: called at interpreter exit
                self._cleanup()

    async def close(self) -> None:
        await super().close()
        await asyncio.get_running_loop().run_in_executor(None, self._cleanup)

    def _cleanup(self) -> None:
        if self._cleaned:
            return
        self._cleaned = True
        if self.cgroup is not None:
            self.cgroup.remove()
        if self.workdir is not None:
            for _ in range(50):  # a process killed a moment ago may still be writing its last file
                shutil.rmtree(self.workdir, ignore_errors=True)
                if not self.workdir.exists():
                    break
                time.sleep(0.02)


def _outermost_first(system: Sequence[str], extra: Sequence[str]) -> tuple[str, ...]:
    """System binds, then extra paths not already inside one of them (nor inside each other)."""
    out = list(system)
    for p in extra:
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            out.append(p)
    return tuple(out)
