"""The node runtime: one :class:`~iop_admission.LocalGate` in front of every adapter.

[runtime-concurrency] [tunnel-guard]: every run -- normalized or tunnel,
foreground (from the Edge) or background (:meth:`NodeRuntime.run_background`)
-- takes a permit from the ONE gate of the node before its adapter opens an
upstream request. The gate has a limit per provider (its ``capacity``) and a
node-wide limit (``runtime.concurrency``). No permit free means the run is
refused at once with ``concurrency_limit``; the node never queues, the Edge
owns the one fair queue.

:meth:`NodeRuntime.admit` is synchronous on purpose: the session takes the
permit in its message dispatch, before it spawns the run task, and hands the
permit to that task, which returns it exactly once (``with permit:``).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from contextlib import aclosing
from types import TracebackType
from typing import Any, final

import attrs
import httpx
import trio

from iop_admission import LocalGate, Permit
from iop_node._errors import BadRunRequest, UpstreamFailed
from iop_node.adapters.interface import Adapter
from iop_node.adapters.mock import MockAdapter
from iop_node.adapters.ollama import OllamaAdapter
from iop_node.adapters.openai_compat import OpenAIAdapter
from iop_node.config import NodeConfig, ProviderConfig
from iop_node.edges.fence import EpochFence, RunEnds
from iop_node.health.progress import Progress
from iop_node.health.watcher import HealthWatcher

_CLOSE_TIMEOUT = 1.0


def build_adapter(provider: ProviderConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> Adapter:
    """Build the adapter named by ``provider.adapter``.

    Args:
        provider: the provider's config (already validated).
        transport: replaces the network transport of HTTP adapters (tests).
    """
    if provider.adapter == "openai":
        return OpenAIAdapter.from_config(provider, transport=transport)
    if provider.adapter == "ollama":
        return OllamaAdapter.from_config(provider, transport=transport)
    if provider.adapter == "mock":
        return MockAdapter.from_config(provider)
    raise ValueError(f"unknown adapter {provider.adapter!r}")


@final
@attrs.define(eq=False)
class NodeRuntime:
    """The node's adapters behind its one gate.

    Use as ``async with NodeRuntime.from_config(cfg) as runtime:`` so the
    adapters' connection pools are closed at the end.

    Attributes:
        gate: the node's only gate: ``limits={provider id: capacity}``,
            ``global_limit=runtime.concurrency``.
        adapters: adapter per provider id.
        fence: the highest leader epoch seen on any connection [epoch-fencing].
        run_ends: the end of any run, which the ``in_flight`` reports wait for [held-elsewhere].
        long_runs: long runs in flight per provider, every connection's (a run
            marked ``long``): reported to a new leader [held-elsewhere].
        progress: runs in flight and chunks received per provider, for the stall
            watchdog (:mod:`iop_node.health.progress`).
        health: the providers' health watcher [health-probe] (None: not watched).
    """

    gate: LocalGate
    adapters: Mapping[str, Adapter]
    fence: EpochFence = attrs.field(factory=EpochFence)
    run_ends: RunEnds = attrs.field(factory=RunEnds)
    long_runs: Counter[str] = attrs.field(factory=Counter)
    progress: defaultdict[str, Progress] = attrs.field(factory=lambda: defaultdict(Progress))
    health: HealthWatcher | None = None

    @classmethod
    def from_config(cls, config: NodeConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> NodeRuntime:
        """Build the gate, one adapter (one HTTP pool) per provider and the health watcher."""
        gate = LocalGate(
            limits={p.id: p.capacity for p in config.providers},
            global_limit=config.runtime.concurrency,
        )
        adapters = {p.id: build_adapter(p, transport=transport) for p in config.providers}
        runtime = cls(gate=gate, adapters=adapters)
        runtime.health = HealthWatcher.from_config(
            config, runtime.progress, canary=runtime.run_background, transport=transport
        )
        return runtime

    def admit(self, provider: str, epoch: int | None = None) -> tuple[Permit, Adapter]:
        """Take a permit for ``provider`` now, or fail at once. Does not checkpoint.

        ``epoch``: the sending leader's (docs/wire.md, Epoch fencing), checked against :attr:`fence` first.

        Returns:
            The held permit (the caller must release it exactly once, e.g. with
            ``with permit:``) and the provider's adapter.

        Raises:
            StaleEpoch: ``epoch`` is older than one this node has seen.
            BadRunRequest: ``provider`` is not configured on this node.
            iop_admission.ConcurrencyLimitExceeded: the provider's capacity or
                the node-wide concurrency is used up.
        """
        self.fence.check(epoch)
        adapter = self.adapters.get(provider)
        if adapter is None:
            raise BadRunRequest(f"unknown provider {provider!r}")
        return self.gate.try_acquire(provider), adapter

    def in_flight(self) -> tuple[tuple[str, int], ...]:
        """``(provider, permits held)`` for every provider with runs in flight, whichever Edge sent them."""
        return tuple((name, used) for name, used in self.gate.statistics().in_use.items() if used)

    async def run_background(self, provider: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        """Run one node-initiated, non-stream request (e.g. a warm-up) through the gate.

        The permit is taken before anything else, like for runs from the Edge,
        and returned when the upstream request is done. Checkpoints;
        cancellation closes the upstream request and returns the permit.

        Returns:
            The upstream's complete response object.

        Raises:
            iop_admission.ConcurrencyLimitExceeded: no permit free (raised at once).
            RunFailed: a :class:`BadRunRequest`, :class:`UpstreamUnreachable` or
                :class:`UpstreamFailed` from the adapter.
        """
        permit, adapter = self.admit(provider)
        with permit:
            async with aclosing(adapter.run(endpoint, {**body, "stream": False}, stream=False)) as events:
                async for response in events:
                    return response
        raise UpstreamFailed("upstream sent no response")

    async def aclose(self) -> None:
        """Close every adapter's connection pool.

        Checkpoints. Runs shielded and bounded, so it completes even while the
        caller is being cancelled.
        """
        with trio.CancelScope(shield=True), trio.move_on_after(_CLOSE_TIMEOUT):
            for adapter in self.adapters.values():
                await adapter.aclose()
            if self.health is not None:
                await self.health.aclose()

    async def __aenter__(self) -> NodeRuntime:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
