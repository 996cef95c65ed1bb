"""Fixtures for GPU tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from nvidia_paths import NVIDIA_FIXTURES


@pytest.fixture
def nvidia_fixtures() -> Path:
    """The fixture directory; skips (rather than errors) where shared/ is not checked out beside the repo."""
    if not NVIDIA_FIXTURES.is_dir():
        pytest.skip(f"NVIDIA fixtures not found at {NVIDIA_FIXTURES}")
    return NVIDIA_FIXTURES
