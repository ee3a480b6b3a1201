"""One call of the code under test, as the runner sees it from outside: asked, entered, ended."""

from __future__ import annotations

from typing import final

import attrs

from iop_admission import Lease

from ._layers import Handle, Signal
from ._program import Ask

__all__ = ["BodyFailed", "Call"]


class BodyFailed(Exception):
    """Raised by a call's body on ``Finish(fail=True)``: the exception path of the code under test."""


@final
@attrs.define(eq=False)
class Call:
    """One call of the code under test: ``async with client(ask): <body>``.

    ``number`` is its arrival order (calls start one at a time, each after the
    previous one settled). ``entered`` turns true when the client's
    ``__aenter__`` returned, during step ``entered_step``; ``lease`` is what it
    returned if that is a :class:`~iop_admission.Lease`. ``handle.outcome`` is
    set when the task ended.
    """

    number: int
    ask: Ask
    finish: Signal
    handle: Handle | None = None
    entered: bool = False
    entered_step: int = 0
    lease: Lease | None = None
    fail: bool = False
    cancelled: bool = False  # the runner cancelled it
    error: Exception | None = None

    @property
    def ended(self) -> bool:
        return self.handle is not None and self.handle.outcome is not None

    @property
    def holding(self) -> bool:
        """Entered and not ended: inside the ``async with``."""
        return self.entered and not self.ended

    @property
    def waiting(self) -> bool:
        """Asked and not entered yet (queued, as far as the runner can tell)."""
        return not self.entered and not self.ended

    def __str__(self) -> str:
        a = self.ask
        return f"call #{self.number} ({a.model!r}, long={a.long}, tenant={a.tenant!r})"
