"""Headless Chromium for the dashboard's tests: Debian's ``chromium`` driven by its ``chromium-driver`` through
selenium (no browser is downloaded at test time; ``make test-browser`` installs both with apt where they are
missing). A test that cannot find them fails, naming what to install."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from tests.conftest import ROOT

ARTIFACTS = Path(os.environ.get("CHORUS_TEST_ARTIFACTS", ROOT / "runs" / "test-artifacts"))


def _find(*names: str) -> str:
    for name in names:
        found = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
        if found:
            return found
    raise AssertionError(f"none of {', '.join(names)} is installed: `make test-browser` installs Debian's chromium "
                         "and chromium-driver (apt, as root)")


def chromium(width: int = 1400, height: int = 1800) -> Any:
    """A headless Chromium whose console messages ``console_errors`` reads."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = _find("chromium", "chromium-browser", "google-chrome")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", "--disable-extensions", "--no-first-run"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(_find("chromedriver", "chromium-driver")), options=opts)


def console_errors(driver: Any) -> list[str]:
    """The browser console's errors since the last call (uncaught exceptions, failed loads, console.error)."""
    return [f"{e.get('level')}: {e.get('message')}" for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def screenshot(driver: Any, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    driver.save_screenshot(str(path))
    return path
