"""Limits of the node socket before registration: pending caps and failure backoff.

Anyone who can reach ``node_listen`` can open connections to it. Until a
connection has registered it is *pending*: it holds a descriptor, a task and a
WebSocket reader, and proves nothing. :class:`PendingLimits` is the small pure
core that decides, per new connection and per failed registration:

- **Pending caps.** At most ``max_pending`` connections pending at once, and at
  most ``max_pending_per_source`` from one source (see :func:`source_of`); a
  connection beyond either is refused, and the listener closes it at once. A
  registered connection is released from the count the moment it registers,
  so registered nodes never count, and nothing here ever cuts one.
- **Failure backoff.** Each failed registration (``bad_token``,
  ``unknown_node``) from one source is answered later than the one before:
  ``min(backoff_max, backoff_base * 2**(failures - 1))`` seconds, where
  ``failures`` counts that source's failures with no more than
  ``backoff_forget`` seconds between one and the next. The table of sources
  is bounded (``max_tracked_sources``, least recently failed dropped first), so
  a flood from many addresses cannot grow it without end.

Like h11, it does no I/O and has no clock: time is passed in as ``now``. The
trio layer (:class:`~iop_edge.nodes.registry.NodeRegistry`) closes, sleeps and counts;
it never decides.
"""

from __future__ import annotations

import ipaddress
from typing import Final, Literal, final

import attrs

__all__ = ["PendingLimits", "PendingStatistics", "Refusal", "Source", "source_of"]

Refusal = Literal["max_pending", "max_pending_per_source"]
"""Why a new connection was refused: the overall cap or its source's cap was reached."""

IPV6_SOURCE_PREFIX: Final = 64
"""IPv6 sources are grouped by /64: one host usually holds a whole /64."""


@final
@attrs.frozen
class Source:
    """Where a connection comes from, as the limits see it.

    Attributes:
        key: the unit the per-source limits count: the IPv4 address, the IPv6
            /64 network, or ``"unknown"`` (not a socket, e.g. in-memory streams).
        address_class: ``loopback``, ``private``, ``public`` or ``unknown`` (a
            metrics label that never names an address).
    """

    key: str
    address_class: str


UNKNOWN_SOURCE: Final = Source("unknown", "unknown")


def source_of(host: str | None) -> Source:
    """The :class:`Source` of a peer address (``None`` or not an IP: unknown)."""
    if host is None:
        return UNKNOWN_SOURCE
    try:
        address = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return UNKNOWN_SOURCE
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_loopback:
        address_class = "loopback"
    elif address.is_private or address.is_link_local:
        address_class = "private"
    else:
        address_class = "public"
    if isinstance(address, ipaddress.IPv6Address):
        network = ipaddress.IPv6Network((address, IPV6_SOURCE_PREFIX), strict=False)
        return Source(str(network), address_class)
    return Source(str(address), address_class)


@final
@attrs.frozen
class PendingStatistics:
    """A snapshot of :class:`PendingLimits`.

    Attributes:
        pending: connections between accept and registration (or close).
        sources_pending: sources with at least one pending connection.
        sources_tracked: sources with a failure record (backoff state).
    """

    pending: int
    sources_pending: int
    sources_tracked: int


@attrs.define
class _Failures:
    count: int
    last: float


@final
class PendingLimits:
    """The pending caps and the failure backoff of one node socket (pure, no I/O).

    Args:
        max_pending: pending connections at once, all sources together (>= 1).
        max_pending_per_source: pending connections at once from one source (>= 1).
        backoff_base: seconds the first failure of a source is answered late.
        backoff_max: the bound of that delay, in seconds.
        backoff_forget: a source with no failure for this long starts again from
            its first failure. Defaults to ``4 * backoff_max``.
        max_tracked_sources: failure records kept at most.

    Every :meth:`open` that returned None must be matched by exactly one
    :meth:`release` of the same source.
    """

    def __init__(
        self,
        *,
        max_pending: int,
        max_pending_per_source: int,
        backoff_base: float = 0.1,
        backoff_max: float = 5.0,
        backoff_forget: float | None = None,
        max_tracked_sources: int = 10_000,
    ) -> None:
        self.max_tracked_sources = max_tracked_sources
        self.set_policy(
            max_pending=max_pending,
            max_pending_per_source=max_pending_per_source,
            backoff_base=backoff_base,
            backoff_max=backoff_max,
            backoff_forget=backoff_forget,
        )
        self._pending = 0
        self._by_source: dict[str, int] = {}
        self._failures: dict[str, _Failures] = {}

    def set_policy(
        self,
        *,
        max_pending: int,
        max_pending_per_source: int,
        backoff_base: float,
        backoff_max: float,
        backoff_forget: float | None = None,
    ) -> None:
        """Change the caps and the backoff (a config reload); the counts are kept.

        Lowering a cap below the current count refuses new connections until
        enough pending ones have ended; none is closed for it.

        Raises:
            ValueError: a cap below 1, or not ``0 <= backoff_base <= backoff_max``.
        """
        if max_pending < 1 or max_pending_per_source < 1:
            raise ValueError("max_pending and max_pending_per_source must be >= 1")
        if not 0 <= backoff_base <= backoff_max:
            raise ValueError("need 0 <= backoff_base <= backoff_max")
        self.max_pending = max_pending
        self.max_pending_per_source = max_pending_per_source
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.backoff_forget = 4 * backoff_max if backoff_forget is None else backoff_forget

    # ------------------------------------------------------------ pending caps

    def open(self, source: Source) -> Refusal | None:
        """A connection from ``source`` was accepted: count it, or say why it is refused.

        Returns:
            None if the connection is now pending (call :meth:`release` once it
            registers or closes); otherwise the reason to close it at once
            (nothing was counted).
        """
        if self._pending >= self.max_pending:
            return "max_pending"
        held = self._by_source.get(source.key, 0)
        if held >= self.max_pending_per_source:
            return "max_pending_per_source"
        self._pending += 1
        self._by_source[source.key] = held + 1
        return None

    def release(self, source: Source) -> None:
        """A pending connection from ``source`` registered or closed.

        Raises:
            RuntimeError: no connection from ``source`` is pending.
        """
        held = self._by_source.get(source.key, 0)
        if held <= 0:
            raise RuntimeError(f"release without open for source {source.key!r}")
        self._pending -= 1
        if held == 1:
            del self._by_source[source.key]
        else:
            self._by_source[source.key] = held - 1

    def pending_from(self, source: Source) -> int:
        """Pending connections from ``source`` now."""
        return self._by_source.get(source.key, 0)

    # --------------------------------------------------------------- backoff

    def failed(self, source: Source, now: float) -> float:
        """Record a failed registration from ``source``; return seconds to wait before answering.

        The n-th failure in a row waits ``min(backoff_max, backoff_base *
        2**(n - 1))``. A source silent for ``backoff_forget`` seconds starts
        again at n = 1.
        """
        record = self._failures.pop(source.key, None)
        if record is None or now - record.last >= self.backoff_forget:
            record = _Failures(0, now)
        record.count += 1
        record.last = now
        self._failures[source.key] = record  # re-inserted: the dict stays ordered by last failure
        self._forget(now)
        return min(self.backoff_max, self.backoff_base * (1 << min(record.count - 1, 62)))

    def failures(self, source: Source, now: float) -> int:
        """Failures in a row that count for ``source`` at ``now`` (0: none, or forgotten)."""
        record = self._failures.get(source.key)
        if record is None or now - record.last >= self.backoff_forget:
            return 0
        return record.count

    def _forget(self, now: float) -> None:
        """Drop records older than ``backoff_forget`` and any beyond ``max_tracked_sources``."""
        records = self._failures
        while records:
            oldest_key = next(iter(records))
            if len(records) <= self.max_tracked_sources and now - records[oldest_key].last < self.backoff_forget:
                break
            del records[oldest_key]

    # ------------------------------------------------------------- observing

    @property
    def pending(self) -> int:
        """Pending connections now, all sources together."""
        return self._pending

    def statistics(self) -> PendingStatistics:
        """A snapshot of the counts (for metrics, status and tests)."""
        return PendingStatistics(self._pending, len(self._by_source), len(self._failures))

    def __repr__(self) -> str:
        return (
            f"<PendingLimits {self._pending}/{self.max_pending} pending from {len(self._by_source)} sources,"
            f" {len(self._failures)} with failures>"
        )
