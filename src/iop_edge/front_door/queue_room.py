"""Whether admission would refuse a request ``queue_full``, with tenants: the head check's second look.

The front door's count (:meth:`~iop_edge.front_door.overload.FrontDoor.queue_full`) is
blind to tenants: it counts every request let through on its head and not yet
asking as if it were queued already. With tenants ([tenant-quotas]) admission
refuses a request ``queue_full`` only when the queue holds ``max_queue`` waiters,
the request's tenant is under its own ``max_queue`` (else the answer is
``tenant_max_queue``), its band is not negative (else ``tenant_shed``) and no
waiter of a negative band below it can be evicted for it. So a cold burst of a
sheddable flood beside another band, or of a tenant flooding up to its own
``max_queue`` beside a light one, reads as a full queue to that count while
admission would queue the other tenant's request. :func:`refuses_queue_full`
decides as admission would, from what is really queued (the tenants' rows) plus
what is in transit (let through on the head, not asking yet) per tenant: a
tenant's requests in transit fill the queue only up to its own ``max_queue``,
and a sheddable request queued or in transit is a waiter admission can evict.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from iop_admission import TenantSnapshot

DEFAULT_TENANT = "default"
"""The tenant admission charges a request to when it names none, or one not configured."""


def refuses_queue_full(
    tenant: str | None,
    rows: Iterable[TenantSnapshot],
    queue_depth: int,
    max_queue: int,
    transit: Mapping[str | None, int],
) -> bool:
    """Whether admission would refuse ``tenant``'s request ``queue_full`` once the requests in
    transit ahead of it have asked.

    Args:
        tenant: the request's tenant as the Edge names it (None or a name not
            configured: the default tenant).
        rows: one per configured tenant (``Snapshot.tenants``): band, quota, waiters.
        queue_depth: the waiters queued now (every tenant).
        max_queue: ``provider_pool.max_queue``.
        transit: requests let through on their heads and not asking yet, by tenant as
            the Edge names it.

    True only when the request's band is not negative, its tenant has room in
    its own ``max_queue`` even after its requests in transit, no waiter of a
    negative band is queued or in transit (one admission would evict for it),
    and the queue plus the requests in transit that can still queue (each
    tenant's up to its own ``max_queue``) hold ``max_queue``.
    """
    by_name = {row.name: row for row in rows}
    own = _row(tenant, by_name)
    if own is None or own.priority < 0:
        return False  # a sheddable request: admission queues it or answers tenant_shed
    moving: dict[str, int] = {}
    for name, count in transit.items():
        row = _row(name, by_name)
        if row is not None and count > 0:
            moving[row.name] = moving.get(row.name, 0) + count
    if own.max_queue is not None and own.waiting + moving.get(own.name, 0) >= own.max_queue:
        return False  # admission answers tenant_max_queue, with the tenant's own Retry-After
    for row in by_name.values():
        if row.priority < 0 and (row.waiting > 0 or moving.get(row.name, 0) > 0):
            return False  # admission evicts that waiter for this request
    arriving = 0
    for name, count in moving.items():
        row = by_name[name]
        room = count if row.max_queue is None else max(0, row.max_queue - row.waiting)
        arriving += min(count, room)
    return queue_depth + arriving >= max_queue


def _row(name: str | None, by_name: Mapping[str, TenantSnapshot]) -> TenantSnapshot | None:
    """The row of the tenant admission charges ``name``'s requests to."""
    if name is not None and name in by_name:
        return by_name[name]
    return by_name.get(DEFAULT_TENANT)
