"""A real headless Chromium for dashboard tests (selenium + Debian's chromium and
chromium-driver packages)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["headless_chromium"]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)


@contextmanager
def headless_chromium(
    profile_dir: Path, *flags: str, required: bool = False, screenshot: Path | None = None
) -> Iterator[Any]:
    """A selenium driver of headless Chromium with its profile in ``profile_dir`` and
    ``flags`` added (e.g. ``--window-size=1280,1000``); pages load within 20 s.  Without
    chromium and chromedriver the test is skipped, or fails when ``required`` or under
    CI.  ``screenshot``: where the last page is saved when the block ends."""
    import pytest

    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        missing = "chromium / chromedriver not installed: apt-get install -y chromium"
        if required or os.environ.get("CI"):
            pytest.fail(f"{missing} chromium-driver")
        pytest.skip(f"{missing} chromium-driver")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*_FLAGS, f"--user-data-dir={profile_dir}", *flags):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(20)
    try:
        yield driver
    finally:
        try:
            if screenshot is not None:
                driver.save_screenshot(str(screenshot))
        finally:
            driver.quit()
