"""`turnout demo` end to end: the real model behind the classify pipeline, as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_demo_classifies_every_sample_text_as_it_reads_and_shows_the_saving() -> None:
    done = subprocess.run([sys.executable, "-m", "turnout.cli", "demo"], capture_output=True, text=True, timeout=110,
                          stdin=subprocess.DEVNULL, cwd=str(REPO), env={"PATH": "/usr/bin:/bin", "COLUMNS": "200"})  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "12 of 12 texts classified as they read" in out  # positive texts score positive, negative negative
    assert "positive (+" in out and "negative (-" in out
    assert "classify_text" in out and "gpu available" in out  # the GPU stage went to the (fake) GPU worker
    assert "% saved" in out
    assert "Traceback" not in done.stderr
