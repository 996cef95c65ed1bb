"""A GPU canary (up to a minute of work) runs beside the heartbeat, never inside its sample."""

from __future__ import annotations

import threading
import time

from turnout.gpu.devices import GpuMetrics
from turnout.worker.gpuwatch import GpuWatch


class SlowCanaryGpu:
    """One fake GPU: faulty until `recover()`, with a canary that holds until the test releases it."""

    def __init__(self) -> None:
        self.faulty = True
        self.canary_started = threading.Event()
        self.release = threading.Event()
        self.canaries = 0

    def metrics(self) -> list[GpuMetrics]:
        return [GpuMetrics("GPU-a", health="fell off the bus" if self.faulty else "ok")]

    def canary(self, uuid: str) -> bool | None:  # what run_canary asks the provider
        self.canaries += 1
        self.canary_started.set()
        return self.release.wait(10)


def test_a_slow_canary_does_not_hold_up_the_heartbeat_sample_and_its_verdict_lands_later() -> None:
    gpu = SlowCanaryGpu()
    watch = GpuWatch(gpu, ["GPU-a"], canary_backoff_s=0.0)  # type: ignore[arg-type]
    watch.sample()
    assert "GPU-a" in watch.quarantined()
    gpu.faulty = False

    # When the next sample finds the canary due, it returns while the canary still runs
    watch.sample()
    assert gpu.canary_started.wait(5)
    assert not gpu.release.is_set() and "GPU-a" in watch.quarantined()
    watch.sample()  # another heartbeat meanwhile: the running canary is not started twice
    assert gpu.canaries == 1

    # Then the canary's pass re-admits the device for the heartbeats after it
    gpu.release.set()
    deadline = time.monotonic() + 5
    while watch.quarantined() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watch.quarantined() == {}
