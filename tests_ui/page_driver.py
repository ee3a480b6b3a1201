"""Driving the page from trio: Selenium is synchronous, so its calls run in a worker thread and the
trio loop (and the requests it keeps in flight) runs on meanwhile."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio
from selenium import webdriver


async def run(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)`` in a worker thread."""
    return await trio.to_thread.run_sync(call, *args)


async def shows(browser: webdriver.Chrome, holds: Callable[[webdriver.Chrome], bool], within: float) -> None:
    """Wait until the page shows what ``holds`` looks for, at most ``within`` seconds."""
    with trio.fail_after(within):
        while not await run(holds, browser):  # noqa: ASYNC110 -- the DOM has no event to wait on
            await trio.sleep(0.05)


def link(browser: webdriver.Chrome) -> str:
    """The page's connection label: ``connecting``, ``live`` or ``reconnecting``."""
    text: str = browser.execute_script("return document.getElementById('link').textContent")
    return text
