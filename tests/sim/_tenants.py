"""The seeded simulation with tenants (issue 28): the one-Edge world, its Edge shared by 2-4 tenants.

:class:`TenantWorld` is :class:`~tests.sim._world.World` with ``tenants:`` in the
Edge's config (weights, sometimes one negative band, ``max_queue`` for every
tenant, sometimes ``max_in_flight``, each tenant's API key), written as the
operator's file and read by :func:`iop_edge.config.load_edge_config` (the key
map is resolved there). Every client sends its tenant's key. One scenario per
seed, with every fault of the one-Edge world and ``tenant_reload`` (a reload
changing a tenant's weight and quotas):

- ``flood``: one tenant floods (many clients at once, in bursts) while the
  others trickle;
- ``idle_return``: a tenant busy at first goes quiet, then returns while
  another floods: it must not bank credit for its idle time;
- ``token_skew``: ``tenant_cost: tokens``, one tenant's prompts and
  ``max_tokens`` ten times another's; the backend reports usage
  (:class:`UsageBackend`), the Edge settles with it.

Checks, on top of the one-Edge world's invariants, observed on the core's
:class:`~iop_admission.FairShare` (:class:`FairWatch` wraps its methods on the
instance to see each grant as it is made, and writes nothing):

- per-tenant in flight <= ``max_in_flight`` at every grant and every step, queued
  first attempts <= ``max_queue`` (a reload that lowered a quota lets the
  waiters already queued stay);
- a tenant's 429s only for its own limits: ``tenant_max_queue`` only when its
  own queue is at its ``max_queue``, ``tenant_shed`` only to a negative band (a
  waiter evicted from a full queue only of the lowest negative band below the
  newcomer's), and no ``queue_full`` for anyone while the tenants' quotas fit
  the queue (no tenant is refused because another floods);
- no dispatchable waiter of a higher band passed over by a grant;
- the fairness bound of docs/admission.md: two tenants of a band backlogged
  over an interval differ in served ``cost / weight`` by at most
  ``c / w_i + c / w_j`` (token cost: the reserves granted, widened by the
  settlements made meanwhile, as tests/admission/test_tenant_machine.py states
  it); the starvation bound (request cost): a backlogged tenant is granted
  within ``sum(floor(w_j / w_i) + 1)`` grants of its band (not counting a
  peer seen held back meanwhile, whose tag stayed behind);
- at the end: every tenant's waiting and in flight 0, every ticket granted
  released, the core's charged cost equal to the sum of the watch's own
  ledger of grants and settlements; in token mode, a tenant all of whose
  requests ended ``ok`` was charged exactly the tokens the backend reported.
"""

from __future__ import annotations

import json
import math
import pathlib
import random
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Any

import attrs
import cattrs
import trio
import trio.testing

from iop_admission import TenantLimitExceeded
from iop_edge.config import EdgeConfig, load_edge_config

from ._report import Summary
from ._world import (
    EXPECTED_ERRORS,
    LOAD_WINDOW,
    LONG_THRESHOLD,
    MAX_QUEUE,
    SITES,
    Outcome,
    Overrides,
    RequestPlan,
    SeedResult,
    SimBackend,
    World,
    edge_config,
    run_seed,
)

TENANT_SITES = (*SITES, "tenant_reload")
SCENARIOS = ("flood", "idle_return", "token_skew")
MODEL = "ornith:35b"
"""Every tenant request asks this model: the tenants compete for the same providers, as the bounds assume."""
QUEUE_SCALE = 3
"""The tenant world's ``provider_pool.max_queue`` is the one-Edge world's times this (the refresh faults' too):
room for every tenant's part."""
QUOTA_ROOM = 4
"""Queue places the tenants' ``max_queue`` leave free below ``provider_pool.max_queue`` (queued retries)."""
TENANT_ERRORS = frozenset({"429:tenant_max_queue", "429:tenant_shed"})
REPORTED = (
    "tenant grants",
    "fairness windows",
    "grants outside the fair order",
    "tenant 429s",
    "waiters shed",
    "settlements",
    "tenants settled exactly",
)


@attrs.frozen
class Tenant:
    """One configured tenant of a seed."""

    name: str
    weight: int
    priority: int
    max_queue: int | None
    max_in_flight: int | None

    @property
    def key(self) -> str:
        return f"sim-key-{self.name}"

    def entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"name": self.name, "weight": self.weight, "priority": self.priority}
        entry["api_keys"] = [self.key]
        if self.max_queue is not None:
            entry["max_queue"] = self.max_queue
        if self.max_in_flight is not None:
            entry["max_in_flight"] = self.max_in_flight
        return entry


@attrs.frozen
class TenantPlan(RequestPlan):
    """A request of a tenant: its prompt size and, in token mode, the usage the backend reports."""

    tenant: str = "default"
    prompt_chars: int = 40
    used: int = 0

    def body(self) -> bytes:
        body = json.loads(super().body())
        body["messages"][0]["content"] = "x" * self.prompt_chars
        body["sim"] |= {"used": self.used}
        return json.dumps(body).encode()


@attrs.define(eq=False)
class UsageBackend(SimBackend):
    """:class:`SimBackend` whose answer's last event carries ``usage.total_tokens`` (the request's ``sim.used``)."""

    async def run(self, endpoint: str, body: dict[str, Any], *, stream: bool) -> AsyncIterator[dict[str, Any]]:
        used = int((body.get("sim") or {}).get("used", 0))
        held: dict[str, Any] | None = None
        async for event in super().run(endpoint, body, stream=stream):
            if held is not None:
                yield held
            held = event
        if held is not None:
            if used:
                held = held | {"usage": {"prompt_tokens": 0, "completion_tokens": used, "total_tokens": used}}
            yield held


@attrs.define(eq=False)
class Window:
    """Two tenants of one band backlogged since it opened: reserves granted, settlements made."""

    served: dict[str, float]
    slack: dict[str, float]


class FairWatch:
    """Sees every grant, enqueue, cancel, settlement and release of one FairShare, and checks the bounds.

    It wraps the instance's methods (the originals run unchanged), the way
    :meth:`World._wrap_reports` wraps the Edge's reports.
    """

    def __init__(self, world: TenantWorld, fair: Any) -> None:
        self.world = world
        self.fair = fair
        self.max_cost = 1.0
        self.windows: dict[tuple[str, str], Window] = {}
        self.waited: dict[str, int] = {}
        self.caught_up: dict[str, set[str]] = {}
        self.granted: list[Any] = []
        self.charged: Counter[str] = Counter()  # the watch's own ledger: reserves granted + settlement deltas
        self.runnable: dict[str, int] = {}  # before a grant: the tenants with a waiter that could run, and their bands
        grant, admit, enqueue, cancel = fair.grant, fair.admit, fair.enqueue, fair.cancel
        settle, release, configure = fair.settle, fair.release, fair.configure
        check_queue, shed_victim = fair.check_queue, fair.shed_victim

        def watched_check_queue(tenant: str) -> None:
            try:
                check_queue(tenant)
            except TenantLimitExceeded as exc:
                self.refused(tenant, exc)
                raise

        def watched_shed_victim(priority: int) -> Any:
            victim = shed_victim(priority)
            self.shed(victim, priority)
            return victim

        def watched_grant(dispatchable: Callable[[Hashable], bool] = lambda item: True) -> Any:
            self.before_grant(dispatchable)
            ticket = grant(dispatchable)
            if ticket is not None:
                self.granted_one(ticket)
            return ticket

        def watched_admit(tenant: str, item: Hashable, cost: float = 1.0, seq: int = 0) -> Any:
            self.before_grant(lambda item: False)  # granted at once: nobody queued could use the slot
            ticket = admit(tenant, item, cost, seq)
            if self.overtook(ticket):
                self.restart()
            self.granted_one(ticket)
            return ticket

        def watched_enqueue(tenant: str, item: Hashable, *args: Any, **kwargs: Any) -> Any:
            try:
                ticket, shed = enqueue(tenant, item, *args, **kwargs)
            except TenantLimitExceeded as exc:
                self.refused(tenant, exc)
                raise
            for victim in shed:
                self.shed(victim, self.fair.spec(self.fair.tenant_of(tenant)).priority)
            self.open_windows()
            return ticket, shed

        def watched_cancel(ticket: Any) -> None:
            cancel(ticket)
            self.open_windows()

        def watched_settle(ticket: Any, actual: float) -> None:
            delta = actual - ticket.charged
            self.open_windows()
            settle(ticket, actual)
            self.charged[ticket.tenant] += delta
            self.world.result.fired["settlements"] += 1
            for window in self.windows.values():
                if ticket.tenant in window.slack:
                    window.slack[ticket.tenant] += abs(delta)
            self.check_windows()

        def watched_release(ticket: Any) -> None:
            release(ticket)
            self.open_windows()

        def watched_configure(tenants: Any) -> None:
            configure(tenants)
            self.windows.clear()  # the bounds are stated for fixed weights
            self.waited.clear()
            self.caught_up.clear()
            self.open_windows()

        fair.grant, fair.admit, fair.enqueue, fair.cancel = (
            watched_grant,
            watched_admit,
            watched_enqueue,
            watched_cancel,
        )
        fair.settle, fair.release, fair.configure = watched_settle, watched_release, watched_configure
        fair.check_queue, fair.shed_victim = watched_check_queue, watched_shed_victim

    # -- who is backlogged ------------------------------------------------------

    def names(self) -> list[str]:
        return list(self.fair.tenants())

    def under_cap(self, name: str) -> bool:
        cap = self.fair.spec(name).max_in_flight
        return cap is None or self.fair.in_flight(name) < cap

    def backlogged(self, name: str) -> bool:
        """Waiting, under its cap, no long waiter nor queued retry (either can be blocked while others run)."""
        queue = self.fair.queued(name)
        return bool(queue) and self.under_cap(name) and not any(t.item.long or t.item.attempt > 1 for t in queue)

    def open_windows(self) -> None:
        live = {n for n in self.names() if self.backlogged(n)}
        for key in list(self.windows):
            if not set(key) <= live:
                del self.windows[key]
        for n in list(self.waited):
            if n not in live:
                del self.waited[n]
                self.caught_up.pop(n, None)
        held_back = {n for n in self.names() if n not in live and self.fair.waiting(n)}
        for i in live:
            self.waited.setdefault(i, 0)
            self.caught_up.setdefault(i, set()).update(held_back)
            for j in live:
                same_band = self.fair.spec(i).priority == self.fair.spec(j).priority
                if i < j and same_band and (i, j) not in self.windows:
                    self.windows[(i, j)] = Window({i: 0.0, j: 0.0}, {i: 0.0, j: 0.0})

    # -- grants -------------------------------------------------------------------

    def before_grant(self, dispatchable: Callable[[Hashable], bool]) -> None:
        """Note who could run now: the band rule is checked against it once the grant is known."""
        self.open_windows()
        self.runnable = {
            n: self.fair.spec(n).priority
            for n in self.names()
            if self.under_cap(n) and any(dispatchable(t.item) for t in self.fair.queued(n))
        }

    def granted_one(self, ticket: Any) -> None:
        world, name = self.world, ticket.tenant
        spec = self.fair.spec(name)
        world.result.fired["tenant grants"] += 1
        self.granted.append(ticket)
        self.charged[name] += ticket.cost
        if spec.max_in_flight is not None and self.fair.in_flight(name) > spec.max_in_flight:
            world.violation(f"tenant {name}: granted at {self.fair.in_flight(name)} in flight > {spec.max_in_flight}")
        higher = {n: band for n, band in self.runnable.items() if band > spec.priority}
        if higher:
            world.violation(f"tenant {name} (band {spec.priority}) granted over dispatchable higher bands {higher}")
        for (i, j), window in self.windows.items():
            if name in (i, j):
                window.served[name] += ticket.cost
        world.result.fired["fairness windows"] += sum(1 for key in self.windows if name in key)
        self.check_windows()
        if not world.tokens:
            self.check_starvation(name, spec.priority)
        self.open_windows()

    def restart(self) -> None:
        """A grant outside FairShare's order: the bounds are measured afresh from here."""
        self.world.result.fired["grants outside the fair order"] += 1
        self.windows.clear()
        self.waited.clear()
        self.caught_up.clear()

    def overtook(self, ticket: Any) -> bool:
        """A lease granted at once (its provider already counted): no queued waiter of a tenant under
        its cap, of its band or a higher one, could have run on that provider instead. Whether the
        grant was outside FairShare's order: a retry's attempt in panic mode (every untried candidate
        ejected, so it runs on one the queued waiters, with an admitting candidate, do not use) or a probe."""
        core = self.world.service.admission._core
        lease = next((lease for lease in core.live_leases() if lease.id == ticket.item), None)
        if lease is None:
            self.world.violation(f"tenant ticket {ticket.tenant} granted at once for lease {ticket.item}, not live")
            return False
        p = lease._slot
        if lease.probe or not p.admitting:
            return True
        band = self.fair.spec(ticket.tenant).priority
        for name in self.names():
            if name == ticket.tenant or self.fair.spec(name).priority < band or not self.under_cap(name):
                continue
            for t in self.fair.queued(name):
                w = t.item
                if p in w._candidates and p.admitting and (not w.long or p.long_in_flight <= p.long_capacity):
                    self.world.violation(
                        f"tenant {ticket.tenant}: attempt {lease.attempt} granted at once on {p.key} over {w!r} of {name}"
                    )
                    return False
        return False

    def check_windows(self) -> None:
        """The fairness bound on the reserves granted, widened by the settlements made meanwhile."""
        for (i, j), window in self.windows.items():
            wi, wj = self.fair.spec(i).weight, self.fair.spec(j).weight
            served, slack = window.served, window.slack
            gap = abs(served[i] / wi - served[j] / wj)
            bound = self.max_cost / wi + self.max_cost / wj + slack[i] / wi + slack[j] / wj
            if gap > bound + 1e-9:
                self.world.violation(
                    f"fairness bound: tenants {i},{j} served {served} differ by {gap:.3f} > {bound:.3f}"
                )
                window.served = {i: 0.0, j: 0.0}  # report it once, then measure afresh

    def check_starvation(self, name: str, band: int) -> None:
        for other in list(self.waited):
            if other == name:
                del self.waited[other]
                self.caught_up.pop(other, None)
            elif self.fair.spec(other).priority == band and name not in self.caught_up.get(other, ()):
                self.waited[other] += 1
                wo = self.fair.spec(other).weight
                peers = [n for n in self.names() if n != other and self.fair.spec(n).priority == band]
                limit = sum(math.floor(self.fair.spec(n).weight / wo) + 1 for n in peers)
                if self.waited[other] > limit:
                    self.world.violation(
                        f"starvation bound: tenant {other} waited {self.waited[other]} > {limit} grants"
                    )
                    self.waited[other] = 0

    # -- refusals -------------------------------------------------------------------

    def refused(self, tenant: str, exc: TenantLimitExceeded) -> None:
        """A tenant's refusal names its own limit, reached."""
        name = self.fair.tenant_of(tenant)
        spec = self.fair.spec(name)
        if exc.tenant != name:
            self.world.violation(f"a request of {name} refused for tenant {exc.tenant}'s {exc.limit}")
        elif exc.limit == "max_queue" and (spec.max_queue is None or self.fair.waiting(name) < spec.max_queue):
            self.world.violation(f"tenant {name} refused max_queue with {self.fair.waiting(name)} waiting")
        elif exc.limit == "shed" and spec.priority >= 0:
            self.world.violation(f"tenant {name} of band {spec.priority} refused as sheddable")

    def shed(self, victim: Any, priority: int) -> None:
        """The queue is full and a newcomer of band ``priority`` came: the waiter chosen to make room
        (``victim``) is of the lowest negative band below it, else none waits there."""
        lowest = min(priority, 0)
        below = [n for n in self.names() if self.fair.waiting(n) and self.fair.spec(n).priority < lowest]
        if victim is None:
            if below:
                self.world.violation(
                    f"a full queue refused band {priority} while {below} of a lower negative band wait"
                )
            return
        band = self.fair.spec(victim.tenant).priority
        self.world.result.fired["waiters shed"] += 1
        if band >= lowest or any(self.fair.spec(n).priority < band for n in below):
            self.world.violation(f"a waiter of tenant {victim.tenant} (band {band}) shed for band {priority}")


class TenantWorld(World):
    """The one-Edge world with tenants; see the module docstring."""

    sites = TENANT_SITES
    expected_errors = EXPECTED_ERRORS | TENANT_ERRORS
    backend = UsageBackend

    def __init__(self, seed: int, clock: trio.testing.MockClock) -> None:
        trng = random.Random(f"sim:{seed}:tenants")
        self.scenario = SCENARIOS[seed % len(SCENARIOS)]
        self.tokens = self.scenario == "token_skew"
        count = trng.randint(2, 4)
        quotas = [trng.randint(2, 7) for _ in range(count)]
        while sum(quotas) > MAX_QUEUE * QUEUE_SCALE - QUOTA_ROOM:
            quotas[quotas.index(max(quotas))] -= 1
        negative = count > 2 and trng.random() < 0.4
        self.tenants = {
            f"t{i}": Tenant(
                f"t{i}",
                weight=trng.randint(1, 3),
                priority=-1 if negative and i == count - 1 else 0,
                max_queue=None if negative and i == count - 1 else quotas[i],  # sheddable: it may fill the queue
                max_in_flight=trng.choice((None, None, 1, 2)),
            )
            for i in range(count)
        }
        self.trng = trng
        self.squeezed = False
        """A refresh set ``provider_pool.max_queue`` below the tenants' quotas: ``queue_full`` may then happen."""
        self.lowered: dict[str, tuple[int, int]] = {}
        """Per tenant, the waiting and in-flight counts a reload that lowered its quotas left over them."""
        super().__init__(seed, clock)
        self.watch = FairWatch(self, self.service.admission._core._tenants.tenancy.fair)
        self.result.trace.append(f"0 tenants {self.scenario}: {sorted(self.tenants.values(), key=str)}")

    # -- the config -----------------------------------------------------------------

    def edge_config(self, overrides: Overrides) -> EdgeConfig:
        """The one-Edge world's config with ``tenants:``, as a file the Edge's loader reads (it resolves the keys)."""
        overrides = attrs.evolve(overrides, max_queue=overrides.max_queue * QUEUE_SCALE)
        if overrides.max_queue < self.quotas() + QUOTA_ROOM:
            self.squeezed = True
        fields = cattrs.Converter().unstructure(edge_config(overrides))
        keys = ("nodes", "models", "heartbeat_timeout_ms", "provider_pool", "node_max_pending")
        document = {key: fields[key] for key in (*keys, "node_max_pending_per_address")}
        document["tenants"] = [t.entry() for t in self.tenants.values()]
        document["tenant_cost"] = "tokens" if self.tokens else "requests"
        with tempfile.TemporaryDirectory(prefix="iop-sim-tenants-") as folder:
            path = pathlib.Path(folder) / "edge.yaml"
            path.write_text(json.dumps(_without_nulls(document)), encoding="utf-8")  # JSON is YAML
            return load_edge_config(path)

    def quotas(self, but: str = "") -> int:
        """The queue places the non-negative tenants (but ``but``) may fill: their ``max_queue``."""
        return sum(t.max_queue or 0 for n, t in self.tenants.items() if n != but and t.priority >= 0)

    def request_headers(self, plan: RequestPlan) -> list[tuple[bytes, bytes]]:
        assert isinstance(plan, TenantPlan)
        return [(b"authorization", f"Bearer {self.tenants[plan.tenant].key}".encode())]

    # -- the workload -----------------------------------------------------------------

    def plan_requests(self) -> list[RequestPlan]:
        """The scenario's arrivals (seeded), each with the request fault sites of the one-Edge world."""
        rng = self.rng
        names = list(self.tenants)
        arrivals: list[tuple[float, str]] = []
        for name in names[1:]:  # the others trickle
            t = rng.uniform(0.0, 1.0)
            while t < LOAD_WINDOW:
                quiet = self.scenario == "idle_return" and name == "t1" and 2.5 <= t < 5.5
                if not quiet:
                    arrivals.append((t, name))
                t += rng.expovariate(1.6)
            if self.scenario == "idle_return" and name == "t1":  # it returns in a burst
                back = rng.uniform(5.5, 6.5)
                arrivals += [(back + k * 0.01, name) for k in range(rng.randint(3, 6))]
        for _ in range(rng.randint(2, 4)):  # t0 floods: bursts of many clients at once
            at = rng.uniform(0.0, LOAD_WINDOW - 1.0)
            arrivals += [(at + k * 0.002, "t0") for k in range(rng.randint(6, 14))]
        for name in (n for n, t in self.tenants.items() if t.priority < 0):  # a sheddable tenant floods too
            for _ in range(rng.randint(1, 3)):
                at = rng.uniform(0.0, LOAD_WINDOW - 1.0)
                arrivals += [(at + k * 0.003, name) for k in range(rng.randint(10, 30))]
        plans: list[RequestPlan] = []
        for number, (at, name) in enumerate(sorted(arrivals), start=1):
            big = self.tokens and name == "t0"
            long = not self.tokens and rng.random() < 0.08
            max_tokens = rng.randint(30, 60) if big else rng.randint(1, 8)
            prompt_chars = LONG_THRESHOLD * 4 + 40 if long else rng.randint(600, 700) if big else 40
            plan: RequestPlan = TenantPlan(
                number=number,
                at=at + number * 1e-6,  # arrival times stay distinct
                model=MODEL,
                long=long,
                stream=rng.random() < 0.6,
                max_tokens=max_tokens,
                latency=rng.uniform(0.05, 0.6),
                tokens_per_second=rng.choice((0.0, rng.uniform(40, 120))),
                tenant=name,
                prompt_chars=prompt_chars,
                used=rng.randint(1, prompt_chars // 4 + max_tokens) if self.tokens else 0,
            )
            plans.append(self.request_faults(plan))
        if self.tokens:  # the largest reserve of one request: the bounds' c
            self.watch.max_cost = max(p.prompt_chars // 4 + p.max_tokens for p in plans if isinstance(p, TenantPlan))
        return plans

    # -- faults -------------------------------------------------------------------------

    async def fault_tenant_reload(self) -> None:
        """A reload that changes one tenant's weight and quotas (its band and key stay)."""
        name = self.frng.choice(sorted(self.tenants))
        old = self.tenants[name]
        room = MAX_QUEUE * QUEUE_SCALE - QUOTA_ROOM - self.quotas(but=name)
        quota = max(1, min(room, self.frng.randint(2, 7)))
        new = attrs.evolve(
            old,
            weight=self.frng.randint(1, 3),
            max_queue=None if old.priority < 0 else quota,
            max_in_flight=self.frng.choice((None, 1, 2)),
        )
        self.tenants[name] = new
        fair = self.watch.fair
        self.lowered[name] = (fair.waiting(name), fair.in_flight(name))
        self.apply(self.overrides, "tenant_reload")
        self.fired("tenant_reload", f"{name}: {old} -> {new}")
        await trio.lowlevel.checkpoint()

    # -- checks ---------------------------------------------------------------------------

    def check(self) -> None:
        super().check()
        fair = self.watch.fair
        live = Counter(lease.tenant for lease in self.service.admission._core.live_leases())
        for row in self.service.admission.snapshot(count=0).tenants:
            name = row.name
            waiting, in_flight = self.lowered.get(name, (0, 0))
            waiting, in_flight = min(waiting, row.waiting), min(in_flight, row.in_flight)
            self.lowered[name] = (waiting, in_flight)
            firsts = sum(1 for t in fair.queued(name) if t.item.attempt == 1)
            if row.max_queue is not None and firsts > max(row.max_queue, waiting):
                self.violation(f"tenant {name}: {firsts} queued > max_queue {row.max_queue}")
            if row.max_in_flight is not None and row.in_flight > max(row.max_in_flight, in_flight):
                self.violation(f"tenant {name}: {row.in_flight} in flight > max_in_flight {row.max_in_flight}")
            if row.in_flight != live[name]:
                self.violation(f"tenant {name}: in flight {row.in_flight} != its live leases {live[name]}")

    def final_check(self) -> None:
        super().final_check()
        fair, watch = self.watch.fair, self.watch
        for row in self.service.admission.snapshot(count=0).tenants:
            if row.waiting or row.in_flight:
                self.violation(f"tenant {row.name}: {row.waiting} waiting, {row.in_flight} in flight at the end")
            if not math.isclose(row.cost_charged, watch.charged[row.name], abs_tol=1e-6):
                self.violation(
                    f"tenant {row.name}: charged {row.cost_charged} != granted and settled {watch.charged[row.name]}"
                )
        if leaked := [t for t in watch.granted if not t.done]:
            self.violation(f"{len(leaked)} tenant tickets granted but never released: {leaked[:3]}")
        if self.tokens:
            self.check_tokens(fair)

    def check_tokens(self, fair: Any) -> None:
        """A tenant each of whose requests either ended ``ok`` in one attempt (charged the usage the
        backend reported) or never reached a backend (charged nothing) is charged exactly that."""
        used: Counter[str] = Counter()
        clean = set(self.tenants)
        for plan in self.plans:
            assert isinstance(plan, TenantPlan)
            out = self.outcomes.get(plan.number)
            if out is not None and out.result == "ok" and out.headers.get(b"x-iop-attempts", b"1") == b"1":
                used[plan.tenant] += plan.used
            elif out is None or self.run_starts.get(plan.number) or out.status not in (None, 429, 503):
                clean.discard(plan.tenant)
        for name in sorted(clean):
            if fair.served(name) != used[name]:
                self.violation(f"tenant {name}: {fair.served(name)} tokens charged != {used[name]} used")
            self.result.fired["tenants settled exactly"] += 1

    def _classify(self, plan: RequestPlan, out: Outcome) -> str:
        """The one-Edge world's classification, then: a 429 names a limit of the request's own tenant."""
        result = super()._classify(plan, out)
        assert isinstance(plan, TenantPlan)
        tenant = self.tenants[plan.tenant]
        if result.startswith("429:"):
            self.result.fired["tenant 429s"] += 1
        if result == "429:tenant_shed" and tenant.priority >= 0:
            self.violation(f"request {plan.number} of {plan.tenant} (band {tenant.priority}): tenant_shed")
        if result == "429:queue_full" and tenant.priority >= 0 and not self.squeezed:
            self.violation(
                f"request {plan.number} of {plan.tenant}: queue_full while the tenants' quotas fit the queue"
            )
        return result


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def run_tenant_seed(seed: int) -> SeedResult:
    """One seed of the tenant world (:func:`tests.sim._world.run_seed` with :class:`TenantWorld`)."""
    return run_seed(seed, TenantWorld)


def tenant_summary() -> Summary:
    """A :class:`~tests.sim._report.Summary` with the tenant world's sites and counters."""
    return Summary(sites=TENANT_SITES, extra=REPORTED)


__all__ = ["TENANT_SITES", "TenantWorld", "run_tenant_seed", "tenant_summary"]
