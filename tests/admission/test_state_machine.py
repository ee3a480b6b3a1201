"""Stateful Hypothesis test of the sans-I/O admission core.

The real :class:`AdmissionState` is driven side by side with a small reference
model that knows only what the requirements say: which leases are live, which
waiters are queued (in arrival order), which nodes are connected, which config
is in force, and each provider's health (consecutive failures, ejection end,
probe). After every step the invariants of docs/admission.md are checked against it.

Profiles: ``ci`` (``make test``) runs 500 examples x 50 steps; ``soak``
(``HYPOTHESIS_PROFILE=soak``) runs 5,000 x 150.
"""

from __future__ import annotations

import bisect
import collections
import functools
import math
import os
from collections.abc import Callable
from typing import Any

import attrs
import pytest
from hypothesis import event, settings, target
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from tests.admission.state_coverage import Coverage

from iop_admission import (
    ConfigError,
    ModelGroup,
    ModelNotFound,
    OutlierPolicy,
    PoolConfig,
    PreparedRefresh,
    ProviderKey,
    ProviderSpec,
    QueueFull,
    QueuePolicy,
    QueueTimeout,
    RetriesExhausted,
    RetryPolicy,
    Unavailable,
)
from iop_admission.core import AdmissionState, Ejected, Failed, Granted, Lease, Restored, Revoked, Waiter, WaiterState

NODES = ("n1", "n2")
KEYS = (ProviderKey("n1", "p0"), ProviderKey("n1", "p1"), ProviderKey("n2", "p0"))
MODELS = ("ornith:35b", "ornith-fast", "m2", "m3")

_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
_FIGURES: collections.Counter[str] = collections.Counter()  # what the runs exercised, printed at the end
_EXAMPLES, _STEPS = {"soak": (5_000, 150), "dev": (50, 30), "mutate": (100, 40)}.get(_PROFILE, (500, 50))

# The interactions the docs promise ([held-elsewhere], [queue-ownership]) and the floor each must
# reach in a ci run of this machine
# (the health interactions: test_health_machine.py); docs/reliability.md states the counts.
COVERAGE = Coverage("core", {"simultaneous timeouts": 20, "held runs across a remove and re-add": 20})


def counted(step: Callable[..., None]) -> Callable[..., None]:
    """Count each time Hypothesis picks ``step`` as a step (``rule <name>`` in the figures), not
    the calls other rules make to it."""

    @functools.wraps(step)
    def run(self: AdmissionMachine, *args: Any, **kwargs: Any) -> None:
        if not self.in_step:
            self.figures[f"rule {step.__name__}"] += 1
        outer, self.in_step = self.in_step, True
        try:
            step(self, *args, **kwargs)
        finally:
            self.in_step = outer

    return run


@st.composite
def provider_specs(draw: st.DrawFn) -> ProviderSpec:
    capacity = draw(st.integers(1, 3))
    long_cap = draw(st.integers(0, capacity))
    return ProviderSpec(
        capacity=capacity,
        long_context_capacity=long_cap,
        context_window_tokens=1024,
        total_context_tokens=1024 * long_cap,
        priority=draw(st.integers(0, 2)),
        enabled=draw(st.sampled_from((True, True, True, False))),
    )


@st.composite
def pool_configs(draw: st.DrawFn) -> PoolConfig:
    keys = draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True))
    providers = {k: draw(provider_specs()) for k in sorted(keys)}
    names = draw(st.lists(st.sampled_from(MODELS), min_size=1, max_size=4, unique=True))
    # The two model keys of [cross-model-tests] share a provider whenever both exist.
    models = {}
    for name in names:
        cands = draw(st.lists(st.sampled_from(sorted(keys)), min_size=1, max_size=3, unique=True))
        models[name] = ModelGroup(candidates=tuple(cands))
    if "ornith:35b" in models and "ornith-fast" in models:
        shared = models["ornith:35b"].candidates[0]
        if shared not in models["ornith-fast"].candidates:
            models["ornith-fast"] = ModelGroup(candidates=(shared, *models["ornith-fast"].candidates))
    policy = QueuePolicy(max_queue=draw(st.sampled_from((0, 2, 6, 6, 6))), queue_timeout=draw(st.integers(1, 10)))
    return PoolConfig(
        policy=policy, providers=providers, models=models, retry=draw(retry_policies()), outlier=draw(outliers())
    )


def retry_policies() -> st.SearchStrategy[RetryPolicy]:
    return st.builds(RetryPolicy, max_attempts=st.sampled_from((1, 2, 2, 3)))


@st.composite
def outliers(draw: st.DrawFn) -> OutlierPolicy:
    base = draw(st.sampled_from((1.0, 2.0)))
    return OutlierPolicy(
        consecutive_failures=draw(st.sampled_from((0, 1, 2, 2))),
        base_ejection=base,
        max_ejection=draw(st.sampled_from((base, 4 * base))),
    )


HEALTHY, EJECTED, PROBE, PROBING = "healthy", "ejected", "probe", "probing"


@attrs.define
class RefHealth:
    """The reference's view of one provider's passive health."""

    state: str = HEALTHY
    failures: int = 0
    streak: int = 0
    until: float = 0.0
    epoch: int = 0  # bumped on ejection, restore and removal from the config
    probe: int | None = None  # lease id of the running probe


class AdmissionMachine(RuleBasedStateMachine):
    """Reference model + invariants for [provider-state] [lease-lifecycle] [long-state]
    [cross-group-wakeup] [queue-ownership] [snapshot-source] [refresh-consistency]
    [disconnect-exclusion] [disconnect-queue-resolution] [offline-snapshot] [candidate-choice-scale]."""

    def __init__(self) -> None:
        super().__init__()
        self.core: AdmissionState
        self.config: PoolConfig
        self.now = 0.0
        self.connected: dict[str, bool] = dict.fromkeys(NODES, False)
        self.generation: dict[str, int] = dict.fromkeys(NODES, 0)
        self.held: list[Lease] = []  # leases whose holder has not released yet
        # [held-elsewhere] runs held elsewhere, per provider: (all of them, the long ones)
        self.elsewhere: dict[ProviderKey, tuple[int, int]] = {}
        self.queued: list[Waiter] = []  # arrival order
        self.release_count: dict[int, int] = {}  # lease id -> releases (ledger)
        self.fenced: set[int] = set()
        self.step_grants: list[tuple[float, Lease]] = []  # (arrival number, lease)
        self.last_seq = 0
        self.lease_ids: set[int] = set()
        self.kept = 0  # waiters kept over max_queue by a refresh that lowered it
        self.pending: PreparedRefresh | None = None  # a refresh prepared, not applied yet
        self.health: dict[ProviderKey, RefHealth] = {k: RefHealth() for k in KEYS}
        self.lease_epoch: dict[int, int] = {}  # lease id -> its provider's epoch at the grant
        self.reported: set[int] = set()
        self.ended: list[Lease] = []  # released leases, for stale reports
        self.probes: dict[ProviderKey, int] = dict.fromkeys(KEYS, 0)  # probes per ejection period
        self.panic_grants: set[int] = set()  # ids of leases granted on a non-admitting provider (panic mode)
        self.figures = _FIGURES
        self.in_step = False  # a rule is running (its calls to other rules are not steps)
        self.via = "waiter"  # what the decisions being applied come from: a refresh, else a waiter's grant
        self.reached = 0  # named interactions this example reached (Hypothesis targets more of them)
        self.held_at_removal: set[ProviderKey] = set()  # left the config with runs held elsewhere and a lease

    # ------------------------------------------------------------- reference

    def eligible(self, key: ProviderKey) -> bool:
        spec = self.config.providers.get(key)
        return bool(spec and spec.enabled and self.connected[key.node_id])

    def live(self, key: ProviderKey, long: bool | None = None, revoked: bool = False) -> int:
        """Live leases on ``key`` (of one kind), plus its runs held elsewhere when counting all or long ones;
        ``revoked``: the revoked leases whose holder has not released yet (their bodies still run) too."""
        runs, long_runs = self.elsewhere.get(key, (0, 0))
        elsewhere = runs if long is None else long_runs if long else 0
        return elsewhere + sum(
            1
            for lease in self.held
            if lease.provider == key and (revoked or not lease.revoked) and (long is None or lease.long == long)
        )

    def running(self, key: ProviderKey, long: bool | None = None) -> int:
        """[revoked-in-flight] bodies running on ``key``: live leases, revoked ones not released, runs held elsewhere."""
        return self.live(key, long, revoked=True)

    def admitting(self, key: ProviderKey) -> bool:
        return self.health[key].state in (HEALTHY, PROBE)

    def panic(self, candidates: tuple[ProviderKey, ...], long: bool) -> bool:
        """[outlier-ejection] every candidate that could run the request is ejected or probing."""
        able = [k for k in candidates if self.could_ever_run(k, long)]
        return bool(able) and not any(self.admitting(k) for k in able)

    def dispatchable(self, key: ProviderKey, long: bool, candidates: tuple[ProviderKey, ...] | None = None) -> bool:
        if not self.eligible(key):
            return False
        spec = self.config.providers[key]
        if self.running(key) >= spec.capacity:
            return False
        if long and self.running(key, True) >= spec.long_context_capacity:
            return False
        return self.admitting(key) or (candidates is not None and self.panic(candidates, long))

    def could_ever_run(self, key: ProviderKey, long: bool) -> bool:
        return self.eligible(key) and (not long or self.config.providers[key].long_context_capacity >= 1)

    def ref_best(self, candidates: tuple[ProviderKey, ...], long: bool) -> ProviderKey | None:
        ranked = [
            (-self.config.providers[k].priority, self.running(k) / self.config.providers[k].capacity, i, k)
            for i, k in enumerate(candidates)
            if self.dispatchable(k, long, candidates)
        ]
        return min(ranked)[3] if ranked else None

    def candidates(self, model: str, tried: tuple[ProviderKey, ...] = ()) -> tuple[ProviderKey, ...]:
        return tuple(k for k in self.config.models[model].candidates if k not in tried)

    # ------------------------------------------------------------- decisions

    def apply(self, decisions: list) -> None:
        probed = False  # a grant of these decisions started a probe: panic grants after it are its doing
        for d in decisions:
            if isinstance(d, Granted):
                assert d.waiter in self.queued, "grant for a waiter that is not queued"
                assert d.waiter.state is WaiterState.GRANTED
                # [candidate-choice-scale] a queued waiter's grant follows the rule too,
                # given the grants before it in the same step.
                cands = self.candidates(d.waiter.model, d.waiter.tried)
                expect = self.ref_best(cands, d.waiter.long)
                assert d.lease.provider == expect, f"granted {d.lease.provider}, expected {expect}"
                self.queued.remove(d.waiter)
                assert d.lease.tried == (*d.waiter.tried, d.lease.provider)
                assert d.lease.attempt == d.waiter.attempt and d.lease.arrival == d.waiter.seq
                self.take(d.waiter.seq, d.lease, cands)
                if d.lease.probe:
                    probed = True
                elif probed and d.lease.id in self.panic_grants:
                    self.fired(f"panic grants a probe's start caused: {self.via}")
            elif isinstance(d, Failed):
                assert d.waiter in self.queued
                self.queued.remove(d.waiter)
                if isinstance(d.error, Unavailable):
                    assert not any(self.could_ever_run(k, d.waiter.long) for k in d.waiter.candidates), (
                        "failed Unavailable while a candidate is eligible"
                    )
                else:
                    assert isinstance(d.error, ModelNotFound)
                    assert d.waiter.model not in self.config.models
            elif isinstance(d, Revoked):
                lease = d.lease
                # [revoked-in-flight] revoked, not released: its holder's exit is its one release.
                assert lease in self.held and lease.revoked and not lease.released
                self.fenced.add(lease.id)
                self.lease_ended(lease)
            else:
                raise AssertionError(f"unexpected health decision {d!r}")

    def take(self, seq: float, lease: Lease, candidates: tuple[ProviderKey, ...]) -> None:
        assert lease.id not in self.lease_ids, "lease id reused"
        self.lease_ids.add(lease.id)
        assert lease.generation == self.generation[lease.provider.node_id]
        key = lease.provider
        h = self.health[key]
        admitting = self.admitting(key)
        # [outlier-ejection] an ejected provider gets no grant but its single probe, or in panic mode.
        assert admitting or self.panic(candidates, lease.long), f"{lease} granted on {h.state} provider"
        assert lease.probe == (h.state == PROBE)
        if h.state == PROBE:
            h.state, h.probe = PROBING, lease.id
            self.probes[key] += 1
            assert self.probes[key] == 1, "probed twice in one ejection period"
            self.figures["probes"] += 1
        elif not admitting:
            self.figures["panic grants"] += 1
            self.panic_grants.add(lease.id)
        if any(self.health[k].state == PROBING for k in candidates):
            self.fired("grants while a candidate probes")
        if any(held.revoked and held.provider == key for held in self.held):
            self.fired("grants beside a revoked body still running")
        self.lease_epoch[lease.id] = h.epoch
        self.figures["grants"] += 1
        self.held.append(lease)
        self.release_count[lease.id] = 0
        self.step_grants.append((seq, lease, admitting))

    def lease_ended(self, lease: Lease) -> None:
        """A released or revoked probe without a report lets the next grant probe again."""
        h = self.health[lease.provider]
        if h.probe == lease.id:
            h.state, h.probe = PROBE, None
            self.probes[lease.provider] = 0
        self.ended = [*self.ended[-5:], lease]

    def eject(self, key: ProviderKey) -> None:
        h = self.health[key]
        outlier = self.config.outlier
        h.streak += 1
        h.state, h.probe = EJECTED, None
        h.until = self.now + min(outlier.base_ejection * 2 ** (h.streak - 1), outlier.max_ejection)
        h.epoch += 1
        self.probes[key] = 0
        self.figures["ejections"] += 1
        if h.streak > 1:
            self.fired("repeated ejections")
        if any(other.state == EJECTED for k, other in self.health.items() if k != key and k in self.config.providers):
            self.fired("two ejections pending")

    def restore(self, key: ProviderKey) -> None:
        h = self.health[key]
        h.state, h.probe, h.failures, h.streak = HEALTHY, None, 0, 0
        h.epoch += 1
        self.fired("restores")

    coverage = COVERAGE
    # Whether Hypothesis steers towards examples that reach more named interactions (``target``):
    # not here, where the rules reach them often enough and steering doubles the run's time.
    steer = False

    def fired(self, name: str) -> None:
        """Count a path the run reached: Hypothesis statistics (``--hypothesis-show-statistics``) and the
        figures; a named interaction of the machine's ``coverage`` counts towards its floor too."""
        if name in self.coverage.floors:
            self.coverage.hit(name)
            self.reached += 1
        else:
            event(name)
        self.figures[name] += 1

    def probing(self) -> list[ProviderKey]:
        """Providers whose probe is out and that some model lists."""
        listed = {k for group in self.config.models.values() for k in group.candidates}
        return [k for k, h in self.health.items() if h.state == PROBING and k in listed]

    def ejected(self) -> list[ProviderKey]:
        """Ejected providers that some model lists and that could take a grant once the time is over
        (not those ejected until a ready report: their ejection has no time)."""
        listed = {k for group in self.config.models.values() for k in group.candidates}
        return [
            k
            for k, h in self.health.items()
            if h.state == EJECTED and h.until != math.inf and k in listed and self.eligible(k)
        ]

    def unhealthy_nodes(self) -> list[str]:
        return sorted({k.node_id for k, h in self.health.items() if h.state != HEALTHY and k in self.config.providers})

    def queued_retries(self) -> list[Waiter]:
        return [w for w in self.queued if w.attempt > 1]

    def queue_in_order(self, waiter: Waiter) -> None:
        self.queued.insert(bisect.bisect_left([w.seq for w in self.queued], waiter.seq), waiter)

    # ----------------------------------------------------------------- rules

    @initialize(config=pool_configs(), online=st.sampled_from((NODES, NODES, ("n1",), ())))
    def start(self, config: PoolConfig, online: tuple[str, ...]) -> None:
        """A pool, with its nodes mostly connected from the start (so steps reach leases and health)."""
        self.config = config
        self.core = AdmissionState(config)
        for node in online:
            self.connect(node)

    @rule(data=st.data())
    @counted
    def burst(self, data: st.DataObject) -> None:
        """Several requests in one step, mostly for configured models."""
        self.step_grants = []
        names = st.sampled_from((*self.config.models, "unknown"))
        requests = data.draw(st.lists(st.tuples(names, st.booleans()), min_size=1, max_size=3))
        for model, long in requests:
            self.request_one(model, long)

    def request_one(self, model: str, long: bool) -> None:
        before_depth = len(self.queued)
        if model not in self.config.models:
            expect = "ModelNotFound"
        else:
            cands = self.candidates(model)
            best = self.ref_best(cands, long)
            if best is not None:
                expect = best
            elif not any(self.could_ever_run(k, long) for k in cands):
                expect = "Unavailable"
            elif before_depth >= self.config.policy.max_queue:
                expect = "QueueFull"
            else:
                expect = "queued"
        try:
            result = self.core.request(model, long, self.now)
        except ModelNotFound:
            assert expect == "ModelNotFound"
            return
        except Unavailable:
            assert expect == "Unavailable"
            return
        except QueueFull:
            assert expect == "QueueFull"
            return
        if isinstance(result, Lease):
            assert result.provider == expect, f"granted {result.provider}, expected {expect}"
            assert result.attempt == 1 and result.tried == (result.provider,)
            self.take(result.arrival, result, self.candidates(model))
            self.probe_started(result)
        else:
            self.last_seq = result.seq
            assert expect == "queued", expect
            assert result.deadline == self.now + self.config.policy.queue_timeout
            self.queued.append(result)

    def probe_started(self, lease: Lease, via: str = "request") -> None:
        """[outlier-ejection] a grant that starts a probe stops its provider admitting: waiters of its
        groups that this puts in panic mode are granted with it (the core's ``drain_decisions``)."""
        drained = self.core.drain_decisions()
        assert lease.probe or drained == [], f"decisions beside {lease}, which started no probe"
        for _ in drained:
            self.fired(f"panic grants a probe's start caused: {via}")
        self.apply(drained)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    @counted
    def release(self, data: st.DataObject) -> None:
        self.step_grants = []
        lease = data.draw(st.sampled_from(self.held))
        self.release_lease(lease)

    def release_lease(self, lease: Lease) -> None:
        self.held.remove(lease)
        was_released = lease.released
        decisions = self.core.release(lease)
        if was_released:
            assert lease.id in self.fenced and decisions == []
        else:
            self.release_count[lease.id] += 1
            self.lease_ended(lease)
        self.apply(decisions)

    @precondition(lambda self: self.held or self.ended)
    @rule(data=st.data(), ok=st.sampled_from((False, False, True)))
    @counted
    def report(self, data: st.DataObject, ok: bool) -> None:
        """[outlier-ejection] a failure or success report for a live, ended or already reported lease."""
        self.report_lease(data.draw(st.sampled_from(self.held + self.ended)), ok)

    def reportable(self, lease: Lease) -> bool:
        """A report of ``lease`` counts: its first, from the provider's current health epoch and generation."""
        key = lease.provider
        return not (
            lease.id in self.reported
            or key not in self.config.providers
            or self.lease_epoch[lease.id] != self.health[key].epoch
            or lease.generation != self.generation[key.node_id]
        )

    def report_lease(self, lease: Lease, ok: bool) -> None:
        self.step_grants = []
        key = lease.provider
        h = self.health[key]
        stale = not self.reportable(lease)
        self.reported.add(lease.id)
        before = self.core.provider_snapshots(), list(self.core.waiters()), self.core.next_ejection_end()
        if ok:
            decisions = self.core.report_success(lease, self.now)
        else:
            decisions = self.core.report_failure(lease, self.now)
        if stale:  # a stale report changes nothing
            self.figures["stale reports"] += 1
            assert decisions == []
            assert (self.core.provider_snapshots(), list(self.core.waiters()), self.core.next_ejection_end()) == before
            return
        self.figures["success reports" if ok else "failure reports"] += 1
        expect: type | None = None
        if ok:
            h.failures = 0
            if h.state != HEALTHY:
                self.restore(key)
                expect = Restored
        else:
            h.failures += 1
            limit = self.config.outlier.consecutive_failures
            if (h.state == HEALTHY and limit and h.failures >= limit) or (h.state == PROBING and h.probe == lease.id):
                self.eject(key)
                expect = Ejected
        self.health_news(decisions, expect, key)

    def health_news(self, decisions: list, expect: type | None, key: ProviderKey) -> None:
        """A report's decisions: first the ``expect`` health news of ``key`` (or none), then the
        grants it caused, applied."""
        health = [d for d in decisions if isinstance(d, Ejected | Restored)]
        if expect is None:
            assert health == []
        else:
            assert [type(d) for d in health] == [expect] and health[0].provider == key
            assert decisions[0] is health[0]
            if expect is Ejected:
                assert health[0].until == self.health[key].until
        self.apply([d for d in decisions if not isinstance(d, Ejected | Restored)])

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    @counted
    def retry(self, data: st.DataObject) -> None:
        """[failover-before-first-byte] a failed attempt ends, then the request asks again."""
        self.retry_lease(data.draw(st.sampled_from(self.held)))

    def retry_lease(self, lease: Lease) -> None:
        self.step_grants = []
        self.release_lease(lease)
        # The release's grants went to waiters queued before the retry asks again: check their
        # order against that queue, not against the retry that may queue at its earlier place next.
        self.arrival_order()
        self.step_grants = []
        model = lease.model
        if lease.attempt >= self.config.retry.max_attempts:
            expect: object = RetriesExhausted
        elif model not in self.config.models:
            expect = ModelNotFound
        elif lease.enqueue_time + self.config.policy.queue_timeout <= self.now:
            expect = QueueTimeout
        else:
            cands = self.candidates(model, lease.tried)
            best = self.ref_best(cands, lease.long)
            if best is not None:
                expect = best
            elif not any(self.could_ever_run(k, lease.long) for k in cands):
                expect = Unavailable
            else:
                expect = "queued"
        if isinstance(expect, type):  # a refusal
            with pytest.raises(expect):
                self.core.retry(lease, self.now)
            return
        result = self.core.retry(lease, self.now)
        self.figures["retries"] += 1
        with pytest.raises(RuntimeError):
            self.core.retry(lease, self.now)
        if isinstance(result, Lease):
            assert result.provider == expect, f"retry granted {result.provider}, expected {expect}"
            assert result.provider not in lease.tried, "the same provider twice for one request"
            assert (result.arrival, result.attempt) == (lease.arrival, lease.attempt + 1)
            assert result.tried == (*lease.tried, result.provider)
            self.take(result.arrival, result, self.candidates(model, lease.tried))
            self.probe_started(result, "retry")
        else:
            assert expect == "queued", expect
            assert (result.seq, result.attempt, result.tried) == (lease.arrival, lease.attempt + 1, lease.tried)
            assert result.deadline == lease.enqueue_time + self.config.policy.queue_timeout
            self.figures["queued retries"] += 1
            if any(w.seq > result.seq for w in self.queued):
                self.fired("retries queued before a later arrival")
            self.queue_in_order(result)

    @precondition(lambda self: self.queued)
    @rule(data=st.data())
    @counted
    def cancel_waiter(self, data: st.DataObject) -> None:
        self.step_grants = []
        waiter = data.draw(st.sampled_from(self.queued))
        assert self.core.withdraw(waiter)
        assert not self.core.withdraw(waiter), "second withdraw must be a no-op"
        self.queued.remove(waiter)

    @rule(dt=st.sampled_from((0.5, 1, 3, 11)))
    @counted
    def advance_time(self, dt: float) -> None:
        self.step_grants = []
        self.now += dt
        expired = self.core.expire(self.now)
        expected = [w for w in self.queued if w.enqueue_time + self.config.policy.queue_timeout <= self.now]
        assert expired == expected
        if len({w.deadline for w in expired}) < len(expired):
            self.fired("simultaneous timeouts")
        for w in expired:
            self.queued.remove(w)
        if any(w.attempt > 1 for w in expired):
            self.fired("expired queued retries")
        assert all(w.deadline > self.now for w in self.core.waiters()), "expire() left a waiter past its deadline"
        # [outlier-ejection] ejections whose time is over: the probe is due.
        for h in self.health.values():
            if h.state == EJECTED and h.until <= self.now:
                h.state = PROBE
        self.apply(self.core.advance(self.now))

    @rule(node=st.sampled_from(NODES))
    @counted
    def connect(self, node: str) -> None:
        self.step_grants = []
        was_connected = self.connected[node]
        gen, decisions = self.core.connect(node)
        assert gen == self.generation[node] + 1
        # Fencing of the old generation happens before the new one starts.
        revoked = [d for d in decisions if isinstance(d, Revoked)]
        for d in revoked:
            assert d.lease.generation == self.generation[node]
        self.apply(revoked)
        self.drop_elsewhere(node)  # [held-elsewhere] a new generation starts with none
        self.generation[node] = gen
        self.connected[node] = True
        # [health-probe] a new connection ends the node's ejections until a ready report (its
        # reports start over); none without reports (test_active_health_machine.py makes them).
        restored = [d.provider for d in decisions if isinstance(d, Restored)]
        held = [
            k for k in KEYS if k.node_id == node and k in self.config.providers and self.health[k].until == math.inf
        ]
        assert sorted(restored) == sorted(k for k in held if self.health[k].state == EJECTED)
        for key in restored:
            self.restore(key)
            self.fired("a reconnect ends an ejection until ready")
        self.apply([d for d in decisions if not isinstance(d, Revoked | Restored)])
        if was_connected:  # connect on a connected node fences the old generation
            for lease in self.held:
                if lease.provider.node_id == node and lease.generation < gen:
                    assert lease.revoked, f"{lease} of the old generation is still live"

    @rule(node=st.sampled_from(NODES), stale=st.booleans())
    @counted
    def disconnect(self, node: str, stale: bool) -> None:
        self.step_grants = []
        gen = self.generation[node] - 1 if stale else self.generation[node]
        done, decisions = self.core.disconnect(node, gen)
        if stale or not self.connected[node]:
            assert not done and decisions == []
            return
        assert done
        self.connected[node] = False
        self.drop_elsewhere(node)
        self.apply(decisions)
        for lease in self.held:
            if lease.provider.node_id == node:
                assert lease.revoked, "a lease of the fenced generation is still live"

    @rule(config=pool_configs(), prepared=st.booleans())
    @counted
    def refresh(self, config: PoolConfig, prepared: bool) -> None:
        """A refresh, direct or prepared just before (then only what changed is touched)."""
        self.step_grants = []
        self.set_config(config)
        self.apply_refresh(self.core.refresh(self.core.prepare_refresh(config) if prepared else config))

    @rule(data=st.data())
    @counted
    def prepare_refresh(self, data: st.DataObject) -> None:
        """[reload-off-loop] Prepare a refresh now, to apply it some steps later (as a reload
        prepares in a worker thread while the pool keeps serving): an edit of the config in force."""
        self.step_grants = []
        providers = dict(self.config.providers)
        providers[data.draw(st.sampled_from(sorted(providers)))] = data.draw(provider_specs())
        edit = attrs.evolve(self.config, providers=providers)
        config = data.draw(st.sampled_from((edit, self.config)) | pool_configs())
        self.pending = self.core.prepare_refresh(config)

    @precondition(lambda self: self.pending is not None)
    @rule()
    @counted
    def apply_prepared(self) -> None:
        """Apply the refresh prepared earlier, whatever happened since (another refresh too)."""
        self.step_grants = []
        assert self.pending is not None
        prepared, self.pending = self.pending, None
        self.set_config(prepared.config)
        self.apply_refresh(self.core.refresh(prepared))

    def drop_elsewhere(self, node: str) -> None:
        for key in [k for k in self.elsewhere if k.node_id == node]:
            del self.elsewhere[key]

    @rule(data=st.data())
    @counted
    def hold(self, data: st.DataObject) -> None:
        """[held-elsewhere] runs held elsewhere (another Edge's, on the node) count against capacity,
        the long ones against long slots too: no grant takes a provider past either with them, and a
        lower count hands the room to waiters."""
        self.step_grants = []
        key = data.draw(st.sampled_from(KEYS))
        spec = self.config.providers.get(key)
        runs = data.draw(st.integers(0, (spec.capacity if spec else 1) + 1))
        long_runs = data.draw(st.integers(0, min(runs, (spec.long_context_capacity if spec else 1) + 1)))
        self.hold_runs(key, runs, long_runs)

    def hold_runs(self, key: ProviderKey, runs: int, long_runs: int) -> None:
        spec = self.config.providers.get(key)
        before, long_before = self.elsewhere.get(key, (0, 0))
        decisions = self.core.hold(key, runs, long_runs)
        if spec is None or not self.connected[key.node_id]:
            assert decisions == []
            return
        if runs:
            self.elsewhere[key] = (runs, long_runs)
        else:
            self.elsewhere.pop(key, None)
        if runs >= before and long_runs >= long_before:
            assert decisions == []
        else:
            self.fired("held elsewhere lowered")
            if long_runs < long_before:
                self.fired("long runs held elsewhere lowered")
        self.apply(decisions)

    def leased(self, key: ProviderKey) -> bool:
        return any(lease.provider == key and not lease.revoked for lease in self.held)

    def apply_refresh(self, decisions: list) -> None:
        self.via = "refresh"
        try:
            self.apply(decisions)
        finally:
            self.via = "waiter"
        self.kept = len(self.queued)

    def set_config(self, config: PoolConfig) -> None:
        for key in self.held_at_removal & set(config.providers):
            if self.leased(key):  # back while the lease that kept it runs: the same slot, its held runs gone
                self.fired("held runs across a remove and re-add")
        self.held_at_removal -= set(config.providers)
        for key in self.config.providers:
            if key not in config.providers:  # a provider that leaves the config forgets its health
                if key in self.elsewhere and self.leased(key):
                    self.held_at_removal.add(key)
                self.elsewhere.pop(key, None)  # [held-elsewhere] and its runs held elsewhere
                self.health[key] = RefHealth(epoch=self.health[key].epoch + 1)
                self.probes[key] = 0
        self.config = config

    @rule(data=st.data())
    @counted
    def refresh_tweak(self, data: st.DataObject) -> None:
        """A refresh that changes one thing: the queue policy or one provider's spec."""
        self.step_grants = []
        providers = dict(self.config.providers)
        policy = self.config.policy
        if data.draw(st.booleans()):
            policy = QueuePolicy(max_queue=data.draw(st.integers(0, 6)), queue_timeout=data.draw(st.integers(1, 10)))
        else:
            key = data.draw(st.sampled_from(sorted(providers)))
            providers[key] = data.draw(provider_specs())
        self.set_config(attrs.evolve(self.config, policy=policy, providers=providers))
        prepared = data.draw(st.booleans())
        self.apply_refresh(self.core.refresh(self.core.prepare_refresh(self.config) if prepared else self.config))

    @rule()
    @counted
    def refresh_invalid(self) -> None:
        """An invalid config is rejected whole; nothing changes."""
        self.step_grants = []
        before = self.core.provider_snapshots(), self.core.queue_depth
        bad = PoolConfig(
            policy=self.config.policy,
            providers=dict(self.config.providers),
            models={**self.config.models, "bad": ModelGroup(candidates=(ProviderKey("zz", "zz"),))},
        )
        with pytest.raises(ConfigError):
            self.core.refresh(bad)
        assert (self.core.provider_snapshots(), self.core.queue_depth) == before
        assert self.core.config == self.config

    @rule(data=st.data())
    @counted
    def time_out_together(self, data: st.DataObject) -> None:
        """[queue-ownership] requests queue in one instant, then time runs to their common deadline:
        ``expire`` returns all of them, in arrival order."""
        model = data.draw(st.sampled_from(sorted(self.config.models)))
        for _ in range(4):
            if sum(w.model == model and w.enqueue_time == self.now for w in self.queued) >= 2:
                break
            self.step_grants = []
            self.request_one(model, data.draw(st.booleans()))
        self.advance_time(float(self.config.policy.queue_timeout))

    @precondition(lambda self: any(self.leased(k) for k in self.config.providers))
    @rule(data=st.data(), prepared=st.booleans())
    @counted
    def remove_and_re_add(self, data: st.DataObject, prepared: bool) -> None:
        """[held-elsewhere] [refresh-consistency] a provider running a lease holds runs elsewhere (long
        ones too), leaves the config and comes back before the lease ends: the same slot, without them."""
        self.step_grants = []
        key = data.draw(st.sampled_from(sorted(k for k in self.config.providers if self.leased(k))))
        spec = self.config.providers[key]
        runs = data.draw(st.integers(1, spec.capacity + 1))
        self.hold_runs(key, runs, data.draw(st.integers(0, min(runs, spec.long_context_capacity + 1))))
        models = {}
        for name, group in self.config.models.items():
            rest = tuple(k for k in group.candidates if k != key)
            if rest:
                models[name] = ModelGroup(candidates=rest)
        if not models:
            return
        before = self.config
        providers = {k: v for k, v in before.providers.items() if k != key}
        self.refresh(attrs.evolve(before, providers=providers, models=models), prepared)
        self.refresh(before, prepared)

    # The rules below drive, every time their moment comes, the paths the others reach only now
    # and then: requests while a probe is out, refreshes while retries are queued, retries while
    # later arrivals wait, reconnects during an ejection.

    @precondition(lambda self: self.probing())
    @rule(data=st.data())
    @counted
    def request_during_probe(self, data: st.DataObject) -> None:
        """[outlier-ejection] requests for models that list a provider whose probe is out."""
        self.step_grants = []
        key = data.draw(st.sampled_from(self.probing()))
        models = sorted(m for m, group in self.config.models.items() if key in group.candidates)
        self.fired("requests during a probe")
        for _ in range(data.draw(st.integers(1, 3))):
            self.request_one(data.draw(st.sampled_from(models)), data.draw(st.booleans()))

    @precondition(lambda self: self.ejected())
    @rule(data=st.data())
    @counted
    def probe_then_request(self, data: st.DataObject) -> None:
        """[outlier-ejection] time runs to an ejection's end, the probe is granted (to a waiter,
        or to the requests that follow), then more requests come while it is out."""
        key = data.draw(st.sampled_from(self.ejected()))
        self.advance_time(self.health[key].until - self.now)
        models = sorted(m for m, group in self.config.models.items() if key in group.candidates)
        for _ in range(3):
            if self.health[key].state != PROBE:
                break
            self.step_grants = []
            self.request_one(data.draw(st.sampled_from(models)), data.draw(st.booleans()))
        if self.probing():
            self.request_during_probe(data)

    def ejectable(self) -> list[ProviderKey]:
        """Healthy providers that some model lists and that could take a grant, when failures eject."""
        if not self.config.outlier.consecutive_failures:
            return []
        listed = {k for group in self.config.models.values() for k in group.candidates}
        return sorted(k for k in listed if self.health[k].state == HEALTHY and self.eligible(k))

    @precondition(lambda self: self.ejectable())
    @rule(data=st.data(), probe=st.booleans())
    @counted
    def eject_then_probe(self, data: st.DataObject, probe: bool) -> None:
        """[outlier-ejection] failures reported on one provider's leases (requests first, when it holds
        none to report) until it is ejected; then, sometimes, time to its probe and requests while
        the probe is out. Without this rule ejections come only from random reports, a few per run."""
        key = data.draw(st.sampled_from(self.ejectable()))
        models = sorted(m for m, group in self.config.models.items() if key in group.candidates)
        for _ in range(2 * self.config.outlier.consecutive_failures + 2):
            if self.health[key].state != HEALTHY:
                break
            lease = next((lease for lease in self.held if lease.provider == key and self.reportable(lease)), None)
            if lease is None:
                self.step_grants = []
                self.request_one(data.draw(st.sampled_from(models)), False)
            else:
                self.report_lease(lease, ok=False)
        if self.health[key].state == EJECTED:
            self.fired("ejections driven")
            if probe:
                self.probe_then_request(data)

    def retriable(self) -> list[Lease]:
        """Held leases that a retry could requeue: live, of a configured model, attempts left."""
        return [
            lease
            for lease in self.held
            if lease.model in self.config.models
            and not lease.revoked
            and lease.attempt < self.config.retry.max_attempts
        ]

    @precondition(lambda self: self.retriable())
    @rule(data=st.data(), refresh=st.booleans())
    @counted
    def retry_behind_later_arrival(self, data: st.DataObject, refresh: bool) -> None:
        """[failover-before-first-byte] [refresh-consistency] requests for a held lease's model until
        two queue (later arrivals), then the lease fails and retries: its release grants the first
        waiter its slot; if no untried candidate is free the retry queues before the second; then
        a refresh while it is queued, or time passes (expire() walks the queue past it)."""
        lease = data.draw(st.sampled_from(self.retriable()))
        for _ in range(6):  # two later arrivals: the lease's release grants its slot to the first
            if sum(w.seq > lease.arrival and w.model == lease.model for w in self.queued) >= 2:
                break
            self.step_grants = []
            self.request_one(lease.model, lease.long)
        self.retry_lease(lease)
        if self.queued_retries():
            if refresh:
                self.refresh_with_retries_queued(data)
            else:  # or time passes: the retry expires at its arrival place, or not yet
                self.advance_time(data.draw(st.sampled_from((0.5, 1, 3, 11))))

    @precondition(lambda self: self.queued_retries())
    @rule(data=st.data())
    @counted
    def refresh_with_retries_queued(self, data: st.DataObject) -> None:
        """[failover-before-first-byte] [refresh-consistency] a refresh while retries are queued:
        the config in force again (direct, prepared, or with its model groups rebuilt) or a tweak."""
        self.fired("refreshes with retries queued")
        kind = data.draw(st.sampled_from(("same", "prepared", "rebuilt", "tweak")))
        if kind == "tweak":
            self.refresh_tweak(data)
        elif kind == "rebuilt":
            self.refresh(attrs.evolve(self.config, models=dict(self.config.models)), prepared=False)
        else:
            self.refresh(self.config, prepared=kind == "prepared")

    @precondition(lambda self: self.held and self.queued)
    @rule(data=st.data())
    @counted
    def retry_with_waiters(self, data: st.DataObject) -> None:
        """[failover-before-first-byte] a retry while later arrivals wait: it must go back before them."""
        self.fired("retries while waiters queue")
        self.retry(data)

    @precondition(lambda self: self.unhealthy_nodes())
    @rule(data=st.data())
    @counted
    def reconnect_during_ejection(self, data: st.DataObject) -> None:
        """[outlier-ejection] [disconnect-exclusion] a node reconnects (a new generation) while one
        of its providers is ejected, due a probe or probing."""
        self.fired("reconnects during an ejection")
        self.connect(data.draw(st.sampled_from(self.unhealthy_nodes())))

    def running_live(self) -> list[Lease]:
        """Live leases on a connected node: a reconnect would revoke them with their bodies running."""
        return [lease for lease in self.held if not lease.revoked and self.connected[lease.provider.node_id]]

    @precondition(lambda self: self.running_live())
    @rule(data=st.data(), long=st.booleans())
    @counted
    def reconnect_then_ask(self, data: st.DataObject, long: bool) -> None:
        """[revoked-in-flight] a node reconnects while leases of it run (revoked, their bodies still
        running) and requests for its models come at once: the bodies still count against capacity."""
        self.fired("reconnects with bodies running")
        lease = data.draw(st.sampled_from(self.running_live()))
        self.connect(lease.provider.node_id)
        for model, group in self.config.models.items():
            if lease.provider in group.candidates:
                self.request_one(model, long)

    # ------------------------------------------------------------ invariants

    @invariant()
    def probe_excludes_ordinary_grants(self) -> None:
        """[outlier-ejection] while a provider probes, every live lease granted there after the
        probe is a panic-mode grant: the probe closes its provider to ordinary grants."""
        for key, h in self.health.items():
            if h.state != PROBING:
                continue
            assert h.probe is not None
            for lease in self.held:
                if lease.provider == key and not lease.revoked and lease.id > h.probe:
                    assert lease.id in self.panic_grants, f"{lease} granted beside the probe {h.probe}"

    @invariant()
    def tried_sets(self) -> None:
        """[failover-before-first-byte] a lease's tried set has one entry per attempt, no duplicate,
        and ends with its own provider (never tried before); a queued retry's excludes its candidates."""
        for lease in self.held:
            assert len(set(lease.tried)) == len(lease.tried) == lease.attempt, lease.tried
            assert lease.tried[-1] == lease.provider not in lease.tried[:-1]
        for w in self.queued:
            assert len(set(w.tried)) == len(w.tried) == w.attempt - 1, w.tried
            assert not set(w.tried) & set(w.candidates), f"{w} may go back to a provider it tried"

    @invariant()
    def waiters_in_arrival_order(self) -> None:
        """[cross-group-wakeup] [failover-before-first-byte] the queue is in arrival order, retries
        included, across refreshes: the order expire() walks."""
        seqs = [w.seq for w in self.core.waiters()]
        assert seqs == sorted(set(seqs)), f"waiters out of arrival order: {seqs}"

    @invariant()
    def counters_match_live_leases(self) -> None:
        """[provider-state] [snapshot-source] in_flight == live leases, never negative."""
        for snap in self.core.provider_snapshots():
            key = ProviderKey(snap.node_id, snap.provider_id)
            assert snap.in_flight == self.live(key) >= 0
            assert snap.long_in_flight == self.live(key, True) >= 0
            # [revoked-in-flight] revoked bodies not released yet are counted apart
            assert snap.in_flight + snap.revoked_in_flight == self.running(key)
            assert snap.long_in_flight + snap.revoked_long_in_flight == self.running(key, True)
            if key not in self.config.providers:
                # [removed-provider-visible] a removed provider is listed while a lease of it runs
                assert snap.status == "removed" and self.running(key) > 0
                self.fired("removed providers listed while a lease runs")
                continue
            spec = self.config.providers[key]
            assert snap.capacity == spec.capacity
            if self.eligible(key):
                assert snap.effective_capacity == spec.capacity
                assert snap.status == "available"
            else:
                assert snap.effective_capacity == snap.effective_long_capacity == 0
                assert snap.queued == snap.long_queued == 0
                assert snap.status == ("disabled" if not spec.enabled else "unavailable")
            assert snap.connected == self.connected[key.node_id]
            h = self.health[key]
            if not snap.connected:
                assert snap.health == "offline"
            else:
                assert snap.health == ("online" if h.state == HEALTHY else "ejected")
            assert snap.failures == h.failures
            assert snap.generation == self.generation[key.node_id]
        live_core = {lease.id for lease in self.core.live_leases()}
        live_ref = {lease.id for lease in self.held if not lease.revoked}
        assert live_core == live_ref

    @invariant()
    def candidate_pressure(self) -> None:
        """[snapshot-source] queued counts waiters for which the provider is an eligible candidate."""
        assert self.core.queue_depth == len(self.queued)
        assert list(self.core.waiters()) == self.queued
        timeout = self.config.policy.queue_timeout
        for w in self.queued:  # [refresh-consistency] deadline = enqueue time + current timeout
            assert w.deadline == w.enqueue_time + timeout
        for snap in self.core.provider_snapshots():
            key = ProviderKey(snap.node_id, snap.provider_id)
            if not self.eligible(key):
                continue
            pressure = [w for w in self.queued if key in w.candidates and self.could_ever_run(key, w.long)]
            assert snap.queued == len(pressure)
            assert snap.long_queued == sum(1 for w in pressure if w.long)

    @invariant()
    def ejection_ends_on_time(self) -> None:
        """[outlier-ejection] an ejection lasts exactly its time: base doubled per ejection in a row, capped."""
        # An ejection until a ready report ([health-probe]: test_active_health_machine.py) has no end time.
        ends = [h.until for k, h in self.health.items() if h.state == EJECTED and k in self.config.providers]
        timed = [end for end in ends if end != math.inf]
        assert self.core.next_ejection_end() == (min(timed) if timed else None)
        for end in ends:
            assert end > self.now, "an ejection outlived its time"
        for snap in self.core.provider_snapshots():
            h = self.health[ProviderKey(snap.node_id, snap.provider_id)]
            assert snap.ejection_left == (h.until - self.now if h.state == EJECTED and h.until != math.inf else 0.0)
        panic = {m for m in self.config.models if self.panic(self.candidates(m), False)}
        assert set(self.core.panic_models()) == panic
        if panic:
            self.figures["steps in panic mode"] += 1

    @invariant()
    def single_probe(self) -> None:
        """[outlier-ejection] a probing provider has exactly its one probe lease live."""
        for key, h in self.health.items():
            if h.state == PROBING:
                probes = [lease for lease in self.held if lease.provider == key and lease.probe and not lease.revoked]
                assert [lease.id for lease in probes if lease.id == h.probe] == [h.probe]

    @invariant()
    def grants_within_capacity(self) -> None:
        """[long-state] a grant never takes a provider past capacity or long capacity;
        [revoked-in-flight] counting every running body, revoked ones whose holder has not left too."""
        for _, lease, _ in self.step_grants:
            spec = self.config.providers[lease.provider]
            assert self.running(lease.provider) <= spec.capacity
            if lease.long:
                assert self.running(lease.provider, True) <= spec.long_context_capacity

    @invariant()
    def queue_bound(self) -> None:
        """[queue-ownership] queue depth <= max_queue (waiters kept across a lowering refresh aside)."""
        assert all(w.state is WaiterState.QUEUED for w in self.queued)
        self.kept = min(self.kept, len(self.queued))
        retries = sum(1 for w in self.queued if w.attempt > 1)  # a retry is never refused for a full queue
        assert len(self.queued) <= max(self.config.policy.max_queue, self.kept) + retries

    @invariant()
    def work_conservation(self) -> None:
        """[cross-group-wakeup] no waiter stays queued while a provider is dispatchable for it;
        [disconnect-queue-resolution] no waiter stays queued without an eligible candidate."""
        for w in self.queued:
            cands = self.candidates(w.model, w.tried)
            assert w.candidates == cands
            for k in cands:
                assert not self.dispatchable(k, w.long, cands), f"{w} could run on {k}"
            assert any(self.could_ever_run(k, w.long) for k in cands), f"{w} is stranded"

    @invariant()
    def arrival_order(self) -> None:
        """[cross-group-wakeup] grants follow arrival order among waiters that could use the provider;
        [failover-before-first-byte] a retried waiter keeps its arrival place: never overtaken."""
        for seq, lease, admitting in self.step_grants:
            key = lease.provider
            spec = self.config.providers[key]
            for earlier in self.queued:
                if earlier.seq >= seq or key not in earlier.candidates:
                    continue
                if not self.could_ever_run(key, earlier.long):
                    continue
                if not admitting and not self.panic(earlier.candidates, earlier.long):
                    continue  # a panic grant on an ejected provider: only panic waiters could use it
                if not earlier.long:
                    raise AssertionError(f"{lease} granted while earlier {earlier} waits")
                if lease.long or self.running(key, True) < spec.long_context_capacity:
                    raise AssertionError(f"{lease} granted while earlier long {earlier} waits")

    @invariant()
    def released_exactly_once(self) -> None:
        """[lease-lifecycle] the ledger: every ended lease released exactly once."""
        held_ids = {lease.id for lease in self.held}
        for lease_id, count in self.release_count.items():
            if lease_id in held_ids:  # [revoked-in-flight] a fenced lease too, until its holder leaves
                assert count == 0
            else:
                assert count == 1, f"lease {lease_id} released {count} times"

    def teardown(self) -> None:
        """Drain: release everything; every counter must return to 0 and the queue empty."""
        if not hasattr(self, "core"):
            return
        self.coverage.examples += 1
        if self.steer:
            target(float(self.reached), label="named interactions reached")
        for w in list(self.queued):
            self.core.withdraw(w)
        self.queued.clear()
        for lease in list(self.held):
            assert self.core.release(lease) == []
        for key in list(self.elsewhere):
            assert self.core.hold(key, 0) == []
        for snap in self.core.provider_snapshots():
            assert snap.in_flight == snap.long_in_flight == snap.queued == snap.revoked_in_flight == 0
            assert snap.status != "removed"
        assert self.core.queue_depth == 0
        assert list(self.core.live_leases()) == [] == list(self.core.revoked_running())


@pytest.fixture(scope="module", autouse=True)
def _print_figures() -> object:
    yield
    COVERAGE.check()
    if _FIGURES:
        print(f"\nstate machine figures ({_PROFILE} profile, {_EXAMPLES} examples x {_STEPS} steps at most):")
        for name, count in sorted(_FIGURES.items()):
            print(f"  {name:45} {count:7}")


AdmissionMachine.TestCase.settings = settings(settings.default, max_examples=_EXAMPLES, stateful_step_count=_STEPS)
TestAdmissionStateMachine = pytest.mark.req(
    "candidate-choice-scale",
    "provider-state",
    "lease-lifecycle",
    "long-state",
    "cross-group-wakeup",
    "queue-ownership",
    "snapshot-source",
    "refresh-consistency",
    "disconnect-exclusion",
    "disconnect-queue-resolution",
    "offline-snapshot",
    "outlier-ejection",
    "failover-before-first-byte",
    "held-elsewhere",
    "revoked-in-flight",
    "removed-provider-visible",
)(AdmissionMachine.TestCase)
