"""The layer harness of the contract tests: one scenario, written once against
:class:`Layer`, runs on either layer of admission, trio (``Admission``) or
asyncio (``AsyncAdmission``), each on virtual time.

The layers, their virtual clocks and ``settle()`` are the installed
:mod:`iop_admission.testing`'s (one copy, the one users get); what only our
own suite may look at -- each layer's private tables -- is here.
"""

from __future__ import annotations

from typing import Any

from iop_admission import Admission
from iop_admission.testing import AsyncioLayer, Handle, Layer, TrioLayer, VirtualTimeLoop

__all__ = ["AsyncioLayer", "Handle", "Layer", "TrioLayer", "VirtualTimeLoop", "books_closed"]


def books_closed(admission: Any) -> None:
    """Nothing queued or leased, and nothing left in the layer's own tables (a leak would show here)."""
    assert admission.queue_depth == 0
    assert all(p.in_flight == 0 for p in admission.snapshot().providers)
    if isinstance(admission, Admission):
        assert not admission._handoff._parked and not admission._handoff._bodies
    else:
        assert not admission._futures and not admission._timers and not admission._bodies
        assert not admission._revoking
