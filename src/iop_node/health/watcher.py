"""The node's health watcher: readiness probes, the stall watchdog and the idle canary, per provider.

:class:`HealthWatcher` runs for the node's life (:meth:`HealthWatcher.serve`, started by
:class:`~iop_node.EdgeClients`); its probes go out only while at least one Edge
connection is registered (:meth:`HealthWatcher.connected`): health is reported to an
Edge, whose core stays the one source of truth for eligibility ([health-probe]). It
keeps one :class:`HealthReport` per provider and wakes every reporter at each change;
each connection sends what changed (:meth:`HealthWatcher.report`).

- Readiness probe (Envoy's active health check): every ``interval_ms`` while the
  provider has traffic, every ``no_traffic_interval_ms`` once it has had no run for
  that long, each interval jittered by ``jitter``; ``unhealthy_threshold`` failures in a
  row make it ``not_ready``, ``healthy_threshold`` passes ``ready`` again
  (:class:`~iop_node.health.readiness.Readiness`).
- Stall watchdog: one task for every provider, ticking at an eighth of the smallest
  ``stall_ms`` (on the probe rounds' grid when that is longer than a round, so one
  wakeup of the process serves both; a provider with no run since the last tick costs
  nothing); a stalled provider's runs are cut and it is reported ``stalled`` until
  a byte arrives or no run is left (:mod:`iop_node.health.progress`).
- Idle canary (off unless ``canary_idle_ms``): after that long without a run, a
  one-token completion through the node's gate; its outcome counts as a probe result.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, final

import attrs
import httpx
import trio

from iop_admission import ConcurrencyLimitExceeded
from iop_io import CAN_POLL
from iop_node._errors import RunFailed
from iop_node.config import NodeConfig, ProviderConfig
from iop_node.health.probe import ProbeClient, probe_urls
from iop_node.health.prober import TICK, ProbeLoop, Target, grid_time
from iop_node.health.progress import Progress
from iop_node.health.readiness import NOT_READY, READY, STALLED, ProbeResult, Readiness
from iop_wire import EngineView

logger = logging.getLogger("iop_node.health")

MIN_TICK: Final = 0.05
"""Seconds between two watchdog ticks at the least."""

Canary = Callable[[str, str, dict[str, Any]], Awaitable[dict[str, Any]]]
"""Runs one background request: ``(provider, endpoint, body)`` (:meth:`iop_node.NodeRuntime.run_background`)."""


@final
@attrs.frozen
class HealthReport:
    """What the node tells the Edge about one provider.

    Attributes:
        state: ``ready``, ``not_ready`` or ``stalled``.
        reason: why (the probe's failure, the stall); "" when ready.
        capacity: the backend's own parallelism when it is below the provider's
            configured capacity (never above: config is the ceiling); None otherwise.
        engine: the engine's own view of its KV cache and queue (wire v7), with ``ready``
            when the last probe read one; None otherwise.
    """

    state: str = READY
    reason: str = ""
    capacity: int | None = None
    engine: EngineView | None = None


@final
@attrs.define(eq=False)
class _Watched:
    """One provider under watch."""

    config: ProviderConfig
    progress: Progress
    readiness: Readiness
    probe: ProbeClient | None
    target: Target | None = None
    report: HealthReport = HealthReport()
    traffic_seen: int = -1
    last_traffic: float = 0.0
    changed: Callable[[], None] = lambda: None
    """Called when a probe's result changed the readiness verdict (the watcher's update of the report)."""
    rng: random.Random = attrs.field(factory=random.Random)
    """The jitter's source (the watcher's)."""
    _every: float = attrs.field(init=False)
    """Seconds between two probes: ``interval_ms``; ``_idle_every`` once the provider has had no run that long."""
    _idle_every: float = attrs.field(init=False)
    _jitter: float = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        health = self.config.health
        self._every = health.interval_ms / 1000
        self._idle_every = health.no_traffic_interval_ms / 1000
        self._jitter = health.jitter

    def current(self) -> HealthReport:
        if self.progress.stalled:
            return HealthReport(
                STALLED, f"no byte from the backend for {self.progress.silence:.1f} s with runs in flight"
            )
        if not self.readiness.ready:
            return HealthReport(NOT_READY, self.readiness.reason)
        capacity = self.readiness.capacity
        capacity = capacity if capacity is not None and capacity < self.config.capacity else None
        return HealthReport(READY, "", capacity, self.readiness.engine)

    def probed(self, result: ProbeResult, now: float) -> float:
        """Count one probe's result (at ``now``); return the seconds to the next probe.

        That is Envoy's interval, or its no-traffic interval once the provider has had
        no run for that long, jittered.
        """
        if self.readiness.observe(result):
            self.changed()
        progress = self.progress
        if progress.runs or progress.started != self.traffic_seen:
            self.traffic_seen = progress.started
            self.last_traffic = now
        base = self._idle_every if now - self.last_traffic >= self._idle_every else self._every
        return base * (1 + self._jitter * (2 * self.rng.random() - 1))


@final
class HealthWatcher:
    """Watches every provider of a node (see the module docstring)."""

    def __init__(
        self,
        providers: Mapping[str, _Watched],
        canary: Canary | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._watched = dict(providers)
        self._canary = canary
        self._rng = rng or random.Random()
        self._changed = trio.Event()
        self._connections = 0
        self._online = trio.Event()
        self._probes = 0
        self._loop: ProbeLoop | None = None
        for name, watched in self._watched.items():
            watched.rng = self._rng
            watched.changed = functools.partial(self._update, name, watched)
            if watched.target is not None:
                watched.target.done = watched.probed
                self._loop = self._loop or ProbeLoop()

    @classmethod
    def from_config(
        cls,
        config: NodeConfig,
        progress: Mapping[str, Progress],
        *,
        canary: Canary | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        rng: random.Random | None = None,
    ) -> HealthWatcher:
        """One watched provider per ``config.providers``, counting runs in ``progress``."""
        watched = {}
        for p in config.providers:
            health = p.health
            readiness = Readiness(health.unhealthy_threshold, health.healthy_threshold)
            watched[p.id] = _Watched(p, progress[p.id], readiness, None)
            if health.probe_for(p.adapter) == "none":
                continue
            kind, urls = probe_urls(p)
            if transport is None and CAN_POLL and all(url.scheme == "http" for url in urls):
                watched[p.id].target = Target(kind, urls, health.timeout_ms / 1000)
            else:
                watched[p.id].probe = ProbeClient(kind, urls, health.timeout_ms / 1000, transport)
        return cls(watched, canary, rng)

    def __repr__(self) -> str:
        states = ", ".join(f"{name} {w.report.state}" for name, w in self._watched.items())
        return f"<HealthWatcher {states}>"

    @property
    def probes(self) -> int:
        """Readiness probes answered or failed so far, every provider's."""
        return self._probes + (self._loop.probes if self._loop is not None else 0)

    @property
    def reports(self) -> dict[str, HealthReport]:
        """The current report of every provider."""
        return {name: w.report for name, w in self._watched.items()}

    def connected(self, delta: int) -> None:
        """One Edge connection registered (``+1``) or ended (``-1``): probes run while any is."""
        self._connections += delta
        if self._connections > 0:
            self._online.set()
        elif self._online.is_set():
            self._online = trio.Event()

    async def changed(self) -> None:
        """Wait until a report changes. Checkpoints; cancellation just ends the wait."""
        await self._changed.wait()

    async def report(self, send: Callable[[str, HealthReport], Awaitable[None]]) -> None:
        """Send every report that differs from what the Edge assumes (ready), then each change, forever.

        ``send(provider, report)`` puts one on the connection. Counts the connection as
        registered while it runs (:meth:`connected`). Checkpoints; cancellation ends it.
        """
        sent = {name: HealthReport() for name in self._watched}
        self.connected(+1)
        try:
            while True:
                changed = self._changed
                for name, watched in self._watched.items():
                    if sent[name] != watched.report:
                        sent[name] = watched.report
                        await send(name, watched.report)
                if changed is self._changed:
                    await changed.wait()
        finally:
            self.connected(-1)

    async def serve(self) -> None:
        """Probe, watch and canary every provider until cancelled. Checkpoints."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_progress)
            if self._loop is not None:
                nursery.start_soon(self._loop.serve, lambda: self._online)
            for name, watched in self._watched.items():
                first = watched.config.health.interval_ms / 1000 * self._rng.random()  # spread the first probes
                if watched.target is not None and self._loop is not None:
                    self._loop.schedule(watched.target, first)
                if watched.probe is not None:
                    nursery.start_soon(self._probe_loop, name, watched, first)
                if watched.config.health.canary_idle_ms is not None and self._canary is not None:
                    nursery.start_soon(self._canary_loop, name, watched)

    async def aclose(self) -> None:
        """Close every probe's connection. Checkpoints."""
        for watched in self._watched.values():
            if watched.probe is not None:
                await watched.probe.aclose()

    def _update(self, name: str, watched: _Watched) -> None:
        report, before = watched.current(), watched.report
        if report != before:
            detail = f" ({report.reason})" if report.reason else ""
            if report.capacity is not None:
                detail += f", the backend's own capacity {report.capacity}"
            # The engine's view changes with its load, at most once a probe: not a line of the log.
            engine_only = (report.state, report.reason, report.capacity) == (
                before.state,
                before.reason,
                before.capacity,
            )
            (logger.debug if engine_only else logger.info)("provider %s: %s%s", name, report.state, detail)
            watched.report = report
            self._changed.set()
            self._changed = trio.Event()

    async def _watch_progress(self) -> None:
        stalls = [w.config.health.stall_ms for w in self._watched.values() if w.config.health.stall_ms]
        if not stalls:
            return
        tick = max(MIN_TICK, min(stalls) / 8000)
        watched = [(name, w, w.progress, w.config.health.stall_ms / 1000) for name, w in self._watched.items()]
        while True:
            at = trio.current_time() + tick
            await trio.sleep_until(grid_time(at) if tick >= TICK else at)  # with a probe round: one wakeup
            now = trio.current_time()
            for name, one, progress, stall in watched:
                if progress.idle:  # no run since the last check found none: nothing to watch
                    continue
                verdict = progress.check(now, stall)
                if progress.cut_runs:
                    logger.warning(
                        "provider %s stalled: no byte for %.1f s, cutting its %d runs in flight",
                        name,
                        progress.silence,
                        progress.cut_runs,
                    )
                if verdict is not None:
                    self._update(name, one)

    async def _probe_loop(self, name: str, watched: _Watched, first: float) -> None:
        """One provider's probes, one at a time: an ``https://`` backend (or no epoll)."""
        probe = watched.probe
        assert probe is not None
        timeout = watched.config.health.timeout_ms / 1000
        await trio.sleep(first)
        while True:
            await self._online.wait()
            result = await probe.check(timeout)
            self._probes += 1
            await trio.sleep(watched.probed(result, trio.current_time()))

    async def _canary_loop(self, name: str, watched: _Watched) -> None:
        assert self._canary is not None
        health = watched.config.health
        assert health.canary_idle_ms is not None and health.canary_model is not None
        idle = health.canary_idle_ms / 1000
        body = {"model": health.canary_model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
        limit = max(health.stall_ms, health.timeout_ms) / 1000
        started = watched.progress.started
        while True:
            await trio.sleep(idle)
            await self._online.wait()
            if watched.progress.runs or watched.progress.started != started:
                started = watched.progress.started
                continue  # not idle: real runs are the evidence
            result = await _canary_result(self._canary, name, body, limit)
            if result is not None and watched.readiness.observe(result):
                self._update(name, watched)


async def _canary_result(canary: Canary, name: str, body: dict[str, Any], limit: float) -> ProbeResult | None:
    """One canary completion's outcome as a probe result; None when the gate had no permit (not idle)."""
    with trio.move_on_after(limit):
        try:
            await canary(name, "chat/completions", body)
        except ConcurrencyLimitExceeded:
            return None
        except RunFailed as exc:
            return ProbeResult(False, f"canary failed: {exc.code}: {exc}")
        return ProbeResult(True)
    return ProbeResult(False, f"canary: no answer within {limit:g} s")
