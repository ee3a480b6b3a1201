"""The proof of ``TokenLedger``: reservations, release exactly once, settle, and the starvation bound.

:class:`LedgerMachine` drives one ledger against a plain model (a dict of
reservations) and checks after every step: ``reserved`` is the sum of the
reservations, none negative, every grant left ``reserved <= budget`` (and
beside the headroom held for a pinned waiter), each reservation comes back
exactly once, the pinned waiter is the one the rule names.

:class:`StarvationMachine` runs one provider under a greedy dispatcher that
never blocks on its head (the earliest waiter that fits is granted), small
requests arriving without end and one big one waiting: the big one is pinned
once its own size in tokens has been granted past it, and granted, at the
latest, once every lease that held tokens when it was pinned is released. The control runs it with no
headroom rule (a patience no run reaches) and sees the big one starve.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from iop_admission.core import TokenLedger, reservation

pytestmark = pytest.mark.req("token-ledger")


class LedgerMachine(RuleBasedStateMachine):
    @initialize(
        budget=st.integers(0, 64),
        patience=st.integers(0, 3),
        sizes=st.lists(st.integers(0, 70), min_size=6, max_size=6),
    )
    def start(self, budget: int, patience: int, sizes: list[int]) -> None:
        self.ledger = TokenLedger(budget, patience)
        self.sizes = dict(enumerate(sizes, 1))  # a waiter's tokens
        self.held: dict[int, int] = {}  # the model: lease -> tokens
        self.released: set[int] = set()
        self.passes: dict[int, tuple[int, int]] = {}  # waiter -> (times passed over, tokens)
        self.pinned: int | None = None
        self.next_lease = 1
        self.over = False  # a settle above its reservation or a lower budget may leave it over

    def _expect_pin(self) -> None:
        if self.pinned is None:
            due = sorted(
                w for w, (n, t) in self.passes.items() if n >= self.ledger.patience * t and t <= self.ledger.budget
            )
            self.pinned = due[0] if due else None

    @rule(tokens=st.integers(0, 40), waiter=st.one_of(st.none(), st.integers(1, 6)))
    def reserve(self, tokens: int, waiter: int | None) -> None:
        lease = self.next_lease
        self.next_lease += 1
        headroom = 0 if waiter is not None and waiter == self.pinned else self.ledger.headroom
        fits = sum(self.held.values()) + tokens + headroom <= self.ledger.budget
        assert self.ledger.fits(tokens, waiter) is fits
        if not fits:
            with pytest.raises(ValueError, match="do not fit"):
                self.ledger.reserve(lease, tokens, waiter)
            return
        self.ledger.reserve(lease, tokens, waiter)
        self.held[lease] = tokens
        assert self.ledger.reserved <= self.ledger.budget - (0 if waiter == self.pinned else headroom)
        if waiter is not None and self.passes.pop(waiter, None) is not None and waiter == self.pinned:
            self.pinned = None
            self._expect_pin()

    @precondition(lambda self: self.next_lease > 1)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lease = data.draw(st.integers(1, self.next_lease - 1))
        expected = self.held.pop(lease, 0)
        assert self.ledger.release(lease) == expected
        assert self.ledger.release(lease) == 0  # exactly once
        assert self.ledger.holding(lease) == 0
        self.released.add(lease)

    @precondition(lambda self: self.next_lease > 1)
    @rule(data=st.data(), used=st.integers(-5, 50))
    def settle(self, data: st.DataObject, used: int) -> None:
        lease = data.draw(st.integers(1, self.next_lease - 1))
        before = self.held.get(lease)
        freed = self.ledger.settle(lease, used)
        if before is None:
            assert freed == 0
            assert self.ledger.holding(lease) == 0
            return
        self.held[lease] = max(0, used)
        assert freed == before - self.held[lease]
        self.over |= freed < 0

    @precondition(lambda self: self.next_lease > 1)
    @rule(data=st.data(), tokens=st.integers(0, 50))
    def lower(self, data: st.DataObject, tokens: int) -> None:
        lease = data.draw(st.integers(1, self.next_lease - 1))
        before = self.held.get(lease, 0)
        freed = self.ledger.lower(lease, tokens)
        assert freed == max(0, before - tokens)
        if lease in self.held:
            self.held[lease] = min(before, tokens)

    @rule(waiter=st.integers(1, 6), granted=st.integers(0, 30))
    def passed_over(self, waiter: int, granted: int) -> None:
        tokens = self.sizes[waiter]
        n, _ = self.passes.get(waiter, (0, tokens))
        self.passes[waiter] = (n + granted, tokens)
        if self.pinned is None and n + granted >= self.ledger.patience * tokens:
            self.pinned = waiter
        assert self.ledger.passed_over(waiter, tokens, granted) is (self.pinned == waiter)

    @rule(waiter=st.integers(1, 6))
    def forget(self, waiter: int) -> None:
        assert self.ledger.forget(waiter) is (waiter == self.pinned)
        self.passes.pop(waiter, None)
        if waiter == self.pinned:
            self.pinned = None
            self._expect_pin()

    @rule(budget=st.integers(0, 64))
    def set_budget(self, budget: int) -> None:
        self.ledger.set_budget(budget)
        self.over |= sum(self.held.values()) > budget
        if self.pinned is not None and self.passes[self.pinned][1] > budget:  # it can never run here
            del self.passes[self.pinned]
            self.pinned = None
            self._expect_pin()

    @invariant()
    def counts(self) -> None:
        ledger = self.ledger
        assert ledger.reserved == sum(self.held.values())
        assert ledger.leases == len(self.held)
        assert all(ledger.holding(lease) == tokens >= 0 for lease, tokens in self.held.items())
        assert ledger.free == max(0, ledger.budget - ledger.reserved)
        if not self.over:
            assert ledger.reserved <= ledger.budget
        assert ledger.pinned == self.pinned
        assert ledger.headroom == (self.passes[self.pinned][1] if self.pinned is not None else 0)


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


@dataclass
class Provider:
    """One provider under a greedy dispatcher: the earliest waiter that fits is granted (no head-of-line)."""

    ledger: TokenLedger
    queue: dict[int, int] = field(default_factory=dict)  # waiter -> tokens, in arrival order
    running: dict[int, int] = field(default_factory=dict)  # lease -> tokens
    granted: dict[int, int] = field(default_factory=dict)  # lease -> tokens, in grant order
    pinned_with: dict[int, set[int]] = field(default_factory=dict)  # waiter -> leases running at its pin
    seq: int = 0

    def arrive(self, tokens: int) -> int:
        self.seq += 1
        self.queue[self.seq] = tokens
        self.dispatch()
        return self.seq

    def dispatch(self) -> None:
        while True:
            first = next((w for w, t in self.queue.items() if self.ledger.fits(t, w)), None)
            if first is None:
                return
            tokens = self.queue.pop(first)
            self.ledger.reserve(first, tokens, first)
            self.running[first] = tokens
            self.granted[first] = tokens
            for earlier, t in list(self.queue.items()):
                if earlier > first:
                    break
                # Earlier waiters in the queue did not fit; note who runs when one is pinned.
                if self.ledger.passed_over(earlier, t, tokens) and earlier not in self.pinned_with:
                    self.pinned_with[earlier] = set(self.running)  # the grant that pinned it too

    def finish(self, lease: int) -> None:
        del self.running[lease]
        self.ledger.release(lease)
        self.dispatch()


class StarvationMachine(RuleBasedStateMachine):
    """Small requests arrive and finish in any order; one big request waits among them."""

    patience = 1  # the bound checked
    ledger_patience = 1  # the ledger's rule

    @initialize(budget=st.integers(8, 40), big=st.integers(0, 100))
    def start(self, budget: int, big: int) -> None:
        self.p = Provider(TokenLedger(budget, self.ledger_patience))
        for _ in range(3):
            self.p.arrive(max(1, budget // 4))
        self.big_tokens = max(1, budget * big // 100)
        self.big = self.p.arrive(self.big_tokens)

    @rule(tokens=st.integers(1, 6))
    def small_arrives(self, tokens: int) -> None:
        self.p.arrive(tokens)

    @precondition(lambda self: self.p.running)
    @rule(data=st.data())
    def one_finishes(self, data: st.DataObject) -> None:
        lease = data.draw(st.sampled_from(sorted(self.p.running)))
        self.p.finish(lease)

    @invariant()
    def big_is_served_within_the_bound(self) -> None:
        ledger = self.p.ledger
        if self.big not in self.p.queue:
            return
        pinned_with = self.p.pinned_with.get(self.big)
        if pinned_with is not None:
            # Pinned: every grant since fits beside it, so once the leases that were running then
            # are gone it fits, and the dispatcher grants it.
            assert ledger.pinned == self.big
            assert pinned_with & set(self.p.running), "the big request outlived every lease before its pin"
        elif ledger.pinned is None:  # (another waiter pinned first defers its pin)
            passed = sum(tokens for lease, tokens in self.p.granted.items() if lease > self.big)
            assert passed < self.patience * self.big_tokens, "passed by more than its own size without a pin"


TestStarvationMachine = StarvationMachine.TestCase
TestStarvationMachine.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)


class NoHeadroom(StarvationMachine):
    """Control: a patience no run reaches, so nothing is ever held for the big request."""

    ledger_patience = 10**9


def test_the_bound_fails_without_headroom() -> None:
    """The control starves the big request: a steady stream of small ones keeps the budget busy."""
    control = NoHeadroom.TestCase
    control.settings = settings(max_examples=200, stateful_step_count=60, deadline=None, database=None)
    with pytest.raises(AssertionError, match="passed by more than its own size"):
        control().runTest()


def test_a_starved_request_is_pinned_then_granted_first() -> None:
    """Budget 10: two requests of 4 run; a request of 8 waits while 2-token requests pass it;
    once 8 tokens have passed it, it is pinned: 8 held, nothing more is granted beside it, and
    it runs as soon as the leases before its pin leave, before the 1 queued behind it."""
    p = Provider(TokenLedger(10))
    first, second = p.arrive(4), p.arrive(4)
    big = p.arrive(8)
    s1 = p.arrive(2)  # 10 reserved; 2 passed it
    p.finish(first)
    s2, s3 = p.arrive(2), p.arrive(2)  # 10 reserved; 6 passed it
    assert p.ledger.pinned is None
    p.finish(s1)
    s4 = p.arrive(2)  # 8 passed it: pinned
    assert s4 in p.running and p.ledger.pinned == big and p.ledger.headroom == 8
    later = p.arrive(1)
    assert later in p.queue  # 10 reserved: 1 more does not fit beside the 8 held
    for lease in (second, s2):
        p.finish(lease)
        assert big in p.queue
    p.finish(s3)  # 2 reserved: the 8 fits, the 1 then does not
    assert big in p.running and later in p.queue
    assert p.ledger.pinned is None and p.ledger.headroom == 0
    p.finish(s4)
    assert later in p.running


@given(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6))
def test_a_reservation_is_prompt_and_output_bounded_by_the_window(prompt: int, output: int, window: int) -> None:
    tokens = reservation(prompt, output, window)
    assert tokens == (min(prompt + output, window) if window else prompt + output)


@pytest.mark.parametrize(("prompt", "output"), [(-1, 0), (0, -1)])
def test_a_negative_figure_is_refused(prompt: int, output: int) -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        reservation(prompt, output, 100)


def test_a_lease_reserves_once_and_budgets_are_not_negative() -> None:
    ledger = TokenLedger(10)
    ledger.reserve(1, 3)
    with pytest.raises(ValueError, match="reserved already"):
        ledger.reserve(1, 3)
    with pytest.raises(ValueError, match="do not fit"):
        ledger.reserve(2, -1)
    for bad in (lambda: TokenLedger(-1), lambda: TokenLedger(1, -1), lambda: ledger.set_budget(-1)):
        with pytest.raises(ValueError, match=">= 0"):
            bad()
    assert ledger.could_fit(10) and not ledger.could_fit(11)
    assert repr(ledger) == "<TokenLedger 3/10 reserved by 1>"
    assert not ledger.passed_over(7, 9, 5)
    assert ledger.passed_over(7, 9, 4)  # 9 tokens passed it: its own size
    assert repr(ledger) == "<TokenLedger 3/10 reserved by 1, 9 held for #7>"
