"""discover(): the --gpus spec, the auto chain that never raises, and index subsets."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from turnout.errors import InvalidInput
from turnout.gpu.devices import GpuDevice, GpuMetrics
from turnout.gpu.fake import FakeGpuProvider, write_fake_state
from turnout.gpu.provider import GpuProvider, ProviderError, discover


class _Broken:
    name = "broken"

    def __init__(self, error: Exception) -> None:
        self.error = error

    def devices(self) -> list[GpuDevice]:
        raise self.error

    def metrics(self) -> list[GpuMetrics]:
        raise self.error


def _raise(error: Exception) -> GpuProvider:
    raise error


def test_none_gives_the_null_provider() -> None:
    found = discover("none")
    assert found.provider.name == "none" and found.devices == [] and found.provider.metrics() == []


def test_fake_spec_gives_a_fake_provider_with_its_devices() -> None:
    found = discover("fake:2x80Gi")
    assert isinstance(found.provider, FakeGpuProvider)
    assert [d.uuid for d in found.devices] == ["GPU-fake-0", "GPU-fake-1"]


def test_fake_spec_may_name_its_state_file(tmp_path: Path) -> None:
    state = tmp_path / "s.json"
    write_fake_state(state, "GPU-fake-0", utilization_pct=77)
    assert discover(f"fake:1x80Gi@{state}").provider.metrics()[0].utilization_pct == 77
    assert discover("fake:1x80Gi", fake_state_file=state).provider.metrics()[0].utilization_pct == 77


@pytest.mark.parametrize("spec", ["", "  ", "gpu0", "0,,2", "-1", "fake:nonsense", "all"])
def test_bad_spec_is_invalid_input_naming_gpus(spec: str) -> None:
    with pytest.raises(InvalidInput) as err:
        discover(spec, probes=[])
    assert err.value.field == "gpus" and err.value.message


def test_auto_takes_the_first_provider_that_works_and_logs_each_failure_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    probes = [
        ("nvml", lambda: _raise(ProviderError("NVML Shared Library Not Found", absent=True))),
        ("smi", lambda: _Broken(ProviderError("nvidia-smi output truncated"))),
        ("boom", lambda: _raise(RuntimeError("unexpected"))),
        ("fake", lambda: FakeGpuProvider("1x24Gi")),
        ("never", lambda: _raise(AssertionError("must not be reached"))),
    ]
    with caplog.at_level(logging.INFO, logger="turnout.gpu"):
        found = discover("auto", probes=probes)
    assert found.provider.name == "fake" and len(found.devices) == 1
    assert [name for name, _ in found.tried] == ["nvml", "smi", "boom"]
    assert "truncated" in found.tried[1][1]
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.WARNING, logging.WARNING]


def test_auto_with_nothing_working_ends_with_no_gpus() -> None:
    found = discover("auto", probes=[("smi", lambda: _Broken(ProviderError("x")))])
    assert found.provider.name == "none" and found.devices == [] and found.tried == [("smi", "x")]


def test_a_provider_reporting_no_gpus_does_not_win() -> None:
    from turnout.gpu.null import NullProvider

    found = discover("auto", probes=[("nvml", NullProvider), ("fake", lambda: FakeGpuProvider("1x8Gi"))])
    assert found.provider.name == "fake" and found.tried == [("nvml", "no GPUs found")]


def test_indices_keep_only_those_gpus_with_their_physical_indices() -> None:
    fake = FakeGpuProvider("4x16Gi")
    found = discover("0,2", probes=[("fake", lambda: fake)])
    assert [(d.index, d.uuid) for d in found.devices] == [(0, "GPU-fake-0"), (2, "GPU-fake-2")]
    assert [m.uuid for m in found.provider.metrics()] == ["GPU-fake-0", "GPU-fake-2"]
    assert [d.index for d in found.provider.devices()] == [0, 2]
    found.provider.inner.inject("GPU-fake-2", xid=[79])  # type: ignore[attr-defined]  # the fake's API, in reach
    assert found.provider.metrics()[1].xid_errors == (79,)


def test_an_index_that_does_not_exist_is_invalid_input() -> None:
    with pytest.raises(InvalidInput, match="index 3") as err:
        discover("1,3", probes=[("fake", lambda: FakeGpuProvider("2x16Gi"))])
    assert err.value.field == "gpus"
