"""The token-budget configurations the ledger's tests share ([token-ledger]): providers admitted by
their context tokens alone, and pools of them on two nodes."""

from __future__ import annotations

from collections.abc import Mapping

from iop_admission import ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy

__all__ = ["A", "B", "token_pool", "tokens_spec"]

A = ProviderKey("node-a", "gpu0")
B = ProviderKey("node-b", "gpu1")


def tokens_spec(budget: int = 100, window: int = 0, capacity: int = 8) -> ProviderSpec:
    """A provider admitted by tokens: ``budget`` tokens of context, a long request's ``window``, ``capacity`` slots."""
    return ProviderSpec(capacity=capacity, context_window_tokens=window, total_context_tokens=budget, admit_by="tokens")


def token_pool(
    *specs: ProviderSpec,
    models: Mapping[str, tuple[ProviderKey, ...]] | None = None,
    max_queue: int = 8,
    queue_timeout: float = 60.0,
) -> PoolConfig:
    """``specs`` on :data:`A`, then :data:`B`; each model key of ``models`` on its candidates (by
    default one, ``m``, on all of them)."""
    keys = (A, B)[: len(specs)]
    groups = {"m": keys} if models is None else models
    return PoolConfig(
        QueuePolicy(max_queue=max_queue, queue_timeout=queue_timeout),
        dict(zip(keys, specs, strict=True)),
        {name: ModelGroup(candidates) for name, candidates in groups.items()},
    )
