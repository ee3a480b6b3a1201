"""What both layers read of their admission state: :class:`Readings`, the read-only calls that
``Admission`` (trio) and ``AsyncAdmission`` (asyncio) share, written once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from iop_admission._config import PoolConfig
from iop_admission._snapshot import ProviderRow, Snapshot
from iop_admission._waiting import WaiterSnapshot, waiter_snapshots
from iop_admission.core import AdmissionState, read_snapshot

__all__ = ["Readings"]


class _Drops(Protocol):
    """A layer's event fan-out: counts the events a full subscriber buffer did not take."""

    dropped: int


class Readings:
    """The queries of a layer: the configuration, the queue, the snapshot and the nodes.

    Args:
        core: the layer's admission state.
        now: the layer's clock (``trio.current_time()``, or the running loop's ``time()``),
            None outside its runtime.
        events: the layer's event fan-out (``events_dropped``).
    """

    def __init__(self, core: AdmissionState, now: Callable[[], float | None], events: _Drops) -> None:
        self._core = core
        self._now = now
        self._fanout = events

    @property
    def config(self) -> PoolConfig:
        """The configuration in force."""
        return self._core.config

    @property
    def queue_depth(self) -> int:
        """The true number of queued waiters now (``snapshot().queue_depth`` without the snapshot)."""
        return self._core.queue_depth

    @property
    def events_dropped(self) -> int:
        """Events a full subscriber buffer did not take (``snapshot().events_dropped``)."""
        return self._fanout.dropped

    def snapshot(self, *, first: int = 0, count: int | None = None) -> Snapshot:
        """Read the state admission uses: counters, candidate pressure, queue depth.

        ``first``/``count``: ``providers`` holds only the configured providers at
        those positions of the config order (a large pool read a slice at a time).
        """
        return read_snapshot(self._core, self._now(), events_dropped=self._fanout.dropped, first=first, count=count)

    def provider_rows(self, *, first: int = 0, count: int | None = None) -> list[ProviderRow]:
        """``snapshot(first=, count=).providers`` as plain dicts (:data:`ProviderRow`), the same values.

        For writers of JSON: no :class:`ProviderSnapshot` objects are made, and
        the dicts need no unstructuring (at 10,000 providers about half the CPU
        of the objects plus ``cattrs.unstructure``).
        """
        return self._core.provider_rows(self._now(), first, count)

    def waiters(self) -> tuple[WaiterSnapshot, ...]:
        """The queued requests, in arrival order, as :class:`WaiterSnapshot` (read only).

        Call it in the same synchronous step as :meth:`snapshot` (no ``await``
        between) and both describe the same instant of the state.
        """
        core = self._core
        return waiter_snapshots(core.waiters(), self._clock(), core.config.models)

    def generation(self, node_id: str) -> int:
        """The node's current generation (0 if it never connected)."""
        return self._core.generation(node_id)

    def is_connected(self, node_id: str) -> bool:
        """Whether the node is connected in its current generation."""
        return self._core.is_connected(node_id)

    def _clock(self) -> float:
        """The layer's time now; outside its runtime the latest time the state saw."""
        now = self._now()
        return self._core.last_time if now is None else now
