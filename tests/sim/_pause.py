"""The seeded simulation's leader paused past its TTL with retries in flight (issue 38), judged by the
whole-system check's own checker.

:class:`PauseWorld` is :class:`~tests.sim._ha.HaWorld` with one more fault site,
``leader_pause_retrying``: a backend every model can fail over from (``node-a/gpu0``) goes down,
so the leader's requests fail there before their first byte and are retried on their other
candidate; once the leader holds such retries (live leases of a second attempt, at most 1.5 s of
waiting for one), it is stopped past its TTL as ``leader_pause`` stops it, and a successor is
elected. Beside it only faults after which nothing may run twice: the HA sites, a backend down,
connections cut or blackholed, a node's graceful close. Not the first-token timeout's or the
5xx burst's sites: a retry after those re-runs a run its backend may be running, by design.

Every run that reaches a backend past the faults that refuse it at once (a backend down) is an
execution, recorded as :class:`tests.system.checker.Execution` (marker: the request's number); at
the end the checker of ``make chaos`` judges them, with no loss excused: every request executed
at most once (:func:`~tests.system.checker.at_most_once`), no provider past its capacity at any
instant (:func:`~tests.system.checker.within_capacity`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import trio
import trio.testing
from tests.system.checker import Execution, at_most_once, within_capacity

from iop_admission import ProviderKey

from . import _world
from ._ha import HA_COUNTS, HA_SITES, TTL_S, HaWorld
from ._report import Summary
from ._world import PROVIDERS, SeedResult, SimBackend

PAUSE_SITES = (*HA_SITES, "leader_pause_retrying", "backend_down", "connection_drop", "graceful_close")
DOWN = ProviderKey("node-a", "gpu0")
"""The backend taken down: a candidate of both model keys, each with another candidate to retry on."""
RETRY_WAIT_S = 1.5
"""How long the fault waits for the leader to hold a retry before it stops the leader anyway."""
PAUSE_COUNTS = (*HA_COUNTS, "retries in flight at a pause", "executions")


class CountingBackend(SimBackend):
    """:class:`SimBackend` that records each run past the faults that refuse it as an execution."""

    async def run(self, endpoint: str, body: dict[str, Any], *, stream: bool) -> AsyncIterator[dict[str, Any]]:
        world = self.world
        assert isinstance(world, PauseWorld)
        task = trio.lowlevel.current_task()
        arrival = trio.current_time()
        try:
            async for event in super().run(endpoint, body, stream=stream):
                yield event
        finally:
            if task in world.past_faults:  # it reached the model: the backend did (part of) its work
                world.past_faults.discard(task)
                number = str((body.get("sim") or {}).get("n", 0))
                world.executions.append(Execution(number, str(self.key), arrival, trio.current_time(), "run"))


class PauseWorld(HaWorld):
    """One seed's HA group under pauses with retries in flight (see the module docstring)."""

    sites = PAUSE_SITES
    backend = CountingBackend

    def __init__(self, seed: int, clock: trio.testing.MockClock) -> None:
        super().__init__(seed, clock)
        self.enabled |= {"leader_pause_retrying"}
        self.result.enabled = tuple(s for s in self.sites if s in self.enabled)
        self.executions: list[Execution] = []
        self.past_faults: set[trio.lowlevel.Task] = set()

    async def provider_faults(self, key: ProviderKey) -> None:
        await super().provider_faults(key)
        self.past_faults.add(trio.lowlevel.current_task())

    async def fault_leader_pause_retrying(self) -> None:
        index = self.leader()
        if index is None or self.pausing:
            return
        self.pausing = True  # no other pause meanwhile
        self.down_until[DOWN] = trio.current_time() + RETRY_WAIT_S + TTL_S
        admission = self.services[index].admission
        retrying = 0
        with trio.move_on_after(RETRY_WAIT_S):
            while not (retrying := sum(1 for lease in admission._core.live_leases() if lease.attempt > 1)):
                await trio.sleep(0.01)
        if self.leader() != index:
            self.pausing = False
            return
        duration = TTL_S + self.frng.uniform(0.1, 1.5)
        self.fired("leader_pause_retrying", f"edge {index} for {duration:.3f} s with {retrying} retries running")
        self.result.fired["retries in flight at a pause"] += retrying
        assert self.nursery is not None
        self.nursery.start_soon(self._pause, index, duration)

    def final_check(self) -> None:
        super().final_check()
        self.result.fired["executions"] += len(self.executions)
        for found in at_most_once(self.executions):
            self.violation(found)
        for found in within_capacity(self.executions, {str(key): p.capacity for key, p in PROVIDERS.items()}):
            self.violation(found)


def run_pause_seed(seed: int) -> SeedResult:
    """:func:`tests.sim._world.run_seed` for the pause world."""
    return _world.run_seed(seed, PauseWorld)


def pause_summary() -> Summary:
    """An empty summary with the pause world's sites and counters."""
    return Summary(sites=PAUSE_SITES, extra=PAUSE_COUNTS)
