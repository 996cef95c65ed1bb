"""Ties a user's command to its worker: when the worker dies, even by SIGKILL, the command's whole tree dies.

A Python handler arms the lifeline itself (`runner.py`); a user's program cannot, so the worker starts it
under this guard, which leads the process group, arms the lifeline (`lifeline.py`: parent-death SIGKILL and
a sentinel that kills the group), and runs the command as its child in the same group, with its own
parent-death SIGKILL, so the command dies with the guard however the guard dies. The guard does not exec
the command (the command would then be a process the worker cannot tie to itself) and forwards nothing:
stdin, stdout and stderr pass straight to the command, and the guard only waits. It exits with the
command's status (128 + N for a signal), so the worker reports the command's exit code.

Where the worker starts it as PID 1 of a PID namespace, the guard is that namespace's init: it reaps every
orphan that lands on it, and its exit takes the whole namespace with it.

    python -m turnout.worker.guard CMD [ARG ...] PARENT_PID LIFELINE_FD
"""

from __future__ import annotations

import os
import signal
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


def _die_with_guard() -> None:
    """In the command's process before exec (the guard has one thread: the sentinel is a process)."""
    lifeline.set_parent_death_signal(signal.SIGKILL)


def wait_reaping(child: subprocess.Popen[bytes]) -> int:
    """Wait for `child`, reaping any other process that exits meanwhile (an init's duty); its returncode."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:  # reaped elsewhere: cannot happen, but never hang on it
            return child.wait()
        if pid == child.pid:
            child.returncode = os.waitstatus_to_exitcode(status)
            return child.returncode


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print("usage: python -m turnout.worker.guard CMD [ARG ...] PARENT_PID LIFELINE_FD", file=sys.stderr)
        return 2
    command, parent_pid, lifeline_fd = argv[:-2], int(argv[-2]), int(argv[-1])
    lifeline.arm(parent_pid)
    lifeline.watch_fd(lifeline_fd)  # forks the sentinel, which alone holds the lifeline from here on
    try:
        child = subprocess.Popen(command, close_fds=True, restore_signals=True, preexec_fn=_die_with_guard)
    except OSError as exc:
        print(f"turnout: cannot run {command[0]!r}: {exc.strerror or exc}", file=sys.stderr)
        return CANNOT_RUN
    # The command alone holds the protocol pipes now, so its exit is what the worker sees as EOF.
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)
    return exit_status(wait_reaping(child))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
