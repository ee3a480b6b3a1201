"""A refresh prepared off the loop is exactly a direct refresh [reload-off-loop] [refresh-consistency].

Two :class:`AdmissionState` cores are driven in lockstep through the same
random steps (requests, releases, retries, withdrawals, timeouts, connects,
disconnects, health reports, time, direct refreshes). At one step the second
core prepares a refresh to a new configuration (usually a small edit of the
one in force: one spec, one provider added or removed, one model group's
candidates, the policy); the steps go on, on both; at a later step the first
core refreshes directly to that configuration and the second applies what it
prepared. Every step's decisions, errors and the whole observable state
(snapshots, panic models, queued waiters with their deadlines and candidates,
live leases, the next ejection end) must be the same on both cores, before and
after the refresh and for the steps after it -- whether the configuration in
force changed in between (then the prepared refresh is applied whole) or not
(then only what changed is touched).
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iop_admission import (
    AdmissionError,
    ConfigError,
    ModelGroup,
    OutlierPolicy,
    PoolConfig,
    PreparedRefresh,
    ProviderKey,
    ProviderSpec,
    QueuePolicy,
    RetryPolicy,
)
from iop_admission.core import AdmissionState, Ejected, Failed, Granted, Lease, Restored, Revoked, Waiter

NODES = ("n1", "n2", "n3")
KEYS = tuple(ProviderKey(node, p) for node in NODES for p in ("a", "b"))
MODELS = ("m1", "m2", "m3", "m4")


@st.composite
def specs(draw: st.DrawFn) -> ProviderSpec:
    capacity = draw(st.integers(1, 2))
    long_cap = draw(st.integers(0, capacity))
    return ProviderSpec(
        capacity=capacity,
        long_context_capacity=long_cap,
        priority=draw(st.integers(0, 2)),
        enabled=draw(st.sampled_from((True, True, True, False))),
    )


@st.composite
def configs(draw: st.DrawFn) -> PoolConfig:
    keys = draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=5, unique=True))
    providers = {k: draw(specs()) for k in keys}
    names = draw(st.lists(st.sampled_from(MODELS), min_size=1, max_size=3, unique=True))
    models = {name: ModelGroup(draw(st.lists(st.sampled_from(keys), min_size=1, unique=True))) for name in names}
    return PoolConfig(
        policy=QueuePolicy(max_queue=draw(st.sampled_from((2, 8, 8))), queue_timeout=draw(st.integers(2, 30))),
        providers=providers,
        models=models,
        retry=RetryPolicy(max_attempts=draw(st.sampled_from((1, 2, 3)))),
        outlier=OutlierPolicy(consecutive_failures=draw(st.sampled_from((0, 1, 2))), base_ejection=1.0),
    )


@st.composite
def edits(draw: st.DrawFn, base: PoolConfig) -> PoolConfig:
    """``base`` with one to three small changes (or, sometimes, a fresh configuration)."""
    if draw(st.integers(0, 5)) == 0:
        return draw(configs())
    providers = dict(base.providers)
    models = {name: list(group.candidates) for name, group in base.models.items()}
    policy = base.policy
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(("spec", "grow", "grow", "add", "remove", "candidates", "model", "policy", "same")))
        if kind == "grow":  # room for waiters: one more slot (a long one too), enabled
            key = draw(st.sampled_from(sorted(providers)))
            spec = providers[key]
            long_cap = spec.long_context_capacity + 1
            providers[key] = attrs.evolve(
                spec, capacity=spec.capacity + 1, long_context_capacity=long_cap, enabled=True
            )
        elif kind == "spec":
            providers[draw(st.sampled_from(sorted(providers)))] = draw(specs())
        elif kind == "add":
            key = draw(st.sampled_from(KEYS))
            providers[key] = draw(specs())
            name = draw(st.sampled_from(sorted(models)))
            if key not in models[name]:
                models[name].insert(draw(st.integers(0, len(models[name]))), key)
        elif kind == "remove" and len(providers) > 1:
            key = draw(st.sampled_from(sorted(providers)))
            del providers[key]
            models = {n: [k for k in c if k != key] for n, c in models.items()}
            models = {n: c for n, c in models.items() if c} or {"m1": [next(iter(providers))]}
        elif kind == "candidates":
            name = draw(st.sampled_from(sorted(models)))
            models[name] = draw(st.lists(st.sampled_from(sorted(providers)), min_size=1, unique=True))
        elif kind == "model":
            name = draw(st.sampled_from(MODELS))
            if name in models and len(models) > 1:
                del models[name]
            else:
                models[name] = [draw(st.sampled_from(sorted(providers)))]
        elif kind == "policy":
            policy = QueuePolicy(max_queue=draw(st.sampled_from((0, 2, 8))), queue_timeout=draw(st.integers(1, 30)))
    return PoolConfig(
        policy=policy,
        providers=providers,
        models={n: ModelGroup(tuple(c)) for n, c in models.items()},
        retry=base.retry,
        outlier=base.outlier,
    )


def _decision(d: object) -> tuple[Any, ...]:
    if isinstance(d, Granted):
        lease = d.lease
        return ("granted", d.waiter.seq, lease.id, lease.provider, lease.long, lease.attempt, lease.probe)
    if isinstance(d, Failed):
        return ("failed", d.waiter.seq, type(d.error).__name__, d.waiter.state)
    if isinstance(d, Revoked):
        return ("revoked", d.lease.id)
    if isinstance(d, Ejected):
        return ("ejected", d.provider, d.until, d.duration, d.failures)
    assert isinstance(d, Restored)
    return ("restored", d.provider)


def _state(core: AdmissionState, now: float) -> tuple[Any, ...]:
    waiters = tuple((w.seq, w.model, w.long, w.deadline, w.candidates, w.attempt) for w in core.waiters())
    leases = tuple(sorted((lease.id, lease.provider, lease.released) for lease in core.live_leases()))
    return (
        core.provider_snapshots(now),
        core.panic_models(),
        core.queue_depth,
        waiters,
        leases,
        core.next_ejection_end(),
        core.config,
        tuple((node, core.generation(node), core.is_connected(node)) for node in NODES),
    )


class Side:
    """One core and the leases and waiters its steps made, in order."""

    def __init__(self, config: PoolConfig) -> None:
        self.core = AdmissionState(config)
        self.held: list[Lease] = []
        self.waiters: list[Waiter] = []
        self.prepared: PreparedRefresh | None = None

    def absorb(self, decisions: list[Any]) -> list[tuple[Any, ...]]:
        for d in decisions:
            if isinstance(d, Granted):
                self.held.append(d.lease)
        return [_decision(d) for d in decisions]

    def step(self, op: tuple[Any, ...], now: float) -> object:
        """Run one step; its decisions, result or error class, comparable across sides."""
        core, kind = self.core, op[0]
        try:
            if kind == "request":
                result = core.request(op[1], op[2], now)
                if isinstance(result, Lease):
                    self.held.append(result)
                    return ("lease", result.id, result.provider)
                self.waiters.append(result)
                return ("waiter", result.seq)
            if kind == "retry":
                lease = self.held[op[1] % len(self.held)]
                result = core.retry(lease, now)
                if isinstance(result, Lease):
                    self.held.append(result)
                    return ("lease", result.id, result.provider, result.attempt)
                self.waiters.append(result)
                return ("waiter", result.seq)
            return self._other(op, now)
        except (AdmissionError, RuntimeError) as exc:
            return ("error", type(exc).__name__)

    def _other(self, op: tuple[Any, ...], now: float) -> object:
        core, kind = self.core, op[0]
        if kind == "release":
            return self.absorb(core.release(self.held.pop(op[1] % len(self.held))))
        if kind == "report":
            lease = self.held[op[1] % len(self.held)]
            report = core.report_success if op[2] else core.report_failure
            return self.absorb(report(lease, now))
        if kind == "withdraw":
            return core.withdraw(self.waiters[op[1] % len(self.waiters)])
        if kind == "time":
            return [w.seq for w in core.expire(now)], self.absorb(core.advance(now))
        if kind == "connect":
            generation, decisions = core.connect(op[1])
            return generation, self.absorb(decisions)
        if kind == "disconnect":
            done, decisions = core.disconnect(op[1], core.generation(op[1]))
            return done, self.absorb(decisions)
        assert kind == "refresh"
        return self.absorb(core.refresh(op[1]))


@st.composite
def steps(draw: st.DrawFn, config: PoolConfig) -> tuple[Any, ...]:
    kind = draw(st.sampled_from(("request",) * 4 + ("release", "retry", "report", "withdraw", "time")))
    kind = draw(st.sampled_from((kind, kind, kind, "connect", "disconnect", "refresh")))
    if kind == "request":
        model = draw(st.sampled_from(sorted(config.models)) | st.sampled_from(MODELS))
        return ("request", model, draw(st.booleans()))
    if kind in ("release", "retry", "withdraw"):
        return (kind, draw(st.integers(0, 100)))
    if kind == "report":
        return ("report", draw(st.integers(0, 100)), draw(st.booleans()))
    if kind == "time":
        return ("time", draw(st.sampled_from((0.5, 1.0, 3.0))))
    if kind in ("connect", "disconnect"):
        return (kind, draw(st.sampled_from(NODES)))
    return ("refresh", draw(edits(config)))


def _runnable(op: tuple[Any, ...], side: Side) -> bool:
    if op[0] in ("release", "retry", "report"):
        return bool(side.held)
    if op[0] == "withdraw":
        return bool(side.waiters)
    return True


@pytest.mark.req("reload-off-loop", "refresh-consistency")
@settings(max_examples=300)
@given(data=st.data(), start=configs(), length=st.integers(5, 40))
def test_prepared_refresh_equals_direct_refresh(data: st.DataObject, start: PoolConfig, length: int) -> None:
    direct, prepared = Side(start), Side(start)
    connected = data.draw(st.sampled_from((3, 3, 3, 2, 1, 0)), label="nodes connected")
    prologue = [("connect", node) for node in NODES[:connected]]
    models = sorted(start.models)
    for i in range(data.draw(st.integers(0, 16), label="requests at start")):  # a loaded pool, waiters queued
        prologue.append(("request", models[i % len(models)], i % 3 == 2))
    for op in prologue:
        assert direct.step(op, 0.0) == prepared.step(op, 0.0)
    prepare_at = data.draw(st.integers(0, length - 1), label="prepare at")
    apply_at = data.draw(st.integers(prepare_at, length), label="apply at")
    target: PoolConfig | None = None
    now = 0.0
    for i in range(length + 1):
        if i == prepare_at:
            target = data.draw(edits(direct.core.config), label="target")
            prepared.prepared = prepared.core.prepare_refresh(target)
        if i == apply_at:
            assert target is not None and prepared.prepared is not None
            assert direct.absorb(direct.core.refresh(target)) == prepared.absorb(
                prepared.core.refresh(prepared.prepared)
            )
            assert _state(direct.core, now) == _state(prepared.core, now)
        if i == length:
            break
        op = data.draw(steps(direct.core.config), label=f"step {i}")
        if op[0] == "time":
            now += op[1]
        if _runnable(op, direct):
            assert direct.step(op, now) == prepared.step(op, now), op
            assert _state(direct.core, now) == _state(prepared.core, now), op


@pytest.mark.req("reload-off-loop", "refresh-consistency")
def test_prepare_refresh_validates_and_changes_nothing() -> None:
    """An invalid config fails in the prepare; preparing leaves the state as it was."""
    key = KEYS[0]
    config = PoolConfig(providers={key: ProviderSpec(capacity=1)}, models={"m1": ModelGroup((key,))})
    core = AdmissionState(config)
    core.connect(key.node_id)
    lease = core.request("m1", False, 0.0)
    assert isinstance(lease, Lease)
    before = _state(core, 0.0)
    with pytest.raises(ConfigError):
        core.prepare_refresh(PoolConfig(providers={key: ProviderSpec(capacity=1)}, models={"m1": ModelGroup(())}))
    bigger = PoolConfig(providers={key: ProviderSpec(capacity=2)}, models={"m1": ModelGroup((key,))})
    prepared = core.prepare_refresh(bigger)
    assert (prepared.changed, prepared.added, prepared.removed, prepared.groups) == ([key], [], [], [])
    assert _state(core, 0.0) == before
    assert core.refresh(prepared) == []
    assert core.config is bigger
    assert core.provider_snapshots()[0].capacity == 2 and core.provider_snapshots()[0].in_flight == 1


@pytest.mark.req("reload-off-loop", "refresh-consistency")
def test_prepared_refresh_indexes_full_providers_of_a_new_group_as_full() -> None:
    """A model group built anew by a prepared refresh indexes its candidates as they are now:
    one whose long slots are all taken is not offered to a long request; its normal slot is."""
    a, b = KEYS[0], KEYS[2]
    spec = ProviderSpec(capacity=2, long_context_capacity=1)
    before = PoolConfig(providers={a: spec, b: spec}, models={"m1": ModelGroup((a,))})
    after = PoolConfig(providers={a: spec, b: spec}, models={"m1": ModelGroup((a, b))})
    core = AdmissionState(before)
    core.connect(a.node_id)  # b's node stays offline: only a could run anything
    held = core.request("m1", True, 0.0)
    assert isinstance(held, Lease) and held.provider == a
    prepared = core.prepare_refresh(after)
    assert prepared.groups == ["m1"] and core.refresh(prepared) == []
    waiter = core.request("m1", True, 0.0)
    assert isinstance(waiter, Waiter)  # a's long slot is taken, b is offline
    lease = core.request("m1", False, 0.0)
    assert isinstance(lease, Lease) and lease.provider == a


@pytest.mark.req("reload-off-loop")
def test_prepare_refresh_calls_pause_as_it_goes_and_prepares_the_same() -> None:
    """``pause`` (a reload giving way to the loop) is called once per PAUSE_EVERY providers and
    candidates, by the validation and every comparison (the providers, their order, each model's
    candidates); what is prepared is the same."""
    keys = [ProviderKey(f"n{i}", "p") for i in range(200)]
    base = PoolConfig(providers={k: ProviderSpec(capacity=1) for k in keys}, models={"m": ModelGroup(tuple(keys))})
    changed = {**base.providers, keys[7]: ProviderSpec(capacity=2)}
    target = PoolConfig(providers=changed, models={"m": ModelGroup(tuple(keys[:150]))})
    calls: list[None] = []
    paused = AdmissionState(base).prepare_refresh(target, lambda: calls.append(None))
    plain = AdmissionState(base).prepare_refresh(target)
    assert [paused.changed, paused.added, paused.removed, paused.groups] == [[keys[7]], [], [], ["m"]]
    assert [plain.changed, plain.added, plain.removed, plain.groups] == [[keys[7]], [], [], ["m"]]
    # validation: 200 providers (4 calls) and 150 candidates (3); comparison: 200 providers (4),
    # their order (4), the model's candidates up to the first difference, the 151st (3)
    assert len(calls) == 4 + 3 + 4 + 4 + 3
