"""Reading the admission core: queue, leases, nodes and per-provider rows."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from iop_admission._config import PoolConfig, ProviderKey
from iop_admission._snapshot import PROVIDER_FIELDS, ProviderRow, ProviderSnapshot

from .records import Lease, Waiter
from .shared import StateCore
from .slots import EJECTED, HEALTHY, ProviderSlot


class StateQueries(StateCore):
    """The read side of :class:`~iop_admission.core.AdmissionState`."""

    @property
    def config(self) -> PoolConfig:
        """The configuration in force."""
        return self._config

    @property
    def queue_depth(self) -> int:
        """True number of queued waiters (all model groups)."""
        return len(self._waiters)

    def waiters(self) -> Iterator[Waiter]:
        """Queued waiters in arrival order."""
        return iter(tuple(self._waiters.values()))

    def live_leases(self) -> Iterator[Lease]:
        """Every live lease (granted, not revoked nor released), including those on providers removed by refresh."""
        for p in self._providers.values():
            yield from tuple(p.leases.values())

    def revoked_running(self) -> Iterator[Lease]:
        """Every revoked lease not released yet: its body has not exited, its capacity still counts
        ([revoked-in-flight])."""
        for p in self._providers.values():
            yield from tuple(p.revoked.values())

    def generation(self, node_id: str) -> int:
        """Current generation of a node (0 if it never connected)."""
        node = self._nodes.get(node_id)
        return node.generation if node else 0

    def knows_node(self, node_id: str) -> bool:
        """Whether some configuration in force so far had a provider on ``node_id``."""
        return node_id in self._nodes

    def nodes(self) -> tuple[str, ...]:
        """The node ids of the configuration in force, in provider order."""
        return tuple(dict.fromkeys(k.node_id for k in self._config.providers))

    def is_connected(self, node_id: str) -> bool:
        """Whether the node is connected in its current generation."""
        node = self._nodes.get(node_id)
        return bool(node and node.connected)

    @property
    def last_time(self) -> float:
        """The latest ``now`` passed to any method."""
        return self._now

    def provider_snapshots(
        self, now: float | None = None, first: int = 0, count: int | None = None
    ) -> tuple[ProviderSnapshot, ...]:
        """Per configured provider, in configuration order, then each provider a refresh removed
        that still has leases, marked ``"removed"`` (see ProviderSnapshot).

        ``ejection_left`` counts from ``now``, by default the latest time passed in.
        ``first``/``count``: only the providers at those positions of the order; the removed
        ones come with the slice that reaches the end of it.
        """
        return tuple(ProviderSnapshot(*values) for values in self._provider_values(now, first, count))

    def provider_rows(self, now: float | None = None, first: int = 0, count: int | None = None) -> list[ProviderRow]:
        """:meth:`provider_snapshots` as plain dicts (see :data:`ProviderRow`), without the objects."""
        return [dict(zip(PROVIDER_FIELDS, values, strict=True)) for values in self._provider_values(now, first, count)]

    def _provider_values(self, now: float | None, first: int, count: int | None) -> Iterator[tuple[Any, ...]]:
        """Each provider's :class:`ProviderSnapshot` field values, in field order."""
        now = self._now if now is None else now
        retried = self._retry_pressure()
        for p in self._listed(first, count):
            spec = p.spec
            queued, long_queued = p.queued() if p.eligible else (0, 0)
            if p.key in retried:
                queued, long_queued = queued + retried[p.key][0], long_queued + retried[p.key][1]
            connected = p.node.connected
            eligible = p.eligible
            if not p.configured:
                status = "removed"
            elif not spec.enabled:
                status = "disabled"
            else:
                status = "available" if connected else "unavailable"
            if not connected:
                health = "offline"
            else:
                health = "online" if p.health is HEALTHY else "ejected"
            yield (
                p.key.node_id,
                p.key.provider_id,
                connected,
                status,
                health,
                p.node.generation,
                spec.capacity,
                spec.long_context_capacity,
                spec.capacity if eligible else 0,
                spec.long_context_capacity if eligible else 0,
                p.in_flight - len(p.revoked),
                p.long_in_flight - p.revoked_long,
                queued,
                long_queued,
                spec.priority,
                p.failures,
                max(0.0, p.ejected_until - now) if p.health is EJECTED else 0.0,
                p.ejections,
                p.probes,
                len(p.revoked),
                p.revoked_long,
            )

    def _listed(self, first: int, count: int | None) -> Iterator[ProviderSlot]:
        """The configured providers at ``first``/``count`` of the order; with the slice that
        reaches its end, the providers a refresh removed that still have leases."""
        configured = self._configured
        end = len(configured) if count is None else first + count
        yield from configured[first:end]
        if end >= len(configured) and len(self._providers) > len(configured):
            yield from (p for p in self._providers.values() if not p.configured)

    def _retry_pressure(self) -> dict[ProviderKey, tuple[int, int]]:
        """Candidate pressure of queued retries: (waiters, of which long) per provider."""
        out: dict[ProviderKey, tuple[int, int]] = {}
        for w in self._retries:
            for p in w._candidates:
                if p.eligible and (not w.long or p.long_capacity >= 1):
                    n, n_long = out.get(p.key, (0, 0))
                    out[p.key] = (n + 1, n_long + w.long)
        return out

    # ------------------------------------------------------------------ requests
