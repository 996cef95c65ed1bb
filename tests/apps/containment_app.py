"""Handlers that try to outlive their worker: children that call `setsid`, and a C call that holds the GIL.

Every process they start carries the task's `marker` in its argv, so a test can find (and, in teardown,
kill) each one from outside, whatever PID namespace it runs in.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from turnout import Context, WorkerApplication

app = WorkerApplication("containment-tests")

# `sleep` (the marker sits in argv[1]); with "setsid" it leaves the process group, with "daemon" it also
# forks and lets its parent exit, so it is reparented out of the handler's tree altogether
ESCAPEE = """
import os, sys, time
mode = sys.argv[2]
if mode in ("setsid", "daemon"):
    os.setsid()
if mode == "daemon" and os.fork():
    os._exit(0)
time.sleep(600)
"""


def start_escapees(marker: str) -> None:
    """A child in the group, a child that left it, and a daemon that left the handler's tree too."""
    for mode in ("plain", "setsid", "daemon"):
        subprocess.Popen([sys.executable, "-c", ESCAPEE, marker, mode], stdin=subprocess.DEVNULL)


@app.capability("hold_gil", cpu=0.1)
def hold_gil(ctx: Context, data: dict[str, Any]) -> dict[str, Any]:
    """Starts the escapees, says so in `ready`, then blocks in C while holding the GIL, like a long
    computation in an extension that never returns to the interpreter: no Python-level guard of this
    process (a signal handler, a thread) can run from here on. Catchable signals are blocked in this
    thread so that none of them cuts the C call short (a real C loop would not notice them either)."""
    start_escapees(data["marker"])
    Path(data["ready"]).write_text("ready")
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
    libc = ctypes.PyDLL(None)  # PyDLL: the call keeps the GIL, unlike CDLL
    libc.sleep(600)
    return {}


@app.capability("quick", cpu=0.1)
def quick(ctx: Context, data: Any) -> dict[str, Any]:
    return {"ok": True}
