"""The browser tier (``make test-ui``): a real headless Chromium on the live queue page.

Not part of ``make test``: ``testpaths`` is ``tests``, and this directory is run only by
``make test-ui``, which installs the ``ui`` extra (Selenium) and, where ``apt-get`` works,
Debian's ``chromium`` and ``chromium-driver``. Elsewhere install a Chromium and its matching
chromedriver yourself and point ``IOP_CHROMIUM`` / ``IOP_CHROMEDRIVER`` at them.

Each test starts its own mock backend, Edge and Node processes with ``tests/e2e/harness.py``.
Selenium is synchronous: the tests call it in a worker thread so the trio loop (and the
requests it keeps in flight) runs on meanwhile.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from screen import FLAGS, HEIGHT, WIDTH, set_viewport
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # for ``from e2e.harness import ...``

CHROMIUM = os.environ.get("IOP_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("IOP_CHROMEDRIVER", "/usr/bin/chromedriver")


@pytest.fixture(scope="session")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[webdriver.Chrome]:
    """One headless Chromium for the session, with a fresh profile; each test starts at 1920x1080."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (*FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(autouse=True)
def wall_screen(browser: webdriver.Chrome) -> None:
    """Each test starts at the wall screen's size."""
    set_viewport(browser, WIDTH, HEIGHT)
