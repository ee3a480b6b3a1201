"""The current virtual time of a layer's run: trio's clock or the asyncio loop's, whichever runs."""

from __future__ import annotations

import asyncio

import trio
from tests.admission.layers import Layer


def now(layer: Layer) -> float:
    """The time inside ``layer``'s run (its virtual clock: both start at 0)."""
    if layer.name == "trio":
        return trio.current_time()
    return asyncio.get_running_loop().time()
