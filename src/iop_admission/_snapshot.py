"""The reading side of admission state: the core's queries, and the frozen views they return.

:class:`StateReadings` is what :class:`~iop_admission.core.AdmissionState` answers without
changing anything; the snapshots are the views served by the Edge's ``/status``:
``cattrs.unstructure(snapshot)`` is the JSON document; field names are a contract.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, final

import attrs

if TYPE_CHECKING:
    from iop_admission._config import PoolConfig
    from iop_admission._core.health import Health
    from iop_admission._core.pool import Pool
    from iop_admission._core.queue import Queue
    from iop_admission._core.records import Lease, Waiter
    from iop_admission._core.refresh import Refresh
    from iop_admission._core.tenants import Tenants


@final
@attrs.frozen
class ProviderSnapshot:
    """One provider as admission sees it right now.

    ``queued`` / ``long_queued`` are *candidate pressure*: the number of waiters
    (all / long only) for which this provider is an eligible candidate. A waiter
    with three eligible candidates counts at each of them, so the sum over
    providers can exceed :attr:`Snapshot.queue_depth`, the true queue length.
    An offline or disabled provider reports 0 for effective capacities and
    pressure; ``in_flight`` always equals its live leases plus the runs held
    elsewhere (``AdmissionState.hold``, ``Admission.hold``).

    Revoked, still running ([revoked-in-flight]): ``revoked_in_flight`` counts
    the leases fencing revoked (a ``disconnect`` or reconnect) whose body has
    not exited yet, ``revoked_long_in_flight`` the long ones among them. They
    are not in ``in_flight`` (a fenced generation reads 0 at once) but hold
    capacity: admission counts ``in_flight + revoked_in_flight`` against
    ``capacity`` (and the long ones against ``long_context_capacity``).

    A provider a refresh removed while it still had leases (live, or revoked
    and still running) stays listed, after the configured ones, with
    ``status`` ``"removed"`` until its last lease is released.

    Health ([outlier-ejection]): ``health`` is ``offline`` while the node is not
    connected, else ``ejected`` from an ejection until the provider is restored
    (its ejection time, then its probe), else ``online``. ``failures`` counts
    consecutive provider failures, ``ejection_left`` the seconds until the
    ejection time ends (0 when not ejected, when the probe is due, or when the
    ejection waits for a ``ready`` report), ``ejections`` and ``probes`` the
    totals since start. ``reported``, ``report_reason`` and ``reported_capacity``:
    the node's last health report of its current connection ([health-probe]:
    ``ready``, ``not_ready``, ``stalled``; "" when none); ``effective_capacity``
    is then at most ``reported_capacity``.

    Token budget ([token-ledger]): ``token_budget`` is the provider's
    ``total_context_tokens`` when it admits by tokens (None otherwise),
    ``reserved_tokens`` what its leases not released yet reserve (revoked ones
    still running included), ``token_headroom`` the tokens held for a
    waiter passed over too often (0 when none is). The engine's view ([token-ledger], The
    engine's view): ``reported_kv_use`` (0 to 1) and ``reported_preemptions`` as the node's last
    ``ready`` report of this connection gave them (None when it did not),
    ``effective_token_budget`` the budget admitted by: ``token_budget`` less what the engine's
    report cut (None without a budget).
    """

    node_id: str
    provider_id: str
    connected: bool
    status: str  # "available" | "unavailable" | "disabled" | "removed"
    health: str  # "online" | "offline" | "ejected"
    generation: int
    capacity: int
    long_context_capacity: int
    effective_capacity: int
    effective_long_capacity: int
    in_flight: int
    long_in_flight: int
    queued: int
    long_queued: int
    priority: int
    failures: int = 0
    ejection_left: float = 0.0
    ejections: int = 0
    probes: int = 0
    revoked_in_flight: int = 0
    revoked_long_in_flight: int = 0
    token_budget: int | None = None
    reserved_tokens: int = 0
    token_headroom: int = 0
    reported: str = ""
    report_reason: str = ""
    reported_capacity: int | None = None
    effective_token_budget: int | None = None
    reported_kv_use: float | None = None
    reported_preemptions: int | None = None


PROVIDER_FIELDS: tuple[str, ...] = tuple(a.name for a in attrs.fields(ProviderSnapshot))
""":class:`ProviderSnapshot`'s field names, in order."""

ProviderRow = dict[str, Any]
"""One provider's :class:`ProviderSnapshot` as a plain dict: each of :data:`PROVIDER_FIELDS`,
in order, to its value (what ``cattrs.unstructure`` makes of the object)."""


@final
@attrs.frozen
class TenantSnapshot:
    """One tenant ([tenant-fair-share]): its spec, its queue and leases, its share of recent grants.

    ``share`` is its part of the latest 1,000 grants (0 to 1); ``cost_charged``
    the cost charged to it so far (requests, or tokens after settlement).
    """

    name: str
    weight: float
    priority: int
    max_in_flight: int | None
    max_queue: int | None
    waiting: int
    in_flight: int
    grants: int
    share: float
    cost_charged: float


@attrs.frozen
class Snapshot:
    """The whole pool: the true global queue depth, the policy, and every configured provider.

    Providers appear in configuration order, including disconnected and disabled ones, then
    those a refresh removed that still have leases (``status`` ``"removed"``) until their last
    lease is released: while a lease runs, some row counts it.
    ``panic`` lists the model keys in panic mode: every eligible candidate is
    ejected, and requests are admitted to them anyway. ``tenants``: one row per
    tenant when tenants are configured (empty otherwise).
    """

    queue_depth: int
    max_queue: int
    queue_timeout: float
    events_dropped: int
    providers: tuple[ProviderSnapshot, ...]
    panic: tuple[str, ...] = ()
    tenants: tuple[TenantSnapshot, ...] = ()

    def provider(self, node_id: str, provider_id: str) -> ProviderSnapshot:
        """Return the snapshot of one provider.

        Raises:
            KeyError: the provider is not listed (not configured, nor removed with leases left).
        """
        for p in self.providers:
            if p.node_id == node_id and p.provider_id == provider_id:
                return p
        raise KeyError(f"{node_id}/{provider_id}")


class StateReadings:
    """The queries of the admission core: what its parts hold now, read without changing them.

    :class:`~iop_admission.core.AdmissionState` is this plus the calls that change the state,
    as ``MutableMapping`` is ``Mapping`` plus its writes; it passes in its parts and moves
    ``_now`` forward, the latest time it was given (the default ``now`` of the snapshots).

    Args:
        pool: slots and choice; queue: the waiting; tenants: tenancy; health: ejections;
        refresh: the configuration in force.
    """

    def __init__(self, pool: Pool, queue: Queue, tenants: Tenants, health: Health, refresh: Refresh) -> None:
        self._pool = pool
        self._queue = queue
        self._tenants = tenants
        self._health = health
        self._refresh = refresh
        self._now = 0.0  # the latest time passed in

    @property
    def config(self) -> PoolConfig:
        """The configuration in force."""
        return self._refresh.config

    @property
    def queue_depth(self) -> int:
        """True number of queued waiters (all model groups)."""
        return len(self._queue.waiters)

    @property
    def last_time(self) -> float:
        """The latest ``now`` passed to any method."""
        return self._now

    def waiters(self) -> Iterator[Waiter]:
        """Queued waiters in arrival order."""
        return iter(tuple(self._queue.waiters.values()))

    def live_leases(self) -> Iterator[Lease]:
        """Every live lease (granted, not revoked nor released), including those on providers removed by refresh."""
        return self._pool.live_leases()

    def revoked_running(self) -> Iterator[Lease]:
        """Every revoked lease not released yet: its body has not exited, its capacity still counts
        ([revoked-in-flight])."""
        return self._pool.revoked_running()

    def generation(self, node_id: str) -> int:
        """Current generation of a node (0 if it never connected)."""
        node = self._pool.nodes.get(node_id)
        return node.generation if node else 0

    def knows_node(self, node_id: str) -> bool:
        """Whether some configuration in force so far had a provider on ``node_id``."""
        return node_id in self._pool.nodes

    def nodes(self) -> tuple[str, ...]:
        """The node ids of the configuration in force, in provider order."""
        return tuple(dict.fromkeys(k.node_id for k in self._refresh.config.providers))

    def is_connected(self, node_id: str) -> bool:
        """Whether the node is connected in its current generation."""
        node = self._pool.nodes.get(node_id)
        return bool(node and node.connected)

    def provider_snapshots(
        self, now: float | None = None, first: int = 0, count: int | None = None
    ) -> tuple[ProviderSnapshot, ...]:
        """Per configured provider, in configuration order, then each provider a refresh removed
        that still has leases, marked ``"removed"`` (see ProviderSnapshot).

        ``ejection_left`` counts from ``now``, by default the latest time passed in.
        ``first``/``count``: only the providers at those positions of the order; the removed
        ones come with the slice that reaches the end of it.
        """
        now = self._now if now is None else now
        values = self._pool.provider_values(now, first, count, self._queue.retry_pressure())
        return tuple(ProviderSnapshot(*row) for row in values)

    def provider_rows(self, now: float | None = None, first: int = 0, count: int | None = None) -> list[ProviderRow]:
        """:meth:`provider_snapshots` as plain dicts (see :data:`ProviderRow`), without the objects."""
        now = self._now if now is None else now
        values = self._pool.provider_values(now, first, count, self._queue.retry_pressure())
        return [dict(zip(PROVIDER_FIELDS, row, strict=True)) for row in values]

    def tenant_snapshots(self) -> tuple[TenantSnapshot, ...]:
        """One row per tenant (see TenantSnapshot); empty without tenants."""
        return self._tenants.rows()

    def next_ejection_end(self) -> float | None:
        """The earliest time an ejection ends (pass it to :meth:`AdmissionState.advance <iop_admission.core.AdmissionState.advance>`), or None."""
        return self._health.next_ejection_end()

    def panic_models(self) -> tuple[str, ...]:
        """Model keys in panic mode: every eligible candidate is ejected or probing."""
        return self._pool.panic_models()
