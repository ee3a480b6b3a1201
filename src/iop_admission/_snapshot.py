"""Frozen views of admission state, as served by the Edge's ``/status``.

``cattrs.unstructure(snapshot)`` is the JSON document; field names are a contract.
"""

from __future__ import annotations

from typing import Any, final

import attrs


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
    waiter passed over too often (0 when none is).
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
