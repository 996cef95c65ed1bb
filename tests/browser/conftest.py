"""Headless Debian Chromium driven by Playwright for Python; never Playwright's own browser download.

`make test` installs Debian's `chromium` where this host can (root with apt-get). Where it cannot, these tests
are skipped with the reason; under CI=true on a host that could have installed it, they fail instead, so a
missing install step cannot hide behind a skip.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO

os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
ARTIFACTS = REPO / "test-artifacts"
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}


def _host_could_install() -> bool:
    return os.geteuid() == 0 and shutil.which("apt-get") is not None


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true" and _host_could_install():
        pytest.fail(
            f"{reason}; this CI host could install it (make test does), so this is a failure, not a skip"
        )
    pytest.skip(reason)


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    """A headless Chromium (Debian's /usr/bin/chromium), shared by one module's tests.

    Not by the session: Playwright's sync API keeps an event loop running in the main thread while it is
    open, and later tests that call `asyncio.run` would find it there."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed (pip install -e '.[test]')")
    if not CHROMIUM.exists():
        _unavailable(f"{CHROMIUM} not found (apt-get install chromium; make test does it where it can)")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def artifacts() -> Path:
    """test-artifacts/, where the browser tests save screenshots for a person to look at."""
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS
