"""A child's tie to its worker: when the worker dies, however it dies, the child's process group dies too.

Two guards, because either alone has a gap: the kernel's parent-death signal (prctl PR_SET_PDEATHSIG)
reaches only the direct child, and a thread that notices the worker's pipe closing (EOF) can be
starved by a handler holding the GIL in C code. Both end in SIGKILL to the whole process group, which
takes the handler's own children with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

PR_SET_PDEATHSIG = 1


def kill_own_group() -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os._exit(137)


def set_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to signal us when the worker (our parent) dies; Linux only, a no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)


def arm(parent_pid: int, read_line: Callable[[], Any] | None = None) -> None:
    """Install both guards. Call first thing in a child that leads its own process group."""

    def on_parent_death(_sig: int, _frame: Any) -> None:
        kill_own_group()

    signal.signal(signal.SIGTERM, on_parent_death)
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent_pid:  # the worker died before the guard was armed
        kill_own_group()


def watch_fd(fd: int) -> None:
    """Kill the group when `fd` (the read end of a pipe whose write end only the worker holds) hits EOF."""

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(fd, 1):
                pass
        kill_own_group()

    threading.Thread(target=watch, name="turnout-lifeline", daemon=True).start()
