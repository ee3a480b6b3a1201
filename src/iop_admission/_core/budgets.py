"""The token-budget part of the admission core: who was passed over where, and the headroom it frees.

Each provider that admits by a token budget owns a :class:`~iop_admission._ledger.TokenLedger`
(on its :class:`~.slots.ProviderSlot`; :class:`~.pool.Pool` reserves at a grant and returns at a
release). :class:`Budgets` keeps the side of the ledger that reads the queue ([token-ledger]):

* after a grant of tokens on a provider, the earliest waiter that could use it, arrived
  before the grant, and is kept off it only by its tokens, is *passed over* there
  by the tokens granted (:meth:`Budgets.note_pass`); once its own size has passed it, it is
  pinned, its tokens held as headroom (the ledger's rule);
* a waiter that leaves unserved (withdrawn, timed out, failed) is forgotten by those
  ledgers; where its tokens were held, the room is given back, and the providers are
  listed for the dispatcher (:meth:`Budgets.take_unpinned`); so is a waiter that a refresh
  takes off a provider, by that provider's ledger (:meth:`Budgets.moved`).
"""

from __future__ import annotations

from .records import Waiter
from .slots import ProviderSlot
from .tenants import Tenants


class Budgets:
    """The passes the ledgers count, and the providers whose headroom a departure freed."""

    __slots__ = ("_tenants", "unpinned")

    def __init__(self, tenants: Tenants) -> None:
        self._tenants = tenants
        self.unpinned: list[ProviderSlot] = []
        """The providers whose headroom a departure gave back, until :meth:`take_unpinned` (an empty
        list is read on every drain and dispatch: the test of it is the whole cost where no budget is)."""

    def note_pass(self, p: ProviderSlot, seq: int, granted: int) -> None:
        """A grant of ``granted`` tokens to arrival ``seq`` on ``p`` (a token budget): the earliest
        waiter that could use ``p`` and arrived before ``seq`` is passed over by them if only its
        tokens kept it off ``p``."""
        ledger = p.ledger
        assert ledger is not None
        earliest: Waiter | None = None
        for g, _ in p.groups:
            for long in (False, True):
                if g.long_live if long else g.normal_live:
                    w = g.head(long)
                    if w is not None and w.seq < seq and (earliest is None or w.seq < earliest.seq):
                        earliest = w
        if earliest is None or (earliest.long and p.long_in_flight >= p.long_capacity):
            return  # the long slots keep it waiting (or it never runs long here)
        need = p.need(earliest.tokens, earliest.long)
        if not ledger.could_fit(need) or ledger.fits(need, earliest.seq):
            return  # it could never run here, or tokens are not what keeps it waiting
        if not self._tenants.can_run(earliest.tenant):
            return  # its tenant's cap keeps it waiting
        ledger.passed_over(earliest.seq, need, granted)
        if earliest._passed is None:
            earliest._passed = [p]
        elif p not in earliest._passed:
            earliest._passed.append(p)

    def forget(self, waiter: Waiter) -> None:
        """``waiter`` left (or reserved its tokens): the ledgers that counted it forget it; where
        its tokens were held as headroom, the provider is listed for :meth:`take_unpinned`."""
        for p in waiter._passed or ():
            if p.ledger is not None and p.ledger.forget(waiter.seq):
                self.unpinned.append(p)
        waiter._passed = None

    def moved(self, waiter: Waiter, candidates: tuple[ProviderSlot, ...]) -> None:
        """``waiter``'s candidates are now ``candidates`` (a refresh): the ledgers of the providers it
        can no longer run on forget it, as :meth:`forget` does; its counts on the others stay."""
        kept: list[ProviderSlot] = []
        for p in waiter._passed or ():
            if p in candidates:
                kept.append(p)
            elif p.ledger is not None and p.ledger.forget(waiter.seq):
                self.unpinned.append(p)
        waiter._passed = kept or None

    def take_unpinned(self) -> list[ProviderSlot]:
        """The providers whose headroom a departure gave back since the last call (to dispatch)."""
        out = self.unpinned
        if out:
            self.unpinned = []
        return out
