"""GPU scrub between tenants: before another tenant's task gets a GPU, what the last tenant left is overwritten.

Freed GPU memory is not cleared by the driver on every path, so the next owner of a GPU could read what
the last one left there. The worker remembers which tenant last held each GPU unit (`TenantLedger`); when
a task of another tenant is about to start on it, the worker runs the configured scrub step first:

* `--scrub-command CMD`: CMD runs with `CUDA_VISIBLE_DEVICES` set to the unit (exit 0 = scrubbed);
* `--scrub-command builtin`: a child Python allocates all free memory on the unit with torch and zeroes
  it; where torch is not installed the step fails, saying so.

A worker that just started does not know who used its GPUs last, so each unit's first task is preceded by a
scrub too. Every scrub is audited (`gpu_scrubbed`); a unit whose scrub fails is quarantined with the reason,
and the task that was to run there goes back to the queue to run elsewhere (`gpu_scrub_failed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shlex
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

BUILTIN = "builtin"
SCRUB_TIMEOUT_S = 300.0
UNKNOWN = None  # the ledger's answer for a unit this worker has not handed out yet

TORCH_SCRUB = """\
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("builtin scrub: torch sees no CUDA device")
free, total = torch.cuda.mem_get_info()
margin, chunk, blocks = 64 << 20, 256 << 20, []
try:
    while True:
        free, _ = torch.cuda.mem_get_info()
        if free <= margin:
            break
        blocks.append(torch.zeros(min(chunk, free - margin), dtype=torch.uint8, device="cuda"))
except RuntimeError:  # out of memory: every free byte is taken
    pass
torch.cuda.synchronize()
print(f"builtin scrub: overwrote {sum(b.numel() for b in blocks)} of {total} bytes")
"""


@dataclass
class TenantLedger:
    """Which tenant last held each GPU unit on this worker (pure bookkeeping, no I/O)."""

    last: dict[str, str] = field(default_factory=dict)

    def to_scrub(self, uuids: Iterable[str], tenant: str) -> list[tuple[str, str | None]]:
        """(unit, previous tenant or None when unknown) for each unit that must be scrubbed before `tenant`."""
        return [(u, self.last.get(u, UNKNOWN)) for u in uuids if self.last.get(u) != tenant]

    def hand_over(self, uuids: Iterable[str], tenant: str) -> None:
        for uuid in uuids:
            self.last[uuid] = tenant


@dataclass(frozen=True)
class ScrubResult:
    ok: bool
    message: str
    seconds: float


def scrub_argv(setting: str) -> list[str] | str:
    """The command for a `--scrub-command` setting, or why it cannot run on this worker."""
    if setting == BUILTIN:
        if importlib.util.find_spec("torch") is None:
            return "the builtin scrub needs torch, which is not installed on this worker"
        return [sys.executable, "-c", TORCH_SCRUB]
    return shlex.split(setting)


async def run_scrub(
    setting: str, uuid: str, env: Mapping[str, str] | None = None, timeout_s: float = SCRUB_TIMEOUT_S
) -> ScrubResult:
    """Run the scrub step on one unit; never raises: a step that cannot run is a failed scrub."""
    started = time.monotonic()
    argv = scrub_argv(setting)
    if isinstance(argv, str):
        return ScrubResult(False, argv, 0.0)
    child_env = {**(env if env is not None else os.environ), "CUDA_VISIBLE_DEVICES": uuid,
                 "NVIDIA_VISIBLE_DEVICES": uuid, "TURNOUT_SCRUB_GPU": uuid}  # fmt: skip
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                    env=child_env, start_new_session=True)  # fmt: skip
    except OSError as exc:
        return ScrubResult(False, f"scrub command {argv[0]!r} cannot run: {exc.strerror or exc}", 0.0)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        await proc.wait()
        return ScrubResult(
            False, f"scrub ran longer than {timeout_s:g} s and was killed", time.monotonic() - started
        )
    text = out.decode(errors="replace").strip()[-500:]
    seconds = time.monotonic() - started
    if proc.returncode != 0:
        return ScrubResult(
            False, f"scrub exited with code {proc.returncode}" + (f": {text}" if text else ""), seconds
        )
    return ScrubResult(True, text or "scrubbed", seconds)
