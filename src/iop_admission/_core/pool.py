"""The slots-and-choice part of the admission core: providers, nodes, model groups, and what leases hold.

:class:`Pool` owns one :class:`~.slots.ProviderSlot` per provider key (its
capacity, counters and health fields, shared by every model group listing it),
one :class:`~.slots.NodeState` per node and the model groups with their choice
index. Whether a provider has room for a request -- what a grant may take --
is decided by its slot (``ProviderSlot.reindex`` for the groups' index,
``choice.choose`` for a scan); :meth:`Pool.take` and :meth:`Pool.give_back`
are the only places where a lease's share of a provider is counted in and out.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from iop_admission._config import PoolConfig, ProviderKey, ProviderSpec

from .records import Lease
from .slots import EJECTED, HEALTHY, ModelGroup, NodeState, ProviderSlot


class Pool:
    """The providers of the configuration in force (and removed ones with leases), nodes and model groups."""

    __slots__ = ("nodes", "providers", "configured", "groups")

    def __init__(self) -> None:
        self.nodes: dict[str, NodeState] = {}
        self.providers: dict[ProviderKey, ProviderSlot] = {}
        self.configured: tuple[ProviderSlot, ...] = ()  # in configuration order
        self.groups: dict[str, ModelGroup] = {}

    # ---------------------------------------------------------- configuration

    def install(self, config: PoolConfig) -> None:
        """Configure every provider of ``config`` and build every model group anew."""
        self.configured = tuple(self.configure(key, spec) for key, spec in config.providers.items())
        for p in self.providers.values():
            p.groups = []
            p.counted = p.long_counted = p.admit_counted = p.long_admit_counted = False
        groups = {}
        for name, model in config.models.items():
            group = ModelGroup(name, tuple(self.providers[k] for k in model.candidates))
            for position, p in enumerate(group.providers):
                p.groups.append((group, position))
            groups[name] = group
        self.groups = groups
        for p in self.providers.values():
            p.update_eligibility()

    def configure(self, key: ProviderKey, spec: ProviderSpec) -> ProviderSlot:
        """The provider ``key`` with ``spec``, configured: a new one, or the one kept (even retired)."""
        p = self.providers.get(key)
        if p is None:
            node = self.node(key.node_id)
            p = ProviderSlot(key, node, spec)
            self.providers[key] = p
            node.providers.append(p)
        else:
            p.set_spec(spec)
            p.configured = True
        return p

    def build_group(self, name: str, candidates: tuple[ProviderKey, ...]) -> ModelGroup:
        """A model group new in a refresh, counted and indexed from its candidates' state now."""
        group = ModelGroup(name, tuple(map(self.providers.__getitem__, candidates)))
        for position, p in enumerate(group.providers):
            group.link(p, position)
        group.heapify()
        return group

    def node(self, node_id: str) -> NodeState:
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = NodeState(node_id)
        return node

    def drop(self, p: ProviderSlot) -> None:
        """Forget a provider that left the config once nothing runs on it."""
        del self.providers[p.key]
        p.node.providers.remove(p)

    # ----------------------------------------------------------------- leases

    def take(self, lease: Lease) -> None:
        """Count a new lease in its provider's load, and its tokens in its budget if it has one
        ([token-ledger]; the index is not updated: ``reindex()`` next)."""
        p = lease._slot
        if p.budgeted:
            assert p.ledger is not None
            tokens, window = lease.tokens, p.window  # ProviderSlot.need(), inline: every grant
            if tokens is None or tokens < 0 or (window and tokens > window):
                tokens = p.need(tokens, lease.long)
            p.ledger.reserve(lease.id, tokens, lease.arrival)
        p.in_flight += 1
        if lease.long:
            p.long_in_flight += 1
        p.leases[lease.id] = lease

    def give_back(self, lease: Lease) -> None:
        """Count a released lease out of its provider's load (live or revoked, still running),
        and its tokens out of its budget."""
        slot = lease._slot
        if slot.ledger is not None:
            slot.ledger.release(lease.id)
        slot.in_flight -= 1
        if lease.long:
            slot.long_in_flight -= 1
        if lease._revoked:  # its body has left: the capacity fencing kept counted comes back
            del slot.revoked[lease.id]
            slot.revoked_long -= lease.long
        else:
            del slot.leases[lease.id]

    def hold(self, provider: ProviderKey, runs: int, long_runs: int) -> ProviderSlot | None:
        """Set the runs held elsewhere on ``provider``; the provider if a count went down (room freed).

        A provider not configured, or whose node is not connected, is left as it is.
        """
        slot = self.providers.get(provider)
        if slot is None or not slot.configured or not slot.node.connected:
            return None
        step, long_step = runs - slot.held, long_runs - slot.held_long
        if not step and not long_step:
            return None
        slot.held, slot.held_long = runs, long_runs
        slot.in_flight += step
        slot.long_in_flight += long_step
        slot.reindex()
        return slot if step < 0 or long_step < 0 else None

    # ---------------------------------------------------------------- reading

    def live_leases(self) -> Iterator[Lease]:
        for p in self.providers.values():
            yield from tuple(p.leases.values())

    def revoked_running(self) -> Iterator[Lease]:
        for p in self.providers.values():
            yield from tuple(p.revoked.values())

    def panic_models(self) -> tuple[str, ...]:
        return tuple(name for name, g in self.groups.items() if g.in_panic(False))

    def provider_values(
        self, now: float, first: int, count: int | None, retried: dict[ProviderKey, tuple[int, int]]
    ) -> Iterator[tuple[Any, ...]]:
        """Each provider's :class:`ProviderSnapshot` field values, in field order.

        ``retried``: the candidate pressure of queued retries, per provider.
        """
        for p in self._listed(first, count):
            spec = p.spec
            queued, long_queued = p.queued() if p.eligible else (0, 0)
            if p.key in retried:
                queued, long_queued = queued + retried[p.key][0], long_queued + retried[p.key][1]
            connected = p.node.connected
            eligible = p.eligible
            ledger = p.ledger
            yield (
                p.key.node_id,
                p.key.provider_id,
                connected,
                *_words(p),
                p.node.generation,
                spec.capacity,
                spec.long_context_capacity,
                p.capacity if eligible else 0,
                spec.long_context_capacity if eligible else 0,
                p.in_flight - len(p.revoked),
                p.long_in_flight - p.revoked_long,
                queued,
                long_queued,
                spec.priority,
                p.failures,
                max(0.0, p.ejected_until - now) if p.health is EJECTED and p.ejected_until != math.inf else 0.0,
                p.ejections,
                p.probes,
                len(p.revoked),
                p.revoked_long,
                spec.budget,
                ledger.reserved if ledger is not None else 0,
                ledger.headroom if ledger is not None else 0,
                p.reported,
                p.report_reason,
                p.reported_capacity,
                ledger.budget if ledger is not None and spec.budget is not None else None,
                p.reported_kv_use,
                p.reported_preemptions,
            )

    def _listed(self, first: int, count: int | None) -> Iterator[ProviderSlot]:
        """The configured providers at ``first``/``count`` of the order; with the slice that
        reaches its end, the providers a refresh removed that still have leases."""
        configured = self.configured
        end = len(configured) if count is None else first + count
        yield from configured[first:end]
        if end >= len(configured) and len(self.providers) > len(configured):
            yield from (p for p in self.providers.values() if not p.configured)

    def load(self) -> str:
        """``busy/capacity in flight`` over the configured providers, and the revoked still running."""
        revoked = sum(len(p.revoked) for p in self.providers.values())
        busy = sum(p.in_flight - len(p.revoked) for p in self.configured)
        cap = sum(p.capacity for p in self.configured if p.eligible)
        running = f" ({revoked} revoked still running)" if revoked else ""
        return f"{busy}/{cap} in flight{running}"


def _words(p: ProviderSlot) -> tuple[str, str]:
    """A provider's snapshot ``status`` and ``health``."""
    connected = p.node.connected
    if not p.configured:
        status = "removed"
    elif not p.spec.enabled:
        status = "disabled"
    else:
        status = "available" if connected else "unavailable"
    if not connected:
        return status, "offline"
    return status, "online" if p.health is HEALTHY else "ejected"
