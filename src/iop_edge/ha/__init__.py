"""High availability of the Edge: active-passive replicas elected through etcd (docs/ha.md).

The public face of the election for the rest of the Edge: :class:`EdgeHa`
holds this Edge's :class:`Leadership` and runs the election task; the HTTP
layer asks :meth:`EdgeHa.admits` before admitting a request and
:meth:`EdgeHa.refusal_headers` for a standby's 503.
"""

from __future__ import annotations

import math
import ssl
import time
from collections.abc import Callable, Iterator
from typing import final

import attrs
import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from iop_edge.config import HaConfig
from iop_edge.ha.election import ElectionStore, run_election
from iop_edge.ha.etcd import EtcdGateway, EtcdUnavailable, KeyHolder
from iop_edge.ha.etcd_http import EtcdHttp
from iop_edge.ha.fencing import LeaderFence
from iop_edge.ha.leadership import LeaderInfo, Leadership, Role
from iop_edge.status import HaStatus

__all__ = ["EdgeHa", "ElectionStore", "EtcdGateway", "EtcdUnavailable", "KeyHolder", "LeaderInfo", "Leadership", "Role"]

LEADER_HEADER = "x-iop-leader"
"""The header a standby's 503 carries: the leader's advertised address, when known."""


@final
@attrs.define(eq=False)
class EdgeHa:
    """This Edge's part in the election. Without ``ha:`` there is no ``EdgeHa`` and the Edge always admits."""

    config: HaConfig
    leadership: Leadership
    on_change: Callable[[Leadership], None] = lambda _: None
    since: float | None = None
    """Wall-clock time of the last change of leader seen by this Edge."""
    _terms: set[trio.CancelScope] = attrs.field(factory=set, init=False)
    """The scopes of the requests admitted in this term (:meth:`cut_on_step_down`)."""

    @classmethod
    def of(cls, config: HaConfig, on_change: Callable[[Leadership], None] = lambda _: None) -> EdgeHa:
        return cls(config, Leadership(config.advertise, float(config.ttl_s), config.margin), on_change)

    def admits(self) -> bool:
        """True while this Edge leads and its own count of its lease has not run out.

        Checked at each admission, so a leader paused past its deadline (SIGSTOP)
        admits nothing when it wakes, before its election task has run.
        """
        return trio.current_time() < self.leadership.admits_until

    def retry_after(self) -> int:
        """Seconds a refused client should wait: one TTL covers a whole failover."""
        return max(1, math.ceil(self.config.ttl_s))

    def refusal_headers(self) -> list[tuple[str, str]]:
        """``Retry-After`` and, when a leader is known, the header naming it."""
        headers = [("retry-after", str(self.retry_after()))]
        leader = self.other_leader()
        if leader is not None:
            headers.append((LEADER_HEADER, leader))
        return headers

    def other_leader(self) -> str | None:
        """The Edge a refused client should go to: the leader this Edge knows, unless it is itself
        (a leader that can no longer prove its lease does not know its successor yet)."""
        lead = self.leadership
        return None if lead.leading else lead.leader

    def info(self) -> LeaderInfo:
        """``/status``'s view: who leads, its epoch, since when."""
        return LeaderInfo(self.leadership.leader, self.leadership.epoch, self.since)

    def status(self) -> HaStatus:
        """``/status``'s ``ha`` block."""
        lead = self.leadership
        return HaStatus(lead.role, lead.leader, lead.epoch, self.since, lead.elections_won, lead.step_downs)

    def collector(self, fence: LeaderFence | None = None) -> Collector:
        """Prometheus families read from this Edge's leadership (and epoch fence) at every scrape (docs/metrics.md)."""
        return _HaCollector(self.leadership, fence if fence is not None else LeaderFence())

    def cut_on_step_down(self, scope: trio.CancelScope) -> _InTerm:
        """Within the block, ``scope`` is cancelled when this Edge stops leading (at once if it does not lead).

        [ha-step-down] The HTTP API runs each admitted request under such a scope, so a stepping-down
        leader answers its queued requests 503 at once and cuts its running streams. A plain context
        manager, not a generator's: it is entered once per request.
        """
        return _InTerm(self, scope)

    def _changed(self, leadership: Leadership) -> None:
        self.since = time.time()
        if not leadership.leading:
            for scope in list(self._terms):
                scope.cancel()
        self.on_change(leadership)

    def _client(self) -> EtcdHttp:
        tls = None
        if self.config.ca_file or self.config.cert_file:
            tls = ssl.create_default_context(cafile=self.config.ca_file)
            if self.config.cert_file and self.config.key_file:
                tls.load_cert_chain(self.config.cert_file, self.config.key_file)
        return EtcdHttp(self.config.ttl_s / 3, tls)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Campaign until cancelled (see :func:`iop_edge.ha.election.run_election`); steps down on cancel."""
        client = self._client()
        try:
            await self.campaign(
                EtcdGateway(client, self.config.endpoints, self.config.credentials), task_status=task_status
            )
        finally:
            with trio.CancelScope(shield=True):
                await client.aclose()

    async def campaign(
        self, store: ElectionStore, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """:meth:`run` on another :class:`ElectionStore` than etcd's gateway (the seeded simulation's
        in-memory one); the same election, step-downs and ``on_change`` calls."""
        await run_election(
            store,
            self.leadership,
            self.config.key,
            poll_interval=self.config.poll_interval_ms / 1000,
            on_change=self._changed,
            task_status=task_status,
        )


@final
class _InTerm:
    """:meth:`EdgeHa.cut_on_step_down`'s block: ``scope`` is among the term's while it runs."""

    __slots__ = ("_ha", "_scope")

    def __init__(self, ha: EdgeHa, scope: trio.CancelScope) -> None:
        self._ha = ha
        self._scope = scope

    def __enter__(self) -> None:
        if not self._ha.admits():
            self._scope.cancel()
        self._ha._terms.add(self._scope)

    def __exit__(self, *exc: object) -> None:
        self._ha._terms.discard(self._scope)


@final
class _HaCollector(Collector):
    """``iop_ha_leader``, ``iop_ha_epoch``, ``iop_ha_elections_won_total``, ``iop_ha_step_downs_total``."""

    def __init__(self, leadership: Leadership, fence: LeaderFence) -> None:
        self._leadership = leadership
        self._fence = fence

    def collect(self) -> Iterator[Metric]:
        lead = self._leadership
        yield GaugeMetricFamily(
            "iop_ha_leader", "1 while this Edge leads its election, else 0", value=int(lead.leading)
        )
        yield GaugeMetricFamily("iop_ha_epoch", "The epoch of the leader this Edge knows (0: none)", value=lead.epoch)
        yield CounterMetricFamily("iop_ha_elections_won", "Elections this Edge has won", value=lead.elections_won)
        yield CounterMetricFamily("iop_ha_step_downs", "Times this Edge stopped leading", value=lead.step_downs)
        fence = self._fence
        yield CounterMetricFamily(
            "iop_ha_stale_epoch_refused",
            "Runs of this Edge that nodes refused as stale_epoch (a newer leader exists)",
            value=fence.stale_refused,
        )
        yield GaugeMetricFamily(
            "iop_ha_inherited_runs",
            "Runs the nodes reported in flight at the start of this Edge's term (the previous term's load)",
            value=fence.inherited_runs,
        )
