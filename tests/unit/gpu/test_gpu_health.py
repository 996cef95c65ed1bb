"""Health: which faults quarantine a GPU, and how a canary brings it back (time is a number, not a clock)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from turnout.gpu.devices import GpuMetrics
from turnout.gpu.fake import FakeGpuProvider, write_fake_state
from turnout.gpu.health import (
    FELL_OFF_BUS,
    HealthChange,
    HealthTracker,
    XidKind,
    classify_xid,
    fault_reason,
    run_canary,
)

A, B = "GPU-a", "GPU-b"


def ok(uuid: str, **readings: object) -> GpuMetrics:
    return GpuMetrics(uuid, **readings)  # type: ignore[arg-type]


@pytest.mark.parametrize("code", [48, 63, 64, 74, 79, 92, 94, 95, 119, 120])
def test_hardware_xids_are_device_faults(code: int) -> None:
    assert classify_xid(code) is XidKind.DEVICE
    assert (fault_reason(ok(A, xid_errors=(code,)), 0) or "").startswith(f"xid {code}")


@pytest.mark.parametrize("code", [13, 31, 43, 45])
def test_application_xids_leave_the_device_in_service(code: int) -> None:
    assert classify_xid(code) is XidKind.APPLICATION
    assert fault_reason(ok(A, xid_errors=(code,)), 0) is None


def test_unknown_xids_quarantine_unless_configured_otherwise() -> None:
    assert classify_xid(999) is XidKind.UNKNOWN
    assert fault_reason(ok(A, xid_errors=(999,)), 0) is not None
    assert fault_reason(ok(A, xid_errors=(999,)), 0, unknown_is_fault=False) is None


def test_a_healthy_sample_changes_nothing() -> None:
    tracker = HealthTracker([A, B])
    assert tracker.update([ok(A, ecc_uncorrected=0), ok(B)], 0.0) == []
    assert tracker.quarantined() == {}


def test_a_device_xid_quarantines_once_with_its_reason() -> None:
    tracker = HealthTracker([A, B])
    changes = tracker.update([ok(A, xid_errors=(79,)), ok(B)], 10.0)
    assert changes == [HealthChange(A, False, "xid 79: GPU has fallen off the bus", 10.0)]
    assert tracker.update([ok(A, xid_errors=(48,)), ok(B)], 11.0) == []  # already out; first reason stands
    assert tracker.quarantined() == {A: "xid 79: GPU has fallen off the bus"} and tracker.unhealthy() == {A}


def test_uncorrected_ecc_quarantines_when_it_rises_not_when_it_stays() -> None:
    tracker = HealthTracker([A])
    assert tracker.update([ok(A, ecc_uncorrected=0)], 0.0) == []
    (change,) = tracker.update([ok(A, ecc_uncorrected=2)], 1.0)
    assert not change.healthy and "ECC" in change.reason
    tracker.record_canary(A, True, 40.0)
    assert tracker.update([ok(A, ecc_uncorrected=2)], 41.0) == []  # the old count is history
    assert tracker.update([ok(A, ecc_uncorrected=3)], 42.0)[0].healthy is False


def test_a_provider_reported_fault_quarantines() -> None:
    tracker = HealthTracker([A])
    assert tracker.update([ok(A, health=FELL_OFF_BUS)], 0.0)[0].reason == FELL_OFF_BUS


def test_a_device_missing_from_samples_is_quarantined_after_the_allowed_misses() -> None:
    tracker = HealthTracker([A, B], missed_samples=2)
    assert tracker.update([ok(B)], 0.0) == []
    (change,) = tracker.update([ok(B)], 5.0)
    assert change.uuid == A and "not answering" in change.reason


def test_a_provider_that_stops_answering_quarantines_every_device() -> None:
    tracker = HealthTracker([A, B], missed_samples=1)
    assert {c.uuid for c in tracker.update([], 0.0)} == {A, B}


def test_canary_is_due_after_the_backoff_and_claimed_once() -> None:
    tracker = HealthTracker([A], canary_backoff_s=30, canary_timeout_s=120)
    tracker.update([ok(A, xid_errors=(79,))], 100.0)
    assert tracker.canary_due(129.0) == []
    assert tracker.canary_due(130.0) == [A]
    assert tracker.canary_due(131.0) == []  # claimed: not handed out twice
    assert tracker.canary_due(250.0) == [A]  # the claim lapsed without a result


def test_failed_canaries_back_off_exponentially_up_to_the_cap() -> None:
    tracker = HealthTracker([A], canary_backoff_s=30, canary_backoff_max_s=100)
    tracker.update([ok(A, xid_errors=(79,))], 0.0)
    now = 30.0
    assert tracker.canary_due(now) == [A]
    for wait in (60, 100, 100):
        assert tracker.record_canary(A, False, now) == []
        assert tracker.canary_due(now + wait - 1) == []
        assert tracker.canary_due(now + wait) == [A]
        now += wait
    assert A in tracker.quarantined()


def test_a_passed_canary_readmits_the_device() -> None:
    tracker = HealthTracker([A])
    tracker.update([ok(A, xid_errors=(95,))], 0.0)
    assert tracker.canary_due(30.0) == [A]
    assert tracker.record_canary(A, True, 31.0) == [HealthChange(A, True, "canary passed", 31.0)]
    assert tracker.quarantined() == {} and tracker.record_canary(A, True, 32.0) == []


def test_a_flapping_device_waits_longer_each_time_until_it_stays_healthy() -> None:
    tracker = HealthTracker([A], canary_backoff_s=30, stable_s=600)
    tracker.update([ok(A, xid_errors=(79,))], 0.0)
    tracker.record_canary(A, True, 30.0)
    tracker.update([ok(A, xid_errors=(79,))], 35.0)  # second strike
    assert tracker.canary_due(35.0 + 59) == [] and tracker.canary_due(35.0 + 60) == [A]
    tracker.record_canary(A, True, 100.0)
    tracker.update([ok(A)], 800.0)  # healthy for stable_s: strikes forgotten
    tracker.update([ok(A, xid_errors=(79,))], 801.0)
    assert tracker.canary_due(831.0) == [A]


def test_canary_for_fake_gpus_asks_the_fake_whether_the_fault_cleared() -> None:
    fake = FakeGpuProvider("fake:1x80Gi")
    fake.inject("GPU-fake-0", xid=[79])
    assert run_canary("GPU-fake-0", provider=fake) is False
    fake.clear_faults("GPU-fake-0")
    assert run_canary("GPU-fake-0", provider=fake) is True
    fake.inject("GPU-fake-0", canary_ok=False)
    assert run_canary("GPU-fake-0", provider=fake) is False


def test_canary_command_runs_with_only_that_device_visible() -> None:
    check = [sys.executable, "-c", "import os, sys; sys.exit(os.environ['CUDA_VISIBLE_DEVICES'] != 'GPU-x')"]
    assert run_canary("GPU-x", check) is True
    assert run_canary("GPU-y", check) is False
    assert run_canary("GPU-x", ["/nonexistent/canary"]) is False


def test_whole_cycle_through_a_state_file_as_a_test_drives_a_worker(tmp_path: Path) -> None:
    state = tmp_path / "gpus.json"
    worker_side = FakeGpuProvider("fake:2x24Gi", state_file=state)
    tracker = HealthTracker(d.uuid for d in worker_side.devices())
    assert tracker.update(worker_side.metrics(), 0.0) == []

    write_fake_state(state, "GPU-fake-1", xid=[79], fell_off_bus=True)
    (out,) = tracker.update(worker_side.metrics(), 5.0)
    assert (out.uuid, out.healthy) == ("GPU-fake-1", False)
    (due,) = tracker.canary_due(40.0)
    assert tracker.record_canary(due, run_canary(due, provider=worker_side), 40.0) == []

    write_fake_state(state, "GPU-fake-1", xid=[], fell_off_bus=False)
    (due,) = tracker.canary_due(200.0)
    (back,) = tracker.record_canary(due, run_canary(due, provider=worker_side), 200.0)
    assert back.healthy and tracker.update(worker_side.metrics(), 205.0) == []
