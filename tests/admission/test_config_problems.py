"""Bad configuration is refused with every problem listed, each naming its field and value, in
the words an operator reads; the errors' own messages say what happened.

The texts are the contract an operator (and the Edge's file:line errors) depend on, so each is
checked whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from iop_admission import (
    ConcurrencyLimitExceeded,
    ConfigError,
    LeaseRevoked,
    ModelGroup,
    ModelNotFound,
    NodeNotFound,
    OutlierPolicy,
    PoolConfig,
    ProviderKey,
    ProviderSpec,
    QueueFull,
    QueuePolicy,
    RetriesExhausted,
    RetryPolicy,
    TenantSpec,
    Unavailable,
    validate_pool,
)

A = ProviderKey("node-a", "gpu0")
B = ProviderKey("node-a", "gpu1")
C = ProviderKey("node-b", "gpu2")
GOOD = ProviderSpec(capacity=1, long_context_capacity=1, context_window_tokens=32768, total_context_tokens=32768)


def _bad(**fields: Any) -> ProviderSpec:
    """A spec with ``fields`` set past its own check (as an ``evolve()`` trick could): the pool checks again."""
    spec = ProviderSpec(capacity=1, long_context_capacity=1, context_window_tokens=32768, total_context_tokens=32768)
    for name, value in fields.items():
        object.__setattr__(spec, name, value)
    return spec


@pytest.mark.parametrize(
    ("build", "problems"),
    [
        pytest.param(
            lambda: PoolConfig(QueuePolicy(), {A: _bad(capacity="1", total_context_tokens="x", enabled="yes")}, {}),
            (
                "providers[node-a/gpu0].capacity: must be an integer, got '1'",
                "providers[node-a/gpu0].total_context_tokens: must be an integer, got 'x'",
                "providers[node-a/gpu0].enabled: must be true or false, got 'yes'",
            ),
            id="a spec's field of the wrong type",
        ),
        pytest.param(
            lambda: PoolConfig(QueuePolicy(), {A: _bad(long_context_capacity=-1, context_window_tokens=-1)}, {}),
            (
                "providers[node-a/gpu0].long_context_capacity: must be >= 0, got -1",
                "providers[node-a/gpu0].context_window_tokens: must be >= 0, got -1",
                "providers[node-a/gpu0].total_context_tokens: must equal context_window_tokens * long_context_capacity = -1 * -1 = 1, got 32768",
            ),
            id="a spec's counts below 0",
        ),
        pytest.param(
            lambda: PoolConfig(QueuePolicy(), {A: _bad(capacity=0, long_context_capacity=1)}, {}),
            (
                "providers[node-a/gpu0].capacity: must be >= 1, got 0",
                "providers[node-a/gpu0].long_context_capacity: must be <= capacity (1 > 0)",
            ),
            id="a long slot on a provider of no capacity",
        ),
        pytest.param(
            lambda: PoolConfig(
                "p",
                {"k1": GOOD, A: "s1", "k2": GOOD, B: GOOD, C: "s2"},
                {"": "g", "m": "g1", "n": "g2"},
                retry="r",
                outlier="o",
                tenants=("t", TenantSpec("a"), TenantSpec("a")),
            ),
            (
                "policy: expected QueuePolicy, got str",
                "retry: expected RetryPolicy, got str",
                "outlier: expected OutlierPolicy, got str",
                "providers: key 'k1' is not a ProviderKey",
                "providers[node-a/gpu0]: expected ProviderSpec, got str",
                "providers: key 'k2' is not a ProviderKey",
                "providers[node-b/gpu2]: expected ProviderSpec, got str",
                "models: key '' must be a non-empty string",
                "models['m']: expected ModelGroup, got str",
                "models['n']: expected ModelGroup, got str",
                "tenants[0]: expected TenantSpec, got str",
                "tenants[2]: tenant 'a' is listed twice",
            ),
            id="every part of the wrong type, each loop going on past a problem",
        ),
        pytest.param(
            lambda: PoolConfig(QueuePolicy(), {A: GOOD, B: GOOD, C: _bad(capacity=-1)}, {}),
            (
                "providers[node-b/gpu2].capacity: must be >= 1, got -1",
                "providers[node-b/gpu2].long_context_capacity: must be <= capacity (1 > -1)",
            ),
            id="a spec shared by two providers checked once, the next one still checked",
        ),
    ],
)
def test_a_pool_is_refused_with_every_problem(build: Callable[[], PoolConfig], problems: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as caught:
        validate_pool(build())
    assert caught.value.problems == problems
    assert str(caught.value) == "; ".join(problems)


@pytest.mark.parametrize(
    ("build", "problems"),
    [
        pytest.param(
            lambda: QueuePolicy(max_queue=-1, queue_timeout=0),
            (
                "policy.max_queue: must be an integer >= 0, got -1",
                "policy.queue_timeout: must be a finite number of seconds > 0, got 0",
            ),
            id="a negative queue bound, no time",
        ),
        pytest.param(
            lambda: QueuePolicy(max_queue="3", queue_timeout=float("inf")),
            (
                "policy.max_queue: must be an integer >= 0, got '3'",
                "policy.queue_timeout: must be a finite number of seconds > 0, got inf",
            ),
            id="a bound that is a string, an endless time",
        ),
        pytest.param(
            lambda: RetryPolicy(max_attempts=0),
            ("retry.max_attempts: must be an integer >= 1, got 0",),
            id="no attempt at all",
        ),
        pytest.param(
            lambda: RetryPolicy(max_attempts="2"),
            ("retry.max_attempts: must be an integer >= 1, got '2'",),
            id="attempts as a string",
        ),
        pytest.param(
            lambda: OutlierPolicy(consecutive_failures=-1, base_ejection=True, max_ejection=-2.0),
            (
                "outlier.consecutive_failures: must be an integer >= 0, got -1",
                "outlier.base_ejection: must be a finite number of seconds > 0, got True",
                "outlier.max_ejection: must be a finite number of seconds > 0, got -2.0",
            ),
            id="failures below 0, a bool for seconds, a negative cap",
        ),
        pytest.param(
            lambda: OutlierPolicy(consecutive_failures=1, base_ejection=10.0, max_ejection=5.0),
            ("outlier.max_ejection: must be >= base_ejection (5.0 < 10.0)",),
            id="a cap below the base",
        ),
        pytest.param(
            lambda: OutlierPolicy(consecutive_failures="1"),
            ("outlier.consecutive_failures: must be an integer >= 0, got '1'",),
            id="failures as a string",
        ),
    ],
)
def test_a_policy_refuses_itself_with_every_problem(build: Callable[[], object], problems: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as caught:
        build()
    assert caught.value.problems == problems


def test_what_is_not_a_pool_or_a_candidate_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"^expected PoolConfig, got str$"):
        validate_pool("x")
    with pytest.raises(TypeError) as caught:
        ModelGroup("abc")  # type: ignore[arg-type]
    assert str(caught.value) == (
        "ModelGroup candidates must be an iterable of ProviderKey, not a string ('abc'): "
        "write ModelGroup([ProviderKey(node_id, provider_id)])"
    )
    with pytest.raises(TypeError, match=r"^ModelGroup candidate \('node-a', 'gpu0'\) is a tuple, not a ProviderKey$"):
        ModelGroup((("node-a", "gpu0"),))  # type: ignore[arg-type]


def test_a_long_streak_of_ejections_stays_at_the_cap() -> None:
    """The doubling is bounded (2 ** 64 at most) before the cap: no overflow at any streak."""
    policy = OutlierPolicy(consecutive_failures=1, base_ejection=1e-300, max_ejection=1e300)
    assert policy.ejection_time(66) == 1e-300 * 2.0**64


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (ConfigError([]), "invalid configuration"),
        (ConfigError(["a", "b"]), "a; b"),
        (NodeNotFound("x", ()), "node 'x' has no configured provider; nodes with providers: none"),
        (NodeNotFound("x", ("n0", "n1")), "node 'x' has no configured provider; nodes with providers: 'n0', 'n1'"),
        (
            NodeNotFound("x", tuple(f"n{i}" for i in range(10))),
            "node 'x' has no configured provider; nodes with providers: " + ", ".join(f"'n{i}'" for i in range(10)),
        ),
        (
            NodeNotFound("x", tuple(f"n{i}" for i in range(11))),
            "node 'x' has no configured provider; nodes with providers: "
            + ", ".join(f"'n{i}'" for i in range(10))
            + ", ...",
        ),
        (ModelNotFound("m"), "model 'm' is not configured"),
        (QueueFull("m", 3), "queue full (3 waiting); model 'm'"),
        (LeaseRevoked(7, "node-a", 2), "lease 7 revoked: node 'node-a' generation 2 was fenced"),
        (ConcurrencyLimitExceeded("gpu0", "provider", 4), "concurrency limit reached for 'gpu0' (provider limit 4)"),
        (RetriesExhausted("m", 2), "no retry left for model 'm' after 2 attempts"),
        (Unavailable("m"), "no eligible provider for request on model 'm'"),
        (Unavailable("m", True, ("r1", "r2")), "no eligible provider for long request on model 'm'; r1; r2"),
    ],
)
def test_each_error_says_what_happened(error: Exception, message: str) -> None:
    assert str(error) == message


def test_errors_keep_what_they_name() -> None:
    revoked = LeaseRevoked(7, "node-a", 2)
    assert (revoked.lease_id, revoked.node_id, revoked.generation) == (7, "node-a", 2)
    assert NodeNotFound("x", ("n0",)).node_id == "x"


def test_unavailable_names_a_disabled_candidate_and_one_without_long_slots() -> None:
    """The reasons of an ``Unavailable``: a disabled provider says so, one without long slots says so
    to a long request; each reason names its provider."""
    from iop_admission.core import AdmissionState

    off = ProviderSpec(
        capacity=1, long_context_capacity=1, context_window_tokens=1, total_context_tokens=1, enabled=False
    )
    short_only = ProviderSpec(capacity=1, long_context_capacity=0, context_window_tokens=1, total_context_tokens=0)
    state = AdmissionState(
        PoolConfig(
            QueuePolicy(),
            {A: off, B: short_only},
            {"m": ModelGroup(candidates=(A, B))},
        )
    )
    state.connect("node-a")
    with pytest.raises(Unavailable) as caught:
        state.request("m", True, 0.0)
    assert caught.value.reasons == (
        "node-a/gpu0: disabled (enabled=False)",
        "node-a/gpu1: runs no long requests (long_context_capacity=0)",
    )
