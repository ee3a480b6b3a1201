"""The steps of a program and the Hypothesis strategies that draw them from a user's ``PoolConfig``.

A program is a list of steps, each a small frozen value with a readable repr,
so that the falsifying example Hypothesis prints (shrunk) reads as a script:
``[Ask('chat', long=True), Disconnect('local'), Finish(0)]``. Every step is
well defined in every state: a step that finds nothing to act on (``Finish``
with no call holding) does nothing, so shrinking may drop any step.
"""

from __future__ import annotations

from typing import Any, TypeAlias, final

import attrs
from hypothesis import strategies as st

from iop_admission import ConfigError, ModelGroup, PoolConfig, QueuePolicy, validate_pool

__all__ = [
    "Advance",
    "Ask",
    "Cancel",
    "Disconnect",
    "Finish",
    "Reconnect",
    "Refresh",
    "Step",
    "config_variants",
    "programs",
    "steps",
]


@final
@attrs.frozen
class Ask:
    """Start ``count`` calls of the code under test, one after the other, each for ``model``.

    ``hold``: the call's body waits for a :class:`Finish` (or a cancellation);
    otherwise it returns as soon as it is entered (a short run).
    """

    model: str
    long: bool = False
    tenant: str | None = None
    hold: bool = True
    count: int = 1


@final
@attrs.frozen
class Finish:
    """End the body of the ``pick``-th holding call (modulo how many hold); ``fail``: by raising."""

    pick: int
    fail: bool = False


@final
@attrs.frozen
class Cancel:
    """Cancel the ``pick``-th call still queued (``holding=False``) or holding its lease (``holding=True``)."""

    pick: int
    holding: bool = False


@final
@attrs.frozen
class Disconnect:
    """``disconnect(node, generation(node))``: the node's leases are revoked, its waiters move or fail."""

    node: str


@final
@attrs.frozen
class Reconnect:
    """``connect(node)``: a new generation; if the node was connected, its leases are revoked first."""

    node: str


@final
@attrs.frozen(repr=False)
class Refresh:
    """``refresh(config)``: providers removed (their live leases kept), capacities and timeouts changed.

    Its repr shows what a refresh varies: each provider's capacity (and ``off``
    when disabled), each model's candidates, the queue timeout.
    """

    config: PoolConfig

    def __repr__(self) -> str:
        providers = ", ".join(
            f"{k.node_id}/{k.provider_id}: {spec.capacity}{'' if spec.enabled else ' off'}"
            for k, spec in self.config.providers.items()
        )
        models = ", ".join(
            f"{name}: {'+'.join(k.provider_id for k in group.candidates)}" for name, group in self.config.models.items()
        )
        return f"Refresh(<{providers}; {models}; timeout {self.config.policy.queue_timeout:g}>)"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """What Hypothesis prints in a failing program: the repr, not every field of the config."""
        printer.text(repr(self))


@final
@attrs.frozen
class Advance:
    """Let ``seconds`` of virtual time pass (queue deadlines fire on the way)."""

    seconds: float


Step: TypeAlias = Ask | Finish | Cancel | Disconnect | Reconnect | Refresh | Advance


def _valid(config: PoolConfig) -> bool:
    try:
        validate_pool(config)
    except ConfigError:
        return False
    return True


@st.composite
def _variant(draw: st.DrawFn, config: PoolConfig) -> PoolConfig:
    keys = list(config.providers)
    kept = draw(st.lists(st.sampled_from(keys), min_size=1, max_size=len(keys), unique=True))
    models = {}
    for name, group in config.models.items():
        candidates = tuple(k for k in group.candidates if k in kept)
        if candidates:
            models[name] = attrs.evolve(group, candidates=candidates)
    if not models:  # keep one model, on its first candidate
        name, group = next(iter(config.models.items()))
        models[name] = ModelGroup((group.candidates[0],))
        kept.append(group.candidates[0])
    providers = {}
    for key in keys:
        if key in kept:
            spec = config.providers[key]
            capacity = draw(st.integers(max(1, spec.long_context_capacity), spec.capacity + 1))
            enabled = draw(st.sampled_from((spec.enabled, spec.enabled, not spec.enabled)))
            providers[key] = attrs.evolve(spec, capacity=capacity, enabled=enabled)
    timeout = config.policy.queue_timeout * draw(st.sampled_from((1.0, 0.5, 2.0)))
    policy = QueuePolicy(max_queue=config.policy.max_queue, queue_timeout=timeout)
    return attrs.evolve(config, providers=providers, models=models, policy=policy)


def config_variants(config: PoolConfig) -> st.SearchStrategy[PoolConfig]:
    """Valid configs near ``config``: some providers removed (and the models left without a
    candidate), capacities one lower or higher, a provider disabled, the queue timeout halved or
    doubled. Tenants, retry and outlier policies are kept."""
    return _variant(config).filter(_valid)


def _nodes(config: PoolConfig) -> list[str]:
    return list(dict.fromkeys(k.node_id for k in config.providers))


def steps(config: PoolConfig) -> st.SearchStrategy[Step]:
    """One step of a program over ``config``'s models, tenants and nodes.

    Asks and finishes come most often: a program must grant many leases to meet a fault that
    shows once in many, and bursts of short runs grant several in one step.
    """
    models = st.sampled_from(sorted(config.models))
    tenants = st.sampled_from([None, *sorted(t.name for t in config.tenants)])
    nodes = st.sampled_from(_nodes(config))
    timeout = config.policy.queue_timeout

    def asks(hold: bool) -> st.SearchStrategy[Ask]:
        return st.builds(
            Ask, model=models, long=st.booleans(), tenant=tenants, hold=st.just(hold), count=st.integers(1, 6)
        )

    finish = st.builds(Finish, pick=st.integers(0, 7), fail=st.booleans())
    return st.one_of(
        asks(hold=False),
        asks(hold=True),
        finish,
        asks(hold=False),
        asks(hold=True),
        finish,
        st.builds(Cancel, pick=st.integers(0, 7), holding=st.booleans()),
        st.builds(Reconnect, node=nodes),
        st.builds(Disconnect, node=nodes),
        st.builds(Refresh, config=config_variants(config)),
        st.builds(Advance, seconds=st.sampled_from((timeout / 4, timeout * 0.75, timeout * 1.5))),
    )


def _flat(rounds: list[list[Step]]) -> list[Step]:
    return [step for steps in rounds for step in steps]


def programs(config: PoolConfig, *, max_steps: int = 100) -> st.SearchStrategy[list[Step]]:
    """Programs of up to ``max_steps`` steps over ``config``, for :func:`iop_admission.testing.run_program`.

    Drawn as rounds of up to ten steps: lists of Hypothesis's own sizes average about five
    items, too few leases to meet a fault that shows once in a few dozen, while lists of
    rounds hold several times more and still shrink as lists do (a round may be empty, so
    that a step can go without its neighbours).
    """
    rounds = st.lists(steps(config), max_size=10)
    return st.lists(rounds, min_size=1, max_size=max(1, max_steps // 10)).map(_flat)
