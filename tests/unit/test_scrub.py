"""GPU scrub between tenants: when a scrub is due, and what running one reports (real child processes)."""

from __future__ import annotations

import asyncio
import importlib.util
import shlex
import sys

import pytest

from turnout.gpu.health import HealthTracker
from turnout.worker.scrub import BUILTIN, TenantLedger, run_scrub, scrub_argv


@pytest.mark.parametrize(
    ("last", "uuids", "tenant", "due"),
    [
        ({}, ["G0"], "acme", [("G0", None)]),
        ({"G0": "acme"}, ["G0"], "acme", []),
        ({"G0": "acme"}, ["G0"], "globex", [("G0", "acme")]),
        ({"G0": "acme", "G1": "globex"}, ["G0", "G1"], "globex", [("G0", "acme")]),
        ({"G0": "acme"}, [], "globex", []),
    ],
    ids=["a unit never handed out here: history unknown, scrubbed", "same tenant again: nothing to clear",
         "another tenant: scrubbed", "only the units another tenant held", "a CPU task holds no unit"],
)  # fmt: skip
def test_a_scrub_is_due_on_each_unit_another_or_an_unknown_tenant_held_last(
    last: dict[str, str], uuids: list[str], tenant: str, due: list[tuple[str, str | None]]
) -> None:
    ledger = TenantLedger(dict(last))
    assert ledger.to_scrub(uuids, tenant) == due
    ledger.hand_over(uuids, tenant)
    assert ledger.to_scrub(uuids, tenant) == []


def py(code: str) -> str:
    return shlex.join([sys.executable, "-c", code])


def test_a_scrub_command_runs_on_the_unit_it_scrubs() -> None:
    code = "import os; print('cleared', os.environ['CUDA_VISIBLE_DEVICES'], os.environ['TURNOUT_SCRUB_GPU'])"
    result = asyncio.run(run_scrub(py(code), "GPU-7"))
    assert result.ok and result.message == "cleared GPU-7 GPU-7"


def test_a_failing_scrub_reports_its_exit_code_and_output() -> None:
    result = asyncio.run(run_scrub(py("import sys; print('ECC error on write'); sys.exit(3)"), "GPU-0"))
    assert not result.ok
    assert result.message == "scrub exited with code 3: ECC error on write"


def test_a_scrub_that_hangs_is_killed_and_fails() -> None:
    result = asyncio.run(run_scrub(py("import time; time.sleep(60)"), "GPU-0", timeout_s=0.5))
    assert not result.ok and "longer than 0.5 s" in result.message


def test_a_scrub_command_that_does_not_exist_fails_clearly() -> None:
    result = asyncio.run(run_scrub("/nonexistent/scrubber --all", "GPU-0"))
    assert not result.ok and "'/nonexistent/scrubber' cannot run" in result.message


def test_the_builtin_scrub_on_a_host_without_a_gpu_fails_saying_why() -> None:
    # where torch is missing the step cannot start; where it is there (make test installs the CPU build) it
    # finds no CUDA device: either way the GPU is not reported clean
    result = asyncio.run(run_scrub(BUILTIN, "GPU-0", timeout_s=120))
    assert not result.ok
    if importlib.util.find_spec("torch") is None:
        assert scrub_argv(BUILTIN) == "the builtin scrub needs torch, which is not installed on this worker"
        assert "needs torch" in result.message
    else:
        assert "torch sees no CUDA device" in result.message, result.message


def test_a_device_quarantined_for_a_failed_scrub_stays_out_until_its_canary_passes() -> None:
    tracker = HealthTracker(["G0"], canary_backoff_s=10)
    [change] = tracker.quarantine("G0", "GPU scrub failed: exit 3", now_s=0.0)
    assert (change.healthy, tracker.quarantined()) == (False, {"G0": "GPU scrub failed: exit 3"})
    assert tracker.quarantine("G0", "again", now_s=1.0) == []  # the first reason stands
    assert tracker.canary_due(5.0) == [] and tracker.canary_due(10.0) == ["G0"]
    tracker.record_canary("G0", True, 11.0)
    assert tracker.quarantined() == {}


def test_a_task_whose_gpu_was_quarantined_since_its_lease_never_starts_there() -> None:
    """A task held ahead waits for its share; its GPU may be quarantined meanwhile: it fails `gpu_quarantined`
    (re-queued for another GPU) before any process or scrub touches that GPU."""
    from turnout.worker.handover import HandOver, UnfitGpu

    touched: list[object] = []

    async def close_idle(uuids: set[str]) -> None:
        touched.append(uuids)

    async def record(scrub: dict[str, object]) -> None:
        touched.append(scrub)

    quarantined = {"GPU-1": "Xid 79: fallen off the bus"}
    hand_over = HandOver("true", close_idle=close_idle, record=record,
                         quarantine=lambda uuid, why: None, quarantined=lambda: quarantined)  # fmt: skip
    with pytest.raises(UnfitGpu) as raised:
        asyncio.run(hand_over("t1", {"uuids": ["GPU-0", "GPU-1"]}, "acme"))
    assert raised.value.error["type"] == "gpu_quarantined" and "GPU-1" in raised.value.error["message"]
    assert "Xid 79" in raised.value.error["message"] and touched == []
    asyncio.run(
        hand_over("t2", {"uuids": ["GPU-0"]}, "acme")
    )  # a healthy GPU: it goes on (scrubbed: new tenant)
    assert touched
