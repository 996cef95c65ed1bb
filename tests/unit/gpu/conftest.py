"""Shared fixtures for GPU tests: where the real NVIDIA tool outputs live."""

from __future__ import annotations

from pathlib import Path

import pytest

# The CI clone keeps shared/ beside the repository: <repo>/../shared/fixtures/nvidia.
NVIDIA_FIXTURES = Path(__file__).resolve().parents[3] / ".." / "shared" / "fixtures" / "nvidia"


def nvidia_samples(kind: str, pattern: str = "*") -> list[Path]:
    """Every sample of one kind (smi-xml, smi-csv, smi-list, proc), so a new file is picked up automatically."""
    return sorted(p for p in (NVIDIA_FIXTURES / kind).glob(pattern) if p.is_file())


@pytest.fixture
def nvidia_fixtures() -> Path:
    if not NVIDIA_FIXTURES.is_dir():
        pytest.skip(f"NVIDIA fixtures not found at {NVIDIA_FIXTURES}")
    return NVIDIA_FIXTURES
