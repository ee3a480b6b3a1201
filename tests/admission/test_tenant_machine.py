"""Tenants in the wired admission core: a Hypothesis state machine over the real ``AdmissionState``.

Two providers and two model keys on both (in opposite preference order), four
tenants with random weights, bands, ``max_in_flight`` and ``max_queue``,
request or token cost. Rules: requests (normal and long) of any tenant and
model, releases with settlement, withdrawals, a node dropping and coming back,
and live refreshes of a tenant's weight and cap. After every step, and at every grant, the machine checks
against its own model of who waits and who holds what:

* counters exact (the core's tenant rows against the model);
* per-tenant in flight <= ``max_in_flight``, queued <= ``max_queue``;
* a provider's capacity and long slots never exceeded;
* no dispatchable waiter of a higher band passed over by a grant, nor an
  earlier dispatchable waiter of the same tenant (FIFO within a tenant);
* no head-of-line: after every step no waiter of a tenant under its cap has a
  dispatchable candidate (node drops included: a revoked lease frees its
  tenant's slot and the waiters it held back run);
* the fairness bound of ``docs/admission.md``: two tenants of a band that stay
  backlogged differ in cost charged / weight by at most
  ``c / w_i + c / w_j`` (``c`` the largest cost of one request); under token
  cost, in reserves granted, widened by the size of the settlements made during
  the interval (each divided by its tenant's weight);
* the starvation bound (request cost): a backlogged tenant ``i`` is granted
  within ``sum(floor(w_j / w_i) + 1 for j != i)`` grants of its band (not
  counting the grants of a peer seen waiting but held back meanwhile -- a long
  waiter, its cap -- whose tag stayed behind and which catches up).

A control runs the same checks on the same core without tenants (the global
FIFO of before) and sees the bounds fail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from iop_admission import (
    ModelGroup,
    PoolConfig,
    ProviderKey,
    ProviderSpec,
    QueuePolicy,
    TenantLimitExceeded,
    TenantSpec,
    Unavailable,
)
from iop_admission.core import AdmissionState, Decision, Failed, Granted, Lease, Revoked, Waiter

pytestmark = pytest.mark.req("tenant-fair-share")

NAMES = ("a", "b", "c", "d")
A = ProviderKey("node-a", "gpu0")
B = ProviderKey("node-b", "gpu1")
MODELS = {"m": (A, B), "n": (B, A)}
WINDOW = 32768


def spec(capacity: int, long_cap: int) -> ProviderSpec:
    return ProviderSpec(
        capacity=capacity,
        long_context_capacity=long_cap,
        context_window_tokens=WINDOW,
        total_context_tokens=WINDOW * long_cap,
    )


@dataclass
class Window:
    """Two tenants of one band, both backlogged since the window opened.

    ``served``: the reserves of each one's grants in the window. ``slack``: the
    size of each one's settlements during the window (usage minus reserve, of
    any lease; a retry settles its failed attempt to 0): each moves the
    tenant's tag by itself divided by the weight, and so widens the bound.
    """

    served: dict[str, float]
    slack: dict[str, float]


class TenantMachine(RuleBasedStateMachine):
    with_tenants = True
    with_retries = True

    @initialize(
        weights=st.lists(st.integers(1, 3), min_size=4, max_size=4),
        bands=st.lists(st.sampled_from([-1, 0, 0, 1]), min_size=4, max_size=4),
        caps=st.lists(st.one_of(st.none(), st.integers(1, 3)), min_size=4, max_size=4),
        queues=st.lists(st.one_of(st.none(), st.integers(2, 6)), min_size=4, max_size=4),
        capacities=st.tuples(st.integers(1, 3), st.integers(1, 2)),
        tokens=st.booleans(),
    )
    def setup(
        self,
        weights: list[int],
        bands: list[int],
        caps: list[int | None],
        queues: list[int | None],
        capacities: tuple[int, int],
        tokens: bool,
    ) -> None:
        self.specs = {
            n: TenantSpec(n, weight=w, priority=b, max_in_flight=c, max_queue=q)
            for n, w, b, c, q in zip(NAMES, weights, bands, caps, queues, strict=True)
        }
        self.capacity = {A: capacities[0], B: capacities[1]}
        self.long_capacity = {A: 1, B: 1}
        self.tokens = tokens
        self.max_cost = 8.0 if tokens else 1.0
        self.state = AdmissionState(self.config())
        self.state.connect("node-a")
        self.state.connect("node-b")
        self.waiting: dict[Waiter, str] = {}
        self.held: dict[Lease, str] = {}
        self.offline: set[str] = set()
        self.retried: set[Lease] = set()
        self.windows: dict[tuple[str, str], Window] = {}
        self.waited: dict[str, int] = {}  # grants of its band since the tenant became backlogged
        # Peers seen waiting but held back (a long waiter, their cap) while the tenant waited: their
        # tags stayed where they were, so they may catch up past the bound (they banked no idle time).
        self.caught_up: dict[str, set[str]] = {}

    def config(self) -> PoolConfig:
        return PoolConfig(
            policy=QueuePolicy(max_queue=10_000, queue_timeout=1e9),
            providers={k: spec(self.capacity[k], self.long_capacity[k]) for k in (A, B)},
            models={name: ModelGroup(candidates=keys) for name, keys in MODELS.items()},
            tenants=tuple(self.specs.values()) if self.with_tenants else (),
        )

    # -- the model -------------------------------------------------------------

    def holding(self, name: str) -> int:
        return sum(1 for t in self.held.values() if t == name)

    def under_cap(self, name: str) -> bool:
        cap = self.specs[name].max_in_flight
        return cap is None or self.holding(name) < cap

    def room(self, key: ProviderKey, long: bool) -> bool:
        if key.node_id in self.offline:
            return False
        normal = sum(1 for lease in self.held if lease.provider == key)
        longs = sum(1 for lease in self.held if lease.provider == key and lease.long)
        return normal < self.capacity[key] and (not long or longs < self.long_capacity[key])

    def dispatchable(self, w: Waiter) -> bool:
        return any(self.room(key, w.long) for key in w.candidates)  # a queued retry: its untried ones

    def backlogged(self, name: str) -> bool:
        """Waiting, under its cap, no long waiter nor queued retry (either can be blocked while
        the others run): the tenants the bounds speak of."""
        queue = [w for w, t in self.waiting.items() if t == name]
        return bool(queue) and self.under_cap(name) and not any(w.long or w.attempt > 1 for w in queue)

    # -- rules -----------------------------------------------------------------

    @rule(
        name=st.sampled_from(NAMES),
        model=st.sampled_from(sorted(MODELS)),
        long=st.sampled_from([False, False, False, True]),  # a long waiter ends its tenant's backlog
        cost=st.integers(1, 8),
        count=st.integers(1, 8),
    )
    def arrive(self, name: str, model: str, long: bool, cost: int, count: int) -> None:
        for _ in range(count):
            self.open_windows()
            limit = self.specs[name].max_queue
            queued = sum(1 for t in self.waiting.values() if t == name)
            runs_now = self.under_cap(name) and any(self.room(key, long) for key in MODELS[model])
            if self.with_tenants and limit is not None and queued >= limit and not runs_now:
                with pytest.raises(TenantLimitExceeded, match="max_queue"):
                    self.state.request(model, long, 0.0, name, float(cost if self.tokens else 1))
                continue
            result = self.state.request(model, long, 0.0, name, float(cost if self.tokens else 1))
            assert self.state.drain_decisions() == []
            if isinstance(result, Lease):
                self.check_grant(name, result, None)
                self.held[result] = name
                self.account(name, result)
            else:
                self.waiting[result] = name

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 50), used=st.integers(1, 8))
    def finish(self, index: int, used: int) -> None:
        lease = list(self.held)[index % len(self.held)]
        if self.tokens:
            self.settle(lease, float(used))
        del self.held[lease]
        self.apply(self.state.release(lease))

    @precondition(lambda self: self.held)
    @rule(count=st.integers(2, 12), used=st.integers(1, 8))
    def run_for_a_while(self, count: int, used: int) -> None:
        """Finish the oldest leases one after the other: long windows of backlog."""
        for _ in range(count):
            if self.held:
                self.finish(0, used)

    @precondition(lambda self: self.waiting)
    @rule(index=st.integers(0, 50))
    def give_up(self, index: int) -> None:
        w = list(self.waiting)[index % len(self.waiting)]
        assert self.state.withdraw(w)
        del self.waiting[w]
        self.open_windows()

    @precondition(lambda self: self.held and self.with_retries)
    @rule(index=st.integers(0, 50))
    def retry(self, index: int) -> None:
        """A lease's run failed before its first byte: the request asks again on the other provider.

        The retry is an attempt of its own, with the request's reserve (its
        failed attempt is settled like any lease when it ends).
        """
        lease = list(self.held)[index % len(self.held)]
        if lease.attempt > 1 or lease in self.retried:
            return
        name = self.held[lease]
        reserve = lease.cost
        self.open_windows()
        result = self.state.retry(lease, 0.0)
        self.retried.add(lease)
        assert lease.cost == reserve
        if isinstance(result, Lease):
            assert result.cost == reserve
            self.open_windows()
            self.check_grant(name, result, None)
            self.held[result] = name
            self.account(name, result)
        else:
            assert result.cost == reserve and result.candidates == tuple(k for k in (A, B) if k != lease.provider)
            self.waiting[result] = name
        self.check_windows()

    @rule(node=st.sampled_from(["node-a", "node-b"]))
    def bounce(self, node: str) -> None:
        """The node drops and comes back: its leases are revoked (their tenants' slots freed)."""
        ok, decisions = self.state.disconnect(node, self.state.generation(node))
        assert ok
        self.offline.add(node)
        revoked = [d.lease for d in decisions if isinstance(d, Revoked)]
        for d in decisions:
            if isinstance(d, Revoked):
                del self.held[d.lease]
            elif isinstance(d, Failed):  # a queued retry whose untried candidate went offline
                assert isinstance(d.error, Unavailable) and d.waiter.attempt > 1
                del self.waiting[d.waiter]
            else:
                self.apply([d])
        for lease in revoked:  # [revoked-in-flight] the bodies leave: each holder's one release
            self.apply(self.state.release(lease))
        self.open_windows()
        self.offline.discard(node)
        _, decisions = self.state.connect(node)
        self.apply(decisions)

    @rule(name=st.sampled_from(NAMES), weight=st.integers(1, 3), cap=st.one_of(st.none(), st.integers(1, 3)))
    def reconfigure(self, name: str, weight: int, cap: int | None) -> None:
        old = self.specs[name]
        self.specs[name] = TenantSpec(name, weight, old.priority, cap, old.max_queue)
        self.windows.clear()  # the bounds are stated for fixed weights
        self.waited.clear()
        self.caught_up.clear()
        self.apply(self.state.refresh(self.config()))

    def settle(self, lease: Lease, used: float) -> None:
        """Settle ``lease``: the change moves its tenant's tag; the windows widen by as much."""
        name = self.held[lease]
        delta = used - lease.cost
        self.open_windows()
        self.state.settle(lease, used)
        for window in self.windows.values():
            if name in window.slack:  # it moves the tag, not the reserves granted
                window.slack[name] += abs(delta)
        self.check_windows()

    # -- grants and their checks ----------------------------------------------

    def apply(self, decisions: list[Decision]) -> None:
        for d in decisions:
            self.open_windows()
            assert isinstance(d, Granted), f"unexpected {d!r}"
            w, lease = d.waiter, d.lease
            name = self.waiting.pop(w)
            self.check_grant(name, lease, w)
            self.held[lease] = name
            self.account(name, lease)
        self.open_windows()

    def check_grant(self, name: str, lease: Lease, w: Waiter | None) -> None:
        assert self.room(lease.provider, lease.long), "capacity or long slots exceeded"
        if self.with_tenants:
            assert lease.tenant == name
        assert self.under_cap(name), f"max_in_flight of {name} exceeded"
        band = self.specs[name].priority
        for x, t in self.waiting.items():
            if not (self.under_cap(t) and self.dispatchable(x)):
                continue
            assert self.specs[t].priority <= band, f"dispatchable waiter of higher band {t} passed over"
            if t == name and w is not None:
                assert x.seq > w.seq, f"earlier dispatchable waiter of {name} passed over (FIFO)"
            if w is None:
                raise AssertionError(f"a newcomer of {name} overtook a dispatchable waiter of {t}")

    def open_windows(self) -> None:
        live = {n for n in NAMES if self.backlogged(n)}
        for key in list(self.windows):
            if not set(key) <= live:
                del self.windows[key]
        for n in list(self.waited):
            if n not in live:
                del self.waited[n]
                self.caught_up.pop(n, None)
        held_back = {n for n in NAMES if n not in live and any(t == n for t in self.waiting.values())}
        for i in live:
            self.waited.setdefault(i, 0)
            self.caught_up.setdefault(i, set()).update(held_back)
            for j in live:
                if i < j and self.specs[i].priority == self.specs[j].priority and (i, j) not in self.windows:
                    self.windows[(i, j)] = Window({i: 0.0, j: 0.0}, {i: 0.0, j: 0.0})

    def account(self, name: str, lease: Lease) -> None:
        for (i, j), window in self.windows.items():
            if name in (i, j):
                window.served[name] += lease.cost
        self.check_windows()
        if not self.tokens:
            self.check_starvation(name)

    def check_windows(self) -> None:
        """The fairness bound on the reserves granted, widened by the settlements made meanwhile."""
        for (i, j), window in self.windows.items():
            wi, wj = self.specs[i].weight, self.specs[j].weight
            served, slack = window.served, window.slack
            gap = abs(served[i] / wi - served[j] / wj)
            bound = self.max_cost / wi + self.max_cost / wj + slack[i] / wi + slack[j] / wj
            assert gap <= bound + 1e-9, f"fairness bound: {i},{j} differ by {gap} > {bound}"

    def check_starvation(self, name: str) -> None:
        band = self.specs[name].priority
        for other in list(self.waited):
            if other == name:
                del self.waited[other]
                self.caught_up.pop(other, None)
            elif self.specs[other].priority == band and name not in self.caught_up.get(other, ()):
                self.waited[other] += 1
                wo = self.specs[other].weight
                peers = [n for n in NAMES if n != other and self.specs[n].priority == band]
                limit = sum(math.floor(self.specs[n].weight / wo) + 1 for n in peers)
                assert self.waited[other] <= limit, f"starvation bound: {other} waited {self.waited[other]} > {limit}"

    @invariant()
    def no_head_of_line(self) -> None:
        if not hasattr(self, "state"):
            return
        for w, name in self.waiting.items():
            assert not (self.under_cap(name) and self.dispatchable(w)), f"{w!r} of {name} could run but waits"

    @invariant()
    def counters_exact(self) -> None:
        if not hasattr(self, "state"):
            return
        assert self.state.queue_depth == len(self.waiting)
        assert set(self.state.waiters()) == set(self.waiting)
        for row in self.state.provider_snapshots():
            key = ProviderKey(row.node_id, row.provider_id)
            assert row.in_flight == sum(1 for lease in self.held if lease.provider == key) <= row.capacity
            assert row.long_in_flight <= row.long_context_capacity
        if not self.with_tenants:
            return
        rows = {row.name: row for row in self.state.tenant_snapshots()}
        for n in NAMES:
            queued = sum(1 for t in self.waiting.values() if t == n)
            assert rows[n].waiting == queued and rows[n].in_flight == self.holding(n)
            limit = self.specs[n].max_queue
            first_tries = sum(1 for w, t in self.waiting.items() if t == n and w.attempt == 1)
            assert limit is None or first_tries <= limit  # retries are not refused; max_in_flight: at every grant


TenantMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestTenantMachine = TenantMachine.TestCase


def test_the_checks_fail_against_plain_fifo() -> None:
    """The same machine on the core without tenants (one global FIFO): the bounds fail."""

    class FifoMachine(TenantMachine):
        with_tenants = False

    machine = FifoMachine()
    machine.setup(
        weights=[1, 1, 1, 1],
        bands=[0, 0, 0, 0],
        caps=[None] * 4,
        queues=[None] * 4,
        capacities=(1, 1),
        tokens=False,
    )
    with pytest.raises(AssertionError, match=r"fairness bound|starvation bound"):
        machine.arrive("a", "m", False, 1, 3)
        machine.arrive("a", "m", False, 1, 3)
        machine.arrive("b", "m", False, 1, 3)
        for _ in range(8):
            machine.finish(0, 1)


def test_the_machine_passes_the_same_trace_with_tenants() -> None:
    """The control's trace, with tenants: every check holds (the control fails for FIFO, not for the trace)."""
    machine = TenantMachine()
    machine.setup(
        weights=[1, 1, 1, 1],
        bands=[0, 0, 0, 0],
        caps=[None] * 4,
        queues=[None] * 4,
        capacities=(1, 1),
        tokens=False,
    )
    machine.arrive("a", "m", False, 1, 3)
    machine.arrive("a", "m", False, 1, 3)
    machine.arrive("b", "m", False, 1, 3)
    for _ in range(8):
        machine.finish(0, 1)
    machine.no_head_of_line()
    machine.counters_exact()
    assert not machine.waiting and len(machine.held) == 1
