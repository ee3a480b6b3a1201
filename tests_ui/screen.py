"""The browser's screen in the UI tier: the wall screen's size, Chromium's flags on a shared box, and an
exact viewport."""

from __future__ import annotations

from selenium import webdriver

WIDTH, HEIGHT = 1920, 1080
"""The size every test starts at, and the screenshots': the most common wall screen."""

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
)


def set_viewport(driver: webdriver.Chrome, width: int, height: int) -> None:
    """Make the page's viewport exactly ``width`` x ``height`` CSS pixels (device scale 1)."""
    metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
