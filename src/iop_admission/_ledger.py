"""One provider's context-token budget: what running requests reserved, and headroom for a starved one.

Sans-I/O and independent of the rest of the core, like :class:`FairShare`: the
core asks :meth:`TokenLedger.fits` before a grant, :meth:`TokenLedger.reserve`
at the grant and :meth:`TokenLedger.release` when the lease's body has left
([token-ledger]). The rule:

* a request reserves ``prompt_tokens + max_output_tokens``, bounded by the
  model's context window (:func:`reservation`): the engine never holds more
  than one window's worth of KV cache for one sequence;
* the provider admits while the sum of reservations fits its budget: after
  every grant, ``reserved <= budget``;
* a reservation is returned exactly once (a second release returns 0);
* :meth:`TokenLedger.settle` replaces a reservation with the usage the backend
  reported (never negative; it may be above the reservation when the prompt
  was underestimated: the ledger then holds the truth, and admits nothing
  until it fits again); :meth:`TokenLedger.lower` only ever lowers one (the
  stream ended: its KV cache is freed before the body has left);
* **no starvation.** A waiter that does not fit while a later request is
  granted tokens here is *passed over* by those tokens; once the tokens that
  passed it reach ``patience`` times its own reservation (by default once, no
  tuned threshold: a big request lets at most its own size go past it; 0: at
  the first pass) it is *pinned*: its tokens are held as headroom, so every
  later grant must fit beside it (``reserved + tokens + headroom <= budget``). Reservations only go
  down from then on except by the pinned request's own grant (or a settle
  above an estimate), so it fits, at the latest, once every lease that held
  tokens here when it was pinned is released. One waiter is pinned at a time;
  when it leaves, the earliest waiter passed by its due is pinned next.
* **the engine's view.** The budget the ledger admits by (:attr:`TokenLedger.budget`) is the
  configured one (:attr:`TokenLedger.configured`) less a *cut* the engine's own reports set
  (:func:`engine_cut`): never above the config's, never below what is reserved when the cut
  is set, and back to the config's once the engine reports no pressure.
"""

from __future__ import annotations

import math
from typing import ClassVar, final


def engine_cut(configured: int, reserved: int, kv_use: float | None, preempted: bool) -> int:
    """Tokens taken off a budget of ``configured`` tokens by the engine's own report (docs/admission.md,
    The engine's view).

    The report's ``kv_use`` (0 to 1 of the engine's KV cache) read in the budget's units is
    ``ceil(kv_use * configured)`` tokens held; the reservations explain ``reserved`` of them. Held
    beyond that (a client that does not come through the ledger, a budget set above the engine's
    cache, a prompt counted short) is not the ledger's to give: it is cut, so the room a grant may
    take is at most the room the engine reports free. A ``preempted`` report (the engine's count
    rose since the last one) says the engine could not hold what ran: the cut leaves no room
    above ``reserved`` until a report without a new preemption.

    Returns:
        The cut, in ``[0, max(0, configured - reserved)]``: the budget it leaves is never above
        ``configured`` and never below ``min(configured, reserved)``.
    """
    room = max(0, configured - reserved)
    cut = 0 if kv_use is None else min(room, max(0, math.ceil(kv_use * configured) - reserved))
    return room if preempted else cut


def reservation(prompt_tokens: int, max_output_tokens: int, window: int) -> int:
    """Tokens one request reserves: prompt and output, bounded by the context ``window`` (0: unbounded).

    Raises:
        ValueError: a figure is negative.
    """
    if prompt_tokens < 0 or max_output_tokens < 0:
        raise ValueError(f"token figures must be >= 0, got {prompt_tokens} and {max_output_tokens}")
    total = prompt_tokens + max_output_tokens
    return min(total, window) if window > 0 else total


@final
class TokenLedger:
    """The reservations of one provider's running requests against its context-token budget.

    Leases and waiters are named by ints (lease ids, arrival numbers) the
    caller keeps unique.

    Attributes:
        budget: the tokens it admits by: :attr:`configured` less :attr:`cut`.
        configured: the tokens the provider's engine holds for all sequences at once (the config's).
        cut: tokens the engine's own report took off :attr:`configured` (:func:`engine_cut`; 0: none).
        reserved: the sum of the reservations of the leases not released yet.
        pinned: the arrival number of the waiter whose tokens are held as headroom, or None.
        headroom: the tokens held for it (0 when none is pinned).
        patience: tokens granted past a waiter, in units of its own reservation, before it is pinned.
    """

    __slots__ = (
        "budget",
        "configured",
        "cut",
        "window",
        "reserved",
        "pinned",
        "headroom",
        "patience",
        "_held",
        "_passed",
    )

    PATIENCE: ClassVar[int] = 1
    """The default patience: tokens a waiter may see granted past it on one provider, in units of
    its own reservation, before its tokens are held as headroom."""

    def __init__(self, budget: int, patience: int | None = None) -> None:
        patience = self.PATIENCE if patience is None else patience
        if budget < 0 or patience < 0:
            raise ValueError(f"budget and patience must be >= 0, got {budget} and {patience}")
        self.budget = self.configured = budget
        self.cut = 0
        self.window = 0  # the context window that bounds one request's reservation (0: unbounded)
        self.patience = patience
        self.reserved = 0
        self.pinned: int | None = None
        self.headroom = 0
        self._held: dict[int, int] = {}  # lease id -> tokens it reserves now
        self._passed: dict[int, list[int]] = {}  # waiter -> [tokens granted past it, its tokens]

    # ------------------------------------------------------------------ asking

    @property
    def free(self) -> int:
        """Tokens not reserved (0 when a settle left the ledger over its budget)."""
        return max(0, self.budget - self.reserved)

    def could_fit(self, tokens: int) -> bool:
        """Whether a request of ``tokens`` could ever run here (with nothing else running, the
        engine reporting no pressure: by :attr:`configured`)."""
        return tokens <= self.configured

    def fits(self, tokens: int, waiter: int | None = None) -> bool:
        """Whether ``tokens`` fit now, beside the headroom held for a pinned waiter other than ``waiter``."""
        held = 0 if waiter is not None and waiter == self.pinned else self.headroom
        return self.reserved + tokens + held <= self.budget

    def need(self, tokens: int | None, long: bool) -> int:
        """Tokens a request reserves: its figure bounded by :attr:`window` (0: unbounded); without a
        figure, a long request reserves the window (a long slot's worth), another none.

        Raises:
            ValueError: ``tokens`` is negative.
        """
        window = self.window
        if tokens is None:
            return window if long else 0
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        return min(tokens, window) if window else tokens

    def fits_request(self, tokens: int | None, long: bool, waiter: int | None = None) -> bool:
        """:meth:`fits` for a request's figure (:meth:`need`), inline: asked at every choice."""
        window = self.window
        if tokens is None or tokens < 0:
            need = self.need(tokens, long)
        else:
            need = tokens if not window or tokens < window else window
        held = 0 if waiter is not None and waiter == self.pinned else self.headroom
        return self.reserved + need + held <= self.budget

    def holding(self, lease: int) -> int:
        """Tokens ``lease`` reserves now (0 once released, or if it never reserved here)."""
        return self._held.get(lease, 0)

    @property
    def leases(self) -> int:
        """Leases that hold a reservation here."""
        return len(self._held)

    # ------------------------------------------------------------------ grants

    def reserve(self, lease: int, tokens: int, waiter: int | None = None) -> None:
        """Reserve ``tokens`` for ``lease``, granted to ``waiter`` (its arrival number) or at once.

        Raises:
            ValueError: ``tokens`` do not fit (:meth:`fits`), or ``lease`` reserved already.
        """
        held = self._held
        if lease in held:
            raise ValueError(f"lease {lease} reserved already")
        headroom = 0 if waiter is not None and waiter == self.pinned else self.headroom  # fits(), inline
        if tokens < 0 or self.reserved + tokens + headroom > self.budget:
            raise ValueError(
                f"{tokens} tokens do not fit: {self.reserved} reserved, {self.headroom} held of {self.budget}"
            )
        held[lease] = tokens
        self.reserved += tokens
        if waiter is not None and self._passed:
            self.forget(waiter)

    def release(self, lease: int) -> int:
        """Return ``lease``'s reservation; the tokens returned (0 if returned already)."""
        tokens = self._held.pop(lease, 0)
        self.reserved -= tokens
        return tokens

    def settle(self, lease: int, used: int) -> int:
        """Replace ``lease``'s reservation with ``used`` tokens (at least 0); the tokens freed (< 0: taken).

        A lease already released is left released (0).
        """
        if lease not in self._held:
            return 0
        used = max(0, used)
        step = self._held[lease] - used
        self._held[lease] = used
        self.reserved -= step
        return step

    def lower(self, lease: int, tokens: int) -> int:
        """Lower ``lease``'s reservation to ``tokens`` if that is less; the tokens freed."""
        if tokens >= self._held.get(lease, 0):
            return 0
        return self.settle(lease, tokens)

    # --------------------------------------------------------------- starvation

    def passed_over(self, waiter: int, tokens: int, granted: int) -> bool:
        """A later request was granted ``granted`` tokens here while ``waiter`` (``tokens``) did not fit.

        Returns:
            Whether ``waiter`` is pinned now (its tokens held as headroom).
        """
        entry = self._passed.setdefault(waiter, [0, tokens])
        entry[0] += granted
        entry[1] = tokens
        if self.pinned is None and entry[0] >= self.patience * tokens:
            self._pin(waiter, tokens)
        return self.pinned == waiter

    def forget(self, waiter: int) -> bool:
        """``waiter`` left (granted here or elsewhere, withdrawn, failed): its count goes, its pin passes on.

        Returns:
            Whether it was pinned (the headroom changed: requests may fit now that did not).
        """
        if self._passed.pop(waiter, None) is None or self.pinned != waiter:
            return False
        self.pinned, self.headroom = None, 0
        for other, (passed, tokens) in sorted(self._passed.items()):
            if passed >= self.patience * tokens and tokens <= self.configured:
                self._pin(other, tokens)
                break
        return True

    def set_budget(self, budget: int) -> None:
        """A new configured budget (refresh); reservations are kept, even above it, and so is the
        engine's cut (at most what the new budget leaves). A pinned waiter whose tokens it can no
        longer hold is forgotten (it can never run here now)."""
        if budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        self.configured = budget
        self.cut = min(self.cut, budget)
        self.budget = budget - self.cut
        if self.pinned is not None and self.headroom > budget:
            self.forget(self.pinned)

    def engine_report(self, kv_use: float | None, preempted: bool) -> bool:
        """The engine's own report (:func:`engine_cut`) sets the cut; whether the budget rose
        (requests may fit now that did not). A pinned waiter stays pinned: the cut is the engine's
        passing pressure, its tokens fit the configured budget."""
        cut = engine_cut(self.configured, self.reserved, kv_use, preempted)
        rose = cut < self.cut
        self.cut = cut
        self.budget = self.configured - cut
        return rose

    def _pin(self, waiter: int, tokens: int) -> None:
        self.pinned, self.headroom = waiter, tokens

    def __repr__(self) -> str:
        held = f", {self.headroom} held for #{self.pinned}" if self.pinned is not None else ""
        cut = f" ({self.cut} cut by the engine)" if self.cut else ""
        return f"<TokenLedger {self.reserved}/{self.budget}{cut} reserved by {len(self._held)}{held}>"
