"""The one-Edge world with the Nodes' health watchers on ([health-probe]): a hung backend and a slow-loading one.

Every fault site of :mod:`tests.sim._world`, plus two of the backends' own:

- ``hung_backend``: for a while a provider's backend takes runs and sends nothing
  (its readiness probe still passes: the hung engine behind a live ``/health``).
  The Node's stall watchdog (``stall_ms`` below the Edge's first-token timeout)
  cuts its streamed runs and reports it ``stalled``; the Edge ejects it, and a
  cut run whose client saw no byte is retried on another candidate.
- ``slow_loading``: for a while a provider's readiness probe answers 503
  ``Loading model`` (llama.cpp's answer while a model loads), then 200. After
  ``unhealthy_threshold`` failures the Node reports it ``not_ready`` and the Edge
  ejects it until a ``ready`` report; at the first pass it is back.

The probes go through an ``httpx.MockTransport`` that answers from the world's
state (no socket: the world runs on the mock clock). Checks beside the one-Edge
world's: each fresh ``stalled`` report leaves its provider ejected, each fresh
``not_ready`` one ejected until ``ready``, and each ``ready`` one after a
``not_ready`` restores it (checked as the Edge applies them); a streamed run on a
hung backend is cut within ``stall_ms`` and two watchdog ticks of its provider's
last byte; and after healing every provider is available again (the base world's
final check), so a backend that finished loading is back in rotation.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import attrs
import httpx
import trio
import trio.testing

from iop_admission import ProviderKey, ProviderReport
from iop_node import NodeConfig, NodeRuntime
from iop_node.config import HealthConfig
from iop_node.health import HealthWatcher

from ._report import Summary
from ._world import FIRST_TOKEN_TIMEOUT_MS, PROVIDERS, SITES, SeedResult, SimBackend, World, run_seed
from ._world import node_config as base_node_config

HEALTH_SITES = (*SITES, "hung_backend", "slow_loading")
STALL_MS = 600
"""The watchdog's ``stall_ms``: below the Edge's first-token timeout, so the watchdog is what cuts a hung run."""
WATCHDOG_TICK = max(0.05, STALL_MS / 8000)
"""The watchdog's tick (:data:`iop_node.health.watcher.MIN_TICK`, an eighth of ``stall_ms``)."""
HEALTH = HealthConfig(
    probe="openai",
    interval_ms=250,
    timeout_ms=200,
    unhealthy_threshold=2,
    healthy_threshold=1,
    no_traffic_interval_ms=250,
    jitter=0.1,
    stall_ms=STALL_MS,
)
REPORTED = (
    "stalled reports applied",
    "not_ready reports applied",
    "ready after not_ready",
    "hung runs cut",
    "hung runs served elsewhere",
    "probes answered loading",
)
assert FIRST_TOKEN_TIMEOUT_MS / 1000 > STALL_MS / 1000 + 2 * WATCHDOG_TICK


def node_config(node_id: str) -> NodeConfig:
    """The one-Edge world's node config, every provider watched (its probe answered by the world)."""
    config = base_node_config(node_id)
    providers = tuple(
        attrs.evolve(p, base_url=f"http://{node_id}-{p.id}.sim.invalid/v1", health=HEALTH) for p in config.providers
    )
    return attrs.evolve(config, providers=providers)


@attrs.define(eq=False)
class HealthBackend(SimBackend):
    """The sim backend, hung while the world says so: it takes the run and sends nothing."""

    async def run(self, endpoint: str, body: dict[str, Any], *, stream: bool) -> AsyncIterator[dict[str, Any]]:
        world = self.world
        assert isinstance(world, HealthWorld)
        until = world.hung_until.get(self.key, 0.0)
        if until > trio.current_time():
            world.fired("hung_backend", f"{self.key} holds a run without a byte")
            await world.hang(self.key, int((body.get("sim") or {}).get("n", 0)), until, stream=stream)
        async for event in super().run(endpoint, body, stream=stream):
            world.last_byte[self.key] = trio.current_time()
            yield event


class HealthWorld(World):
    """The one-Edge world with health watchers, a hung backend and a slow-loading one (see the module docstring)."""

    sites = HEALTH_SITES
    backend = HealthBackend

    def __init__(self, seed: int, clock: trio.testing.MockClock) -> None:
        self.hung_until: dict[ProviderKey, float] = {}
        self.loading_until: dict[ProviderKey, float] = {}
        self.last_byte: dict[ProviderKey, float] = {}
        self.hung_requests: dict[int, ProviderKey] = {}
        self.watchers: dict[str, trio.CancelScope] = {}
        self.last_jump = -math.inf
        super().__init__(seed, clock)
        self._watch_reports()

    # -- the nodes ------------------------------------------------------------------

    def new_runtime(self, node_id: str, config: NodeConfig, **fields: Any) -> NodeRuntime:
        """The base world's runtime with a health watcher serving (as ``EdgeClients`` starts it), whose
        probes the world answers; the previous runtime's watcher of the node stops (its process ended)."""
        runtime = super().new_runtime(node_id, config, **fields)
        transport = httpx.MockTransport(lambda request: self._probe_answer(node_id, request))
        runtime.health = HealthWatcher.from_config(node_config(node_id), runtime.progress, transport=transport)
        if (previous := self.watchers.get(node_id)) is not None:
            previous.cancel()
        self.watchers[node_id] = scope = trio.CancelScope()
        assert self.nursery is not None
        self.nursery.start_soon(self._serve_watcher, runtime.health, scope)
        return runtime

    async def _serve_watcher(self, watcher: HealthWatcher, scope: trio.CancelScope) -> None:
        with scope:
            try:
                await watcher.serve()
            finally:
                with trio.CancelScope(shield=True):
                    await watcher.aclose()

    def _probe_answer(self, node_id: str, request: httpx.Request) -> httpx.Response:
        provider = request.url.host.removeprefix(f"{node_id}-").split(".", 1)[0]
        key = ProviderKey(node_id, provider)
        if self.loading_until.get(key, 0.0) > trio.current_time():
            self.result.fired["probes answered loading"] += 1
            self.fired("slow_loading", f"{key}'s probe answered 503 loading")
            return httpx.Response(503, json={"error": {"code": 503, "message": "Loading model"}})
        return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "object": "model"}]})

    # -- the faults -----------------------------------------------------------------

    async def hang(self, key: ProviderKey, number: int, until: float, *, stream: bool) -> None:
        """Hold a run on the hung backend ``key`` until ``until``; a streamed one must be cut before."""
        started = trio.current_time()
        self.hung_requests[number] = key
        try:
            await trio.sleep_until(until)
        except trio.Cancelled:
            self.result.fired["hung runs cut"] += 1
            raise
        finally:
            quiet_since = max(started, self.last_byte.get(key, -math.inf))
            bound = quiet_since + STALL_MS / 1000 + 2 * WATCHDOG_TICK
            jumped = self.last_jump > started  # the clock jumped over the watchdog's ticks (a frozen process)
            if stream and not jumped and min(trio.current_time(), until) > bound:
                self.violation(f"a streamed run on the hung backend {key} was not cut {bound - started:.3f} s in")

    async def fault_clock_jump_past_queue_timeout(self) -> None:
        self.last_jump = trio.current_time()
        await super().fault_clock_jump_past_queue_timeout()

    async def fault_hung_backend(self) -> None:
        key = self.frng.choice(tuple(PROVIDERS))
        self.hung_until[key] = trio.current_time() + self.frng.uniform(1.0, 3.0)
        self.trace(f"backend {key} hung (its probe passes) until {self.hung_until[key]:.3f}")

    async def fault_slow_loading(self) -> None:
        key = self.frng.choice(tuple(PROVIDERS))
        self.loading_until[key] = trio.current_time() + self.frng.uniform(0.5, 3.0)
        self.trace(f"backend {key} loading (its probe answers 503) until {self.loading_until[key]:.3f}")

    async def heal(self) -> None:
        self.hung_until.clear()
        self.loading_until.clear()
        await super().heal()

    # -- the checks -----------------------------------------------------------------

    def _watch_reports(self) -> None:
        """Check each node report as the Edge applies it: the provider's health right after."""
        admission = self.service.admission
        apply = admission.report_health
        providers = admission._core._pool.providers

        def report_health(provider: ProviderKey, report: ProviderReport) -> None:
            p = providers.get(provider)
            fresh = (
                p is not None and p.configured and p.node.connected and report.generation in (None, p.node.generation)
            )
            before = p.health.value if p is not None else ""
            was_until_ready = p is not None and before == "ejected" and p.ejected_until == math.inf
            apply(provider, report)
            if not fresh or p is None:
                return
            if report.state == "stalled":
                self.result.fired["stalled reports applied"] += 1
                if p.health.value != "ejected":
                    self.violation(f"{provider}: {p.health.value} right after a stalled report (was {before})")
            elif report.state == "not_ready":
                self.result.fired["not_ready reports applied"] += 1
                if p.health.value != "ejected" or p.ejected_until != math.inf:
                    self.violation(
                        f"{provider}: {p.health.value} right after a not_ready report, not ejected until ready"
                    )
            elif was_until_ready:
                self.result.fired["ready after not_ready"] += 1
                if p.health.value != "healthy":
                    self.violation(f"{provider}: {p.health.value} right after ready ended its not_ready ejection")

        admission.report_health = report_health  # type: ignore[method-assign]

    def final_check(self) -> None:
        """The base world's, and the requests a hung backend held: those served came from another provider."""
        super().final_check()
        for number, key in self.hung_requests.items():
            out = self.outcomes.get(number)
            if out is None or out.status != 200:
                continue
            served = out.headers.get(b"x-iop-provider", b"").decode()
            if served != str(key):
                self.result.fired["hung runs served elsewhere"] += 1


def run_health_seed(seed: int) -> SeedResult:
    """One seed of the health world (:func:`tests.sim._world.run_seed` with :class:`HealthWorld`)."""
    return run_seed(seed, HealthWorld)


def health_summary() -> Summary:
    """A :class:`~tests.sim._report.Summary` with the health world's sites and counters."""
    return Summary(sites=HEALTH_SITES, extra=REPORTED)


__all__ = ["HEALTH_SITES", "HealthWorld", "health_summary", "run_health_seed"]
