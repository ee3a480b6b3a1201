"""The connectivity part of the admission core: node generations, and fencing the leases of one that ended."""

from __future__ import annotations

from collections.abc import Iterator

from .choice import groups_of
from .dispatch import Dispatcher
from .health import Health
from .pool import Pool
from .queue import Queue
from .records import Decision, Revoked
from .slots import NodeState
from .tenants import Tenants


class Connectivity:
    """Connects and disconnects nodes: a new generation brings their providers online, the end of
    one revokes its live leases ([revoked-in-flight]) and fails the waiters it strands."""

    __slots__ = ("_pool", "_queue", "_tenants", "_health", "_dispatcher")

    def __init__(self, pool: Pool, queue: Queue, tenants: Tenants, health: Health, dispatcher: Dispatcher) -> None:
        self._pool = pool
        self._queue = queue
        self._tenants = tenants
        self._health = health
        self._dispatcher = dispatcher

    def connect(self, node_id: str) -> tuple[int, list[Decision]]:
        """:meth:`AdmissionState.connect <iop_admission.core.AdmissionState.connect>`."""
        node = self._pool.node(node_id)
        decisions: list[Decision] = []
        if node.connected:
            decisions.extend(self._fence(node))
        node.generation += 1
        node.connected = True
        for p in node.providers:
            decisions.extend(self._health.new_connection(p))
            p.update_eligibility()
        # Fenced leases freed their tenants' slots: with tenants, any group may run now.
        groups = self._pool.groups.values() if self._tenants.tenancy else groups_of(node.providers)
        decisions.extend(self._dispatcher.dispatch(groups))
        return node.generation, decisions

    def disconnect(self, node_id: str, generation: int) -> tuple[bool, list[Decision]]:
        """:meth:`AdmissionState.disconnect <iop_admission.core.AdmissionState.disconnect>`."""
        node = self._pool.nodes.get(node_id)
        if node is None or not node.connected or node.generation != generation:
            return False, []
        node.connected = False
        decisions: list[Decision] = list(self._fence(node))
        for p in node.providers:
            p.update_eligibility()
        groups = groups_of(node.providers)
        decisions.extend(self._queue.fail_stranded(groups))
        if self._tenants.tenancy is not None:  # fenced leases freed their tenants' slots
            decisions.extend(self._dispatcher.dispatch(self._pool.groups.values()))
        elif self._health.unhealthy:  # groups left with only ejected candidates enter panic mode
            decisions.extend(self._dispatcher.dispatch(groups))
        return True, decisions

    def _fence(self, node: NodeState) -> Iterator[Revoked]:
        """Revoke every live lease of ``node``'s providers and drop their runs held elsewhere.

        A revoked lease keeps counting in ``in_flight`` (as revoked, still
        running) until its holder releases it [revoked-in-flight].
        """
        for p in tuple(node.providers):
            if not p.leases and not p.held:
                continue
            for lease in tuple(p.leases.values()):
                lease._revoked = True
                self._tenants.release_ticket(lease)
                if lease.probe and p.probe_lease == lease.id:
                    self._health.reopen_probe(p)
                p.revoked[lease.id] = lease
                p.revoked_long += lease.long
                yield Revoked(lease)
            p.leases.clear()
            p.forget_held()
            if not p.configured and not p.revoked:
                self._pool.drop(p)
            else:
                p.reindex()
