"""What ``prepare_refresh`` finds changed, as its repr shows it, and the pauses it gives way in.

Configurations loaded anew hold equal but distinct specs and provider keys: they are not
changes. A refresh that adds a provider as it removes two others finds both removals.
"""

from __future__ import annotations

import pytest

from iop_admission import ModelGroup, PoolConfig, ProviderKey, ProviderSpec
from iop_admission.core import AdmissionState, Lease, prepare_refresh

SPEC = ProviderSpec(capacity=2, long_context_capacity=1)


def _key(node: str) -> ProviderKey:
    return ProviderKey(node, "gpu")


def _config(nodes: tuple[str, ...], spec: ProviderSpec = SPEC) -> PoolConfig:
    """One provider per node (each spec built anew from ``spec``), model m listing them all."""
    providers = {_key(n): ProviderSpec(spec.capacity, spec.long_context_capacity) for n in nodes}
    return PoolConfig(providers=providers, models={"m": ModelGroup(tuple(_key(n) for n in nodes))})


@pytest.mark.req("reload-off-loop")
def test_a_configuration_loaded_anew_unchanged_prepares_no_change() -> None:
    base = _config(("a", "b"))
    again = _config(("a", "b"))
    assert again.providers is not base.providers and again.providers == base.providers
    assert repr(prepare_refresh(again, base)) == "<PreparedRefresh +0 ~0 -0 providers, 0 model groups new or changed>"


@pytest.mark.req("reload-off-loop")
def test_a_spec_changed_is_the_only_change_prepared() -> None:
    base = _config(("a", "b"))
    target = PoolConfig(
        providers={**_config(("a", "b")).providers, _key("b"): ProviderSpec(capacity=3, long_context_capacity=1)},
        models=_config(("a", "b")).models,
    )
    assert repr(prepare_refresh(target, base)) == "<PreparedRefresh +0 ~1 -0 providers, 0 model groups new or changed>"


@pytest.mark.req("reload-off-loop", "refresh-consistency")
def test_one_provider_added_as_two_are_removed_prepares_both_removals() -> None:
    """From gpu a and b to c alone (as many providers less as added, twice over): both a and b are
    removed, and the prepared refresh applies it: m's request goes to c, a and b take no new work."""
    base = _config(("a", "b"))
    target = _config(("c",))
    prepared = prepare_refresh(target, base)
    assert repr(prepared) == "<PreparedRefresh +1 ~0 -2 providers, 1 model groups new or changed>"
    state = AdmissionState(base)
    for node in ("a", "b", "c"):
        state.connect(node)
    assert state.refresh(state.prepare_refresh(target)) == []
    assert [p.node_id for p in state.provider_snapshots()] == ["c"]
    for _ in range(2):
        lease = state.request("m", False, 0.0)
        assert isinstance(lease, Lease) and lease.provider == _key("c")


@pytest.mark.req("reload-off-loop")
def test_prepare_refresh_pauses_in_the_scan_for_removed_providers() -> None:
    """From 200 providers to 100: the scan of the 200 for the removed ones gives way every
    PAUSE_EVERY (64) of them, 4 times, besides the validation and the other comparisons."""
    nodes = tuple(f"n{i}" for i in range(200))
    base, target = _config(nodes), _config(nodes[:100])
    calls: list[None] = []
    prepared = prepare_refresh(target, base, lambda: calls.append(None))
    assert repr(prepared) == "<PreparedRefresh +0 ~0 -100 providers, 1 model groups new or changed>"
    # validation: 100 providers (2 calls) and 100 candidates (2); the new providers against the
    # old (2); the removed scan over the 200 old ones (4); m's candidates to the first difference (2)
    assert len(calls) == 2 + 2 + 2 + 4 + 2
