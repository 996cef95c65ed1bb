"""CPU cost of a worker's GPU sampling: 8 GPUs read every second, plus the health tracker's update.

Two providers: 8 fake GPUs driven through a state file (what `--gpus fake:8x80Gi` costs), and NVML over
8 GPUs through the test stand-in built from a real 8 x V100 `nvidia-smi` capture (the provider's own
Python overhead; a real libnvidia-ml adds its driver calls). The figure is process CPU time over wall time,
as a percentage of one core; the target is under 2 %.

    python bench/bench_gpu_sampling.py [seconds]     prints JSON
    from bench.bench_gpu_sampling import run          run(seconds=10) -> dict
"""

from __future__ import annotations

import importlib
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from turnout.gpu.fake import FakeGpuProvider, write_fake_state
from turnout.gpu.health import HealthTracker
from turnout.gpu.provider import GpuProvider

TARGET_PCT = 2.0
INTERVAL_S = 1.0
_REPO = Path(__file__).resolve().parents[1]
_V100_CAPTURE = (
    _REPO / ".." / "shared" / "fixtures" / "nvidia" / "smi-xml" / "8x-tesla-v100s-pcie-32gb-460.73.01.xml"
)


def _measure(provider: GpuProvider, seconds: float, interval_s: float) -> dict[str, Any]:
    """Sample every `interval_s` for `seconds` of wall time; CPU is counted over the whole period."""
    tracker = HealthTracker(d.uuid for d in provider.devices())
    samples, busy_cpu_s = 0, 0.0
    wall0, cpu0 = time.perf_counter(), time.process_time()
    next_at = wall0
    while True:
        now = time.perf_counter()
        if now - wall0 >= seconds:
            break
        if now < next_at:
            time.sleep(min(next_at - now, seconds - (now - wall0)))
            continue
        before = time.process_time()
        tracker.update(provider.metrics(), now)
        busy_cpu_s += time.process_time() - before
        samples += 1
        next_at += interval_s
    wall_s, cpu_s = time.perf_counter() - wall0, time.process_time() - cpu0
    return {
        "gpus": len(provider.devices()),
        "samples": samples,
        "wall_s": round(wall_s, 3),
        "cpu_s": round(cpu_s, 6),
        "cpu_pct_of_core": round(100.0 * cpu_s / wall_s, 4),
        "per_sample_ms": round(1000.0 * busy_cpu_s / max(samples, 1), 4),
    }


def _fake(state_dir: Path) -> GpuProvider:
    state = state_dir / "gpus.json"
    provider = FakeGpuProvider("fake:8x80Gi", state_file=state)
    for i in range(8):  # a busy host: a process on each GPU
        write_fake_state(state, f"GPU-fake-{i}", processes=[{"pid": 1000 + i, "used_memory_bytes": 2**33}],
                         utilization_pct=60)  # fmt: skip
    return provider


def _nvml_standin() -> GpuProvider | None:
    """The NVML provider over the stand-in from tests/unit/gpu (None where the capture is not checked out)."""
    if not _V100_CAPTURE.exists():
        return None
    sys.path.insert(0, str(_REPO / "tests" / "unit" / "gpu"))
    try:
        standin = importlib.import_module("nvml_standin")
    finally:
        sys.path.pop(0)
    from turnout.gpu.nvml import NvmlProvider

    return NvmlProvider(standin.standin_from_xml(_V100_CAPTURE))


def run(seconds: float = 10, interval_s: float = INTERVAL_S) -> dict[str, Any]:
    """Measure each provider for `seconds`; returns the numbers and whether both meet the target."""
    results: dict[str, Any] = {"interval_s": interval_s, "target_pct_of_core": TARGET_PCT}
    with tempfile.TemporaryDirectory() as tmp:
        builders: dict[str, Callable[[], GpuProvider | None]] = {
            "fake_8_gpus": lambda: _fake(Path(tmp)),
            "nvml_standin_8_gpus": _nvml_standin,
        }
        for name, build in builders.items():
            provider = build()
            results[name] = _measure(provider, seconds, interval_s) if provider else {"skipped": "no capture"}
    measured = [
        r["cpu_pct_of_core"] for r in results.values() if isinstance(r, dict) and "cpu_pct_of_core" in r
    ]
    results["ok"] = all(pct < TARGET_PCT for pct in measured)
    return results


if __name__ == "__main__":
    print(json.dumps(run(float(sys.argv[1]) if len(sys.argv) > 1 else 10), indent=2))
