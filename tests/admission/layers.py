"""The layer harness of the contract tests: one scenario, written once against
:class:`Layer`, runs on either layer of admission, trio (``Admission``) or
asyncio (``AsyncAdmission``), each on virtual time.

The layers, their virtual clocks and ``settle()`` are the installed
:mod:`iop_admission.testing`'s (one copy, the one users get); what only our
own suite may look at -- each layer's private tables -- is here.
"""

from __future__ import annotations

import asyncio
from typing import Any

import trio

from iop_admission import Admission
from iop_admission.testing import AsyncioLayer, Handle, Layer, TrioLayer, VirtualTimeLoop

__all__ = ["AsyncioLayer", "Handle", "Layer", "TrioLayer", "VirtualTimeLoop", "books_closed", "now"]


def books_closed(admission: Any) -> None:
    """Nothing queued or leased, and nothing left in the layer's own tables (a leak would show here)."""
    assert admission.queue_depth == 0
    providers = admission.snapshot().providers
    assert all(p.in_flight == p.revoked_in_flight == 0 and p.status != "removed" for p in providers)
    if isinstance(admission, Admission):
        assert not admission._handoff._parked and not admission._handoff._bodies
    else:
        handoff = admission._handoff
        assert not handoff.futures and not handoff.timers and not handoff.bodies and not handoff.revoking


def now(layer: Layer) -> float:
    """The layer's clock inside its run: ``trio.current_time()`` or the running loop's ``time()``."""
    if layer.name == "trio":
        return trio.current_time()
    return asyncio.get_running_loop().time()
