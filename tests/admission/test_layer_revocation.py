"""Revocation and removal, run against both layers: a revoked lease's capacity comes back only
when its body has left [revoked-in-flight], and a provider a refresh removed stays in the
snapshot, marked removed, while a lease of it runs [removed-provider-visible].

Each test is a scenario written once against :class:`~tests.admission.layers.Layer` and run
on trio (``Admission``) and asyncio (``AsyncAdmission``), on virtual time.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest
import trio
from tests.admission.layers import Layer, books_closed, now


async def _ignore_cancellation(layer: Layer, seconds: float) -> None:
    """Run on for ``seconds`` whatever cancels the task: a shielded sleep under trio, a sleep
    that catches ``CancelledError`` and sleeps again under asyncio."""
    if layer.name == "trio":
        with trio.CancelScope(shield=True):
            await trio.sleep(seconds)
        return
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while (left := end - loop.time()) > 0:
        try:
            await asyncio.sleep(left)
        except asyncio.CancelledError:
            pass


def _row(admission: Any, provider_id: str) -> Any:
    (row,) = [p for p in admission.snapshot().providers if p.provider_id == provider_id]
    return row


@pytest.mark.req("revoked-in-flight")
@pytest.mark.parametrize("fence", ["reconnect", "disconnect"])
@pytest.mark.parametrize("linger", [5, 0], ids=["ignores", "obeys"])
def test_a_revoked_body_keeps_its_capacity_until_it_leaves(layer: Layer, pool: Any, fence: str, linger: int) -> None:
    """The body runs on ``linger`` seconds past its revocation (5: it ignores the cancellation;
    0: it leaves at its next await): the provider (capacity 1) reads in_flight 0 and
    revoked_in_flight 1 all that time, grants nothing, and hands the capacity to the waiter the
    instant the body leaves; the holder gets LeaseRevoked and each lease is released once."""

    async def scenario() -> None:
        admission = layer.admission(pool.shared(capacity=1, long_cap=1))
        generation = admission.connect("node-a")
        granted_at: list[float] = []
        bodies = 0

        async def stubborn() -> None:
            nonlocal bodies
            async with admission.lease(pool.big, long=True):
                bodies += 1
                try:
                    await layer.sleep(100)
                finally:
                    await _ignore_cancellation(layer, linger)
                    bodies -= 1

        async def next_one() -> None:
            nonlocal bodies
            async with admission.lease(pool.fast):
                assert bodies == 0, "a grant while the revoked body still runs"
                granted_at.append(now(layer))

        releases = _count_releases(admission)
        async with layer.tasks() as spawn:
            holder = spawn(stubborn)
            await layer.settle()
            if fence == "reconnect":
                admission.connect("node-a")
            else:
                assert admission.disconnect("node-a", generation)
                admission.connect("node-a")
            start = now(layer)
            row = _row(admission, "gpu0")
            assert (row.in_flight, row.long_in_flight) == (0, 0)
            assert (row.revoked_in_flight, row.revoked_long_in_flight) == (1, 1)
            waiter = spawn(next_one)
            if linger:
                await layer.settle()
                assert admission.queue_depth == 1 and granted_at == []
                await layer.sleep(linger - 0.5)
                assert _row(admission, "gpu0").revoked_in_flight == 1 and granted_at == []
            await layer.sleep(1)
            assert granted_at == [start + linger]
        assert holder.outcome == "LeaseRevoked"
        assert waiter.outcome == "ok"
        assert releases == Counter({1: 1, 2: 1})  # each lease released exactly once, by its holder
        books_closed(admission)

    layer.run(scenario)


@pytest.mark.req("removed-provider-visible")
def test_a_removed_provider_stays_listed_while_its_lease_runs(layer: Layer, pool: Any) -> None:
    """A refresh removes node-a/gpu0 while a lease of it runs: the snapshot and the rows list it
    after the configured providers, status removed, in_flight 1 (so "every counter is 0" is
    false while the lease runs), in the slice that reaches the end of the config order; it
    disappears when the lease ends."""

    async def scenario() -> None:
        admission = layer.admission(pool.two_nodes())
        admission.connect("node-a")
        admission.connect("node-b")
        lease_cm = admission.lease(pool.fast)
        lease = await lease_cm.__aenter__()
        assert lease.provider == pool.gpu0
        admission.refresh(pool.single())
        snap = admission.snapshot()
        assert [(p.provider_id, p.status) for p in snap.providers] == [("gpu1", "available"), ("gpu0", "removed")]
        removed = snap.provider("node-a", "gpu0")
        assert (removed.in_flight, removed.effective_capacity, removed.queued) == (1, 0, 0)
        assert any(p.in_flight for p in snap.providers)
        assert admission.snapshot(count=0).providers == ()  # a slice short of the end: configured only
        assert admission.snapshot(first=1).providers == snap.providers[1:]  # the slice that reaches the end
        await lease_cm.__aexit__(None, None, None)
        assert [p.provider_id for p in admission.snapshot().providers] == ["gpu1"]
        books_closed(admission)

    layer.run(scenario)


@pytest.mark.req("removed-provider-visible", "revoked-in-flight")
def test_a_removed_provider_revoked_while_its_body_runs_on_stays_listed(layer: Layer, pool: Any) -> None:
    """Removed by a refresh, then fenced by its node's disconnect, with a body that runs on: it
    stays listed (removed, revoked_in_flight 1) until the body leaves, then goes."""

    async def scenario() -> None:
        admission = layer.admission(pool.two_nodes())
        generation = admission.connect("node-a")
        admission.connect("node-b")

        async def stubborn() -> None:
            async with admission.lease(pool.fast):
                await _ignore_cancellation(layer, 3)

        async with layer.tasks() as spawn:
            holder = spawn(stubborn)
            await layer.settle()
            admission.refresh(pool.single())
            assert admission.disconnect("node-a", generation)
            row = _row(admission, "gpu0")
            assert (row.status, row.in_flight, row.revoked_in_flight) == ("removed", 0, 1)
            await layer.sleep(2)
            assert _row(admission, "gpu0").revoked_in_flight == 1
        assert holder.outcome == "LeaseRevoked"
        assert [p.provider_id for p in admission.snapshot().providers] == ["gpu1"]
        books_closed(admission)

    layer.run(scenario)


def _count_releases(admission: Any) -> Counter[int]:
    """Count the core releases of each lease id that found it not yet released (a second one
    would count too, as a release that found it done)."""
    core = admission._core
    release = core.release
    calls = Counter[int]()

    def counted(lease: Any) -> Any:
        calls[lease.id] += 1
        return release(lease)

    core.release = counted
    return calls
