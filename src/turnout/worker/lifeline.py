"""A child's tie to its worker, armed by the child itself (the runner, the guard) before any user code runs.

Two guards, neither of which needs the GIL. The kernel's parent-death signal (prctl PR_SET_PDEATHSIG) is
SIGKILL, so a handler stuck in C code holding the GIL dies with its parent all the same; but it reaches
only this process, not its children. So a sentinel, a forked copy of this process that holds nothing of
the task's, blocks on a pipe whose write end only the worker holds, and when it reaches EOF (the worker
died, however) kills the whole process group. A thread could not do that job: it needs the GIL to run.

The worker adds what needs no cooperation at all, where the host allows (`containment.py`): pdeathsig set
before exec, a cgroup killed as a whole, a PID namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1


def kill_own_group() -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(0, signal.SIGKILL)  # 0: our own group, also where its leader is outside our PID namespace
    os._exit(137)


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` when our parent dies; Linux only. False where it could not be set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def arm(parent_pid: int) -> None:
    """Die by SIGKILL with our parent. Call first thing in a child that leads its own process group.

    `parent_pid` is the worker's pid, or 0 where the worker started us as PID 1 of a new PID namespace
    (our parent, `unshare`, is outside it and shows as 0; `unshare --kill-child` armed us already).
    """
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the worker died before the signal was armed
        kill_own_group()


def watch_fd(fd: int) -> None:
    """Kill the group when `fd` (the read end of a pipe whose write end only the worker holds) hits EOF.

    Call while this process has one thread: it forks. Where fork fails, a thread does the job as well as
    a thread can.
    """
    try:
        pid = os.fork()
    except OSError:
        threading.Thread(target=_watch, args=(fd,), name="turnout-lifeline", daemon=True).start()
        return
    if pid == 0:
        try:
            _become_sentinel(fd)
            _watch(fd)
        finally:
            kill_own_group()
    os.close(fd)  # the sentinel holds it; EOF must not wait for us


def _become_sentinel(fd: int) -> None:
    """Hold none of the task's pipes (a held stdout would hide the task's exit) and no other descriptor."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for target in (0, 1, 2):
        os.dup2(devnull, target)
    keep = sorted({0, 1, 2, fd})
    for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")], strict=False):
        os.closerange(low + 1, high)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _watch(fd: int) -> None:
    with contextlib.suppress(OSError):
        while os.read(fd, 1):
            pass
    kill_own_group()
