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
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # for ``from e2e.harness import ...``

CHROMIUM = os.environ.get("IOP_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("IOP_CHROMEDRIVER", "/usr/bin/chromedriver")


@pytest.fixture(scope="session")
def browser() -> Iterator[webdriver.Chrome]:
    """One headless Chromium for the session (a wall screen's size)."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1600,1000"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()
