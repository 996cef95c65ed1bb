"""Ties a user's command to its worker: when the worker dies, even by SIGKILL, the command's whole tree dies.

A Python handler arms the lifeline itself (`runner.py`); a user's program cannot, so the worker starts it
under this guard, which leads the process group, arms the lifeline, and runs the command as its child in
the same group. The guard does not exec the command (that would drop the lifeline thread) and forwards
nothing: stdin, stdout and stderr pass straight to the command, and the guard only waits. It exits with the
command's status (128 + N for a signal), so the worker reports the command's exit code.

    python -m turnout.worker.guard CMD [ARG ...] PARENT_PID LIFELINE_FD
"""

from __future__ import annotations

import os
import subprocess
import sys

from turnout.worker import lifeline

CANNOT_RUN = 127


def guarded_argv(argv: list[str]) -> list[str]:
    """The argv that runs `argv` under the guard; the worker appends PARENT_PID LIFELINE_FD."""
    return [sys.executable, "-m", "turnout.worker.guard", *argv]


def exit_status(returncode: int) -> int:
    """A shell's convention: a command killed by signal N reports 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print("usage: python -m turnout.worker.guard CMD [ARG ...] PARENT_PID LIFELINE_FD", file=sys.stderr)
        return 2
    command, parent_pid, lifeline_fd = argv[:-2], int(argv[-2]), int(argv[-1])
    lifeline.arm(parent_pid)
    lifeline.watch_fd(lifeline_fd)
    try:
        child = subprocess.Popen(command, close_fds=True, restore_signals=True)  # the lifeline fd stays ours
    except OSError as exc:
        print(f"turnout: cannot run {command[0]!r}: {exc.strerror or exc}", file=sys.stderr)
        return CANNOT_RUN
    # The command alone holds the protocol pipes now, so its exit is what the worker sees as EOF.
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)
    return exit_status(child.wait())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
