"""Tenants, bands, weighted fair share and quotas: the proof of ``FairShare``.

A Hypothesis state machine drives :class:`iop_admission._fairness.FairShare`
over one provider of capacity ``C`` with ``L`` long slots and checks after
every step: counters exact, per-tenant quotas, capacity and long slots never
exceeded, no dispatchable higher-band waiter passed over, no head-of-line
across tenants, the fairness bound and the starvation bound. A control test
runs the same checks against plain FIFO and sees them fail; a differential test
shows that with one tenant every grant is today's FIFO choice.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from iop_admission import TenantLimitExceeded, TenantSpec
from iop_admission.core import DEFAULT_TENANT, FairShare, Ticket

pytestmark = pytest.mark.req("tenant-fair-share")

NAMES = ("a", "b", "c", "d")


@dataclass(frozen=True)
class Item:
    """What a waiter asks for: a normal or a long slot."""

    n: int
    long: bool


class FifoShare(FairShare):
    """Control: the global FIFO of today, blind to tenants, bands and weights."""

    def choose(self, dispatchable: Callable[[Hashable], bool]) -> Ticket | None:
        queued = sorted((t for name in self.tenants() for t in self.queued(name)), key=lambda t: t.seq)
        return next((t for t in queued if dispatchable(t.item)), None)


@dataclass
class Window:
    """Two tenants of one band both backlogged since the window opened: what each was charged
    for the grants made in it (``counted``: each such ticket's charge, settled or not yet)."""

    served: dict[str, float] = field(default_factory=dict)
    counted: dict[int, float] = field(default_factory=dict)


class FairnessMachine(RuleBasedStateMachine):
    scheduler: type[FairShare] = FairShare

    @initialize(
        weights=st.lists(st.integers(1, 3), min_size=4, max_size=4),
        bands=st.lists(st.sampled_from([-1, 0, 0, 1]), min_size=4, max_size=4),
        caps=st.lists(st.one_of(st.none(), st.integers(1, 3)), min_size=4, max_size=4),
        queues=st.lists(st.one_of(st.none(), st.integers(2, 6)), min_size=4, max_size=4),
        capacity=st.integers(1, 4),
        long_slots=st.integers(0, 2),
        tokens=st.booleans(),
    )
    def setup(
        self,
        weights: list[int],
        bands: list[int],
        caps: list[int | None],
        queues: list[int | None],
        capacity: int,
        long_slots: int,
        tokens: bool,
    ) -> None:
        self.specs = {
            n: TenantSpec(n, weight=w, priority=b, max_in_flight=c, max_queue=q)
            for n, w, b, c, q in zip(NAMES, weights, bands, caps, queues, strict=True)
        }
        self.core = self.scheduler(self.specs.values())
        self.capacity, self.long_slots, self.tokens = capacity, long_slots, tokens
        self.queued: dict[str, list[Ticket]] = {n: [] for n in (*NAMES, DEFAULT_TENANT)}
        self.held: list[Ticket] = []
        self.counter = 0
        self.max_cost = 8.0 if tokens else 1.0
        self.windows: dict[tuple[str, str], Window] = {}
        self.waited: dict[str, int] = {}  # grants of its band since the tenant became backlogged
        self.passed: set[int] = set()  # waiters passed over (not dispatchable) while their band was served

    # -- model helpers --------------------------------------------------------

    def in_flight(self) -> tuple[int, int]:
        return len(self.held), sum(1 for t in self.held if isinstance(t.item, Item) and t.item.long)

    def dispatchable(self, item: Hashable) -> bool:
        normal, long = self.in_flight()
        assert isinstance(item, Item)
        return normal < self.capacity and (not item.long or long < self.long_slots)

    def eligible(self, name: str) -> bool:
        cap = self.core.spec(name).max_in_flight
        held = sum(1 for t in self.held if t.tenant == name)
        return (cap is None or held < cap) and any(self.dispatchable(t.item) for t in self.queued[name])

    def backlogged(self, name: str) -> bool:
        """Waiting, under its own cap, no long waiter: the tenant SFQ's bounds speak of.

        The provider's capacity is shared by every tenant, so a full provider
        does not end a backlog; a long waiter blocked on long slots would.
        """
        cap = self.core.spec(name).max_in_flight
        held = sum(1 for t in self.held if t.tenant == name)
        queue = self.queued[name]
        return (
            bool(queue)
            and (cap is None or held < cap)
            and not any(isinstance(t.item, Item) and t.item.long for t in queue)
        )

    # -- rules ----------------------------------------------------------------

    @rule(name=st.sampled_from(NAMES), long=st.booleans(), cost=st.integers(1, 8), count=st.integers(1, 3))
    def arrive(self, name: str, long: bool, cost: int, count: int) -> None:
        for _ in range(count):
            self.counter += 1
            item = Item(self.counter, long)
            limit = self.core.spec(name).max_queue
            if limit is not None and len(self.queued[name]) >= limit:
                with pytest.raises(TenantLimitExceeded, match="max_queue"):
                    self.core.enqueue(name, item)
                continue
            ticket, shed = self.core.enqueue(name, item, float(cost if self.tokens else 1))
            assert limit is None or len(self.queued[name]) < limit
            assert shed == []
            self.queued[name].append(ticket)
        self.dispatch()

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 50), used=st.integers(1, 8))
    def finish(self, index: int, used: int) -> None:
        ticket = self.held.pop(index % len(self.held))
        if self.tokens:
            before = self.core.served(ticket.tenant)
            self.core.settle(ticket, float(used))
            assert self.core.served(ticket.tenant) == before - ticket.cost + used
            self.settled(ticket, float(used))
        self.core.release(ticket)
        self.dispatch()

    @precondition(lambda self: any(self.queued.values()))
    @rule(index=st.integers(0, 50))
    def give_up(self, index: int) -> None:
        waiting = [t for q in self.queued.values() for t in q]
        ticket = waiting[index % len(waiting)]
        self.core.cancel(ticket)
        self.queued[ticket.tenant].remove(ticket)
        self.dispatch()

    @rule(name=st.sampled_from(NAMES), weight=st.integers(1, 3), cap=st.one_of(st.none(), st.integers(1, 3)))
    def reconfigure(self, name: str, weight: int, cap: int | None) -> None:
        old = self.specs[name]
        self.specs[name] = TenantSpec(name, weight, old.priority, cap, old.max_queue)
        self.core.configure(self.specs.values())
        self.windows.clear()  # the bound is stated for fixed weights
        self.waited.clear()
        self.dispatch()

    # -- the grant loop and its checks ---------------------------------------

    def dispatch(self) -> None:
        for _ in range(100):
            self.open_windows()
            ticket = self.core.grant(self.dispatchable)
            if ticket is None:
                break
            name = ticket.tenant
            assert ticket in self.queued[name], "granted a ticket that was not waiting"
            assert self.dispatchable(ticket.item), "capacity or long slots exceeded"
            assert self.eligible(name), "max_in_flight exceeded"
            band = self.core.spec(name).priority
            higher = [n for n in NAMES if self.core.spec(n).priority > band and self.eligible(n)]
            assert not higher, f"dispatchable higher-band waiter of {higher} passed over"
            self.queued[name].remove(ticket)
            self.held.append(ticket)
            self.account(name, band, ticket, ticket.seq in self.passed)
            self.passed.update(
                t.seq
                for n in NAMES
                if self.core.spec(n).priority == band
                for t in self.queued[n]
                if not self.dispatchable(t.item)
            )
        for n in NAMES:
            assert not self.eligible(n), f"{n} has a dispatchable waiter left queued (head-of-line)"

    def open_windows(self) -> None:
        live = {n for n in NAMES if self.backlogged(n)}
        for key in list(self.windows):
            if not set(key) <= live:
                del self.windows[key]
        for n in list(self.waited):
            if n not in live:
                del self.waited[n]
        for i in live:
            self.waited.setdefault(i, 0)
            for j in live:
                same_band = self.core.spec(i).priority == self.core.spec(j).priority
                if i < j and same_band and (i, j) not in self.windows:
                    self.windows[(i, j)] = Window({i: 0.0, j: 0.0})

    def fair_in_windows(self) -> None:
        """The fairness bound in every open window, over what each tenant was charged in it."""
        for (i, j), window in self.windows.items():
            wi, wj = self.core.spec(i).weight, self.core.spec(j).weight
            gap = abs(window.served[i] / wi - window.served[j] / wj)
            bound = self.max_cost / wi + self.max_cost / wj
            assert gap <= bound + 1e-9, f"fairness bound: {i},{j} differ by {gap} > {bound}"

    def settled(self, ticket: Ticket, used: float) -> None:
        """A grant's charge settled to ``used``: the windows that counted the grant count ``used``
        (the scheduler shares what tenants are charged, and a settled charge is the charge)."""
        for window in self.windows.values():
            counted = window.counted.get(ticket.seq)
            if counted is not None:
                window.served[ticket.tenant] += used - counted
                window.counted[ticket.seq] = used

    def account(self, name: str, band: int, ticket: Ticket, passed_over: bool = False) -> None:
        """Count a grant in the windows and the waits. A waiter passed over earlier is served from
        its place (its tenant's tag), not as a newcomer: its grant makes nobody wait longer than
        its place said, so it is not counted in the others' waits."""
        for (i, j), window in self.windows.items():
            if name in (i, j):
                window.served[name] += ticket.cost
                window.counted[ticket.seq] = ticket.cost
        self.fair_in_windows()
        if self.tokens:
            return
        for other in list(self.waited):
            if passed_over and other != name:
                continue
            if other == name:
                del self.waited[other]
            elif self.core.spec(other).priority == band:
                self.waited[other] += 1
                wo = self.core.spec(other).weight
                peers = [n for n in NAMES if n != other and self.core.spec(n).priority == band]
                limit = sum(math.floor(self.core.spec(n).weight / wo) + 1 for n in peers)
                assert self.waited[other] <= limit, f"starvation bound: {other} waited {self.waited[other]} > {limit}"

    @invariant()
    def counters_exact(self) -> None:
        if not hasattr(self, "core"):
            return
        assert self.core.queue_depth == sum(len(q) for q in self.queued.values())
        for n in NAMES:
            assert self.core.waiting(n) == len(self.queued[n])
            assert self.core.in_flight(n) == sum(1 for t in self.held if t.tenant == n)
        normal, long = self.in_flight()
        assert normal <= self.capacity and long <= self.long_slots


FairnessMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestFairnessMachine = FairnessMachine.TestCase


def _flood(core: FairShare, grants: int) -> dict[str, int]:
    """Drive a 1:2 pair flooding a capacity-1 provider; return grants per tenant."""
    machine_held: list[Ticket] = []
    for n in range(grants):
        core.enqueue("a", Item(n, False))
    for n in range(grants):
        core.enqueue("b", Item(grants + n, False))
    for _ in range(grants):
        ticket = core.grant(lambda item: not machine_held)
        assert ticket is not None
        machine_held.append(ticket)
        core.release(machine_held.pop())
    return {n: core.grants(n) for n in ("a", "b")}


def test_fair_share_follows_weights() -> None:
    """[tenant-fair-share] Two flooding tenants of weight 1 and 2 get 1/3 and 2/3 of 300 grants."""
    core = FairShare([TenantSpec("a", weight=1), TenantSpec("b", weight=2)])
    assert _flood(core, 300) == {"a": 100, "b": 200}


def test_fifo_control_fails_the_fairness_checks() -> None:
    """[tenant-fair-share] The same machine checks, run against plain FIFO, fail."""

    class FifoMachine(FairnessMachine):
        scheduler = FifoShare

    machine = FifoMachine()
    machine.setup(
        weights=[1, 1, 1, 1],
        bands=[0, 0, 0, 0],
        caps=[None] * 4,
        queues=[None] * 4,
        capacity=1,
        long_slots=0,
        tokens=False,
    )
    with pytest.raises(AssertionError, match=r"fairness bound|starvation bound"):
        machine.arrive("a", False, 1, 3)
        machine.arrive("a", False, 1, 3)
        machine.arrive("b", False, 1, 3)
        for _ in range(6):
            machine.finish(0, 1)
    assert _flood(FifoShare([TenantSpec("a", weight=1), TenantSpec("b", weight=2)]), 300) == {"a": 300, "b": 0}


@pytest.mark.req("tenant-one-is-today")
@pytest.mark.parametrize("configured", [False, True])
def test_one_tenant_grants_as_today(configured: bool) -> None:
    """[tenant-one-is-today] With one tenant every grant is the earliest dispatchable waiter."""
    steps = st.lists(st.tuples(st.sampled_from(["arrive", "finish", "give_up"]), st.booleans(), st.integers(0, 50)))

    @settings(max_examples=200, deadline=None)
    @given(steps=steps, capacity=st.integers(1, 3), long_slots=st.integers(0, 2))
    def run(steps: list[tuple[str, bool, int]], capacity: int, long_slots: int) -> None:
        core = FairShare([TenantSpec("only", weight=3, max_queue=None)] if configured else [])
        name = "only" if configured else DEFAULT_TENANT
        waiting: list[Ticket] = []  # today's global queue, in arrival order
        held: list[Item] = []

        def dispatchable(item: Hashable) -> bool:
            assert isinstance(item, Item)
            return len(held) < capacity and (not item.long or sum(h.long for h in held) < long_slots)

        def drain() -> None:
            for _ in range(100):
                today = next((t for t in waiting if dispatchable(t.item)), None)
                ticket = core.grant(dispatchable)
                assert ticket is today
                if ticket is None:
                    return
                waiting.remove(ticket)
                assert isinstance(ticket.item, Item)
                held.append(ticket.item)
                core.release(ticket)

        for n, (op, long, index) in enumerate(steps):
            if op == "arrive":
                waiting.append(core.enqueue(name, Item(n, long))[0])
            elif op == "finish" and held:
                held.pop(index % len(held))
            elif op == "give_up" and waiting:
                core.cancel(waiting.pop(index % len(waiting)))
            drain()

    run()


@pytest.mark.req("tenant-quotas")
def test_quota_refusals_name_the_limit_and_shed_negative_bands() -> None:
    """[tenant-quotas] max_queue refuses the tenant only; a full queue sheds the negative band first."""
    core = FairShare(
        [TenantSpec("batch", priority=-1), TenantSpec("chat", max_queue=2), TenantSpec("eval")], queue_limit=4
    )
    core.enqueue("chat", Item(1, False))
    core.enqueue("chat", Item(2, False))
    with pytest.raises(TenantLimitExceeded) as refused:
        core.enqueue("chat", Item(3, False))
    assert (refused.value.tenant, refused.value.limit, refused.value.value) == ("chat", "max_queue", 2)
    first, _ = core.enqueue("batch", Item(4, False))
    newest, _ = core.enqueue("batch", Item(5, False))
    with pytest.raises(TenantLimitExceeded, match="shed"):
        core.enqueue("batch", Item(6, False))
    _, shed = core.enqueue("eval", Item(7, False))
    assert shed == [newest]
    _, shed = core.enqueue("eval", Item(8, False))
    assert shed == [first]
    with pytest.raises(TenantLimitExceeded) as full:
        core.enqueue("eval", Item(9, False))
    assert full.value.limit == "queue"
    assert core.tenant_of("nobody") == DEFAULT_TENANT and core.tenant_of(None) == DEFAULT_TENANT


@pytest.mark.req("tenant-token-cost")
def test_token_cost_shares_tokens_not_requests() -> None:
    """[tenant-token-cost] 8,000- against 500-token prompts at equal weight: served tokens within 10 %."""
    core = FairShare([TenantSpec("big"), TenantSpec("small")])
    for n in range(400):
        core.enqueue("big", Item(n, False), 8000.0)
    for n in range(4000):
        core.enqueue("small", Item(400 + n, False), 500.0)
    for _ in range(1500):
        ticket = core.grant()
        assert ticket is not None
        core.settle(ticket, ticket.cost * 0.75)  # the backend used less than reserved
        core.release(ticket)
    big, small = core.served("big"), core.served("small")
    assert abs(big - small) <= 0.1 * max(big, small)
    assert big + small == 0.75 * (8000 * core.grants("big") + 500 * core.grants("small"))
