"""[token-ledger] The ledger's edges: a refresh that moves a pinned waiter off a provider.

Sans-I/O, exact steps; patience 0 (``TokenLedger.PATIENCE``) where a pin is wanted at the first pass.
"""

from __future__ import annotations

import pytest
from tests.admission.steps import as_lease as _lease
from tests.admission.steps import as_waiter as _waiter
from tests.admission.steps import connected, grants

from iop_admission import ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy
from iop_admission.core import AdmissionState, TokenLedger

pytestmark = pytest.mark.req("token-ledger")

A = ProviderKey("node-a", "gpu0")
B = ProviderKey("node-b", "gpu1")


def _tokens(budget: int = 100, window: int = 0) -> ProviderSpec:
    return ProviderSpec(capacity=8, context_window_tokens=window, total_context_tokens=budget, admit_by="tokens")


def _config(*specs: ProviderSpec, x: tuple[ProviderKey, ...] = (A, B)) -> PoolConfig:
    """Model ``x`` on the providers ``x`` names (of those given), ``a`` on A alone, ``b`` on B alone."""
    keys = (A, B)[: len(specs)]
    return PoolConfig(
        policy=QueuePolicy(max_queue=8, queue_timeout=60.0),
        providers=dict(zip(keys, specs, strict=True)),
        models={"x": ModelGroup(x[: len(keys)]), **{key.node_id[-1]: ModelGroup((key,)) for key in keys}},
    )


def _state(*specs: ProviderSpec) -> AdmissionState:
    return connected(_config(*specs))


def _headroom(state: AdmissionState) -> list[int]:
    return [row.token_headroom for row in state.provider_snapshots()]


def test_a_refresh_that_takes_a_provider_off_a_pinned_waiter_gives_its_headroom_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 50 of ``x`` waits behind a 60 on A and on B, pinned on both by a 10 granted past it on
    each; a 20 of ``a`` waits beside the 50 held on A. A refresh leaves ``x`` on B alone: the 50
    waits on, but it can no longer run on A, so A holds nothing for it and the refresh grants the
    20 (60 + 10 + 20). B still holds its 50, until it leaves."""
    monkeypatch.setattr(TokenLedger, "PATIENCE", 0)
    spec = _tokens()
    state = _state(spec, spec)
    _lease(state.request("a", False, 0.0, tokens=60))
    _lease(state.request("b", False, 0.0, tokens=60))
    big = _waiter(state.request("x", False, 0.0, tokens=50))
    _lease(state.request("a", False, 0.0, tokens=10))
    _lease(state.request("b", False, 0.0, tokens=10))
    assert _headroom(state) == [50, 50]
    small = _waiter(state.request("a", False, 0.0, tokens=20))
    assert grants(state.refresh(_config(spec, spec, x=(B,)))) == [(small, A)]
    assert big.state.value == "queued" and _headroom(state) == [0, 50]
    assert state.withdraw(big) and _headroom(state) == [0, 0]
