"""Leases taken with ``revocable=False``, run against both layers: fencing does not cancel the
body, which runs to its end; its capacity counts (as revoked, still running) until it leaves,
and its exit says ``LeaseRevoked`` [revoked-in-flight]. Everything else is a lease's: the
queue, its deadline, a cancellation of the task itself.

Each test is a scenario written once against :class:`~tests.admission.layers.Layer` and run
on trio (``Admission``) and asyncio (``AsyncAdmission``), on virtual time.
"""

from __future__ import annotations

from typing import Any

import pytest
from tests.admission.layers import Layer, books_closed, now


def _row(admission: Any) -> Any:
    (row,) = admission.snapshot().providers
    return row


@pytest.mark.req("revoked-in-flight")
@pytest.mark.parametrize("queued", [False, True], ids=["at-once", "queued"])
def test_fencing_does_not_cancel_an_unrevocable_body(layer: Layer, pool: Any, queued: bool) -> None:
    """The body (granted at once, or after waiting behind another lease) sleeps 5 s; its node is
    fenced 1 s in: the body is not cancelled and ends at its time, the provider (capacity 1)
    reads revoked_in_flight 1 all along and grants the next waiter the instant the body leaves;
    the exit raises LeaseRevoked, and the body finished its work before it."""

    async def scenario() -> None:
        admission = layer.admission(pool.shared(capacity=1, queue_timeout=3.0))
        generation = admission.connect("node-a")
        finished: list[float] = []
        granted_at: list[float] = []

        async def first() -> None:
            async with admission.lease(pool.fast):
                await layer.sleep(1)

        async def unrevocable() -> None:
            async with admission.lease(pool.big, revocable=False):
                await layer.sleep(5)  # past the 3 s queue deadline when it waited: that deadline is over
                finished.append(now(layer))

        async def next_one() -> None:
            async with admission.lease(pool.fast):
                granted_at.append(now(layer))

        async with layer.tasks() as spawn:
            if queued:
                spawn(first)
                await layer.settle()
            holder = spawn(unrevocable)
            await layer.settle()
            if queued:
                await layer.sleep(1)
            start = now(layer)
            await layer.sleep(1)
            assert admission.disconnect("node-a", generation)
            admission.connect("node-a")
            row = _row(admission)
            assert (row.in_flight, row.revoked_in_flight) == (0, 1)
            await layer.sleep(3.5)
            spawn(next_one)  # queued: its own 3 s deadline is past the body's end
            await layer.settle()
            assert finished == [] and granted_at == [] and admission.queue_depth == 1
            assert _row(admission).revoked_in_flight == 1
            await layer.sleep(1)
            assert finished == [start + 5] and granted_at == [start + 5]
        assert holder.outcome == "LeaseRevoked"
        books_closed(admission)

    layer.run(scenario)


def test_an_unrevocable_body_ends_normally_when_nothing_is_fenced(layer: Layer, pool: Any) -> None:
    """Without a fence, a lease taken with revocable=False is any lease: it holds the capacity
    while the body runs and gives it back at the exit, with no error."""

    async def scenario() -> None:
        admission = layer.admission(pool.shared(capacity=1))
        admission.connect("node-a")
        async with admission.lease(pool.big, revocable=False) as lease:
            assert not lease.revoked and _row(admission).in_flight == 1
            await layer.sleep(1)
        assert _row(admission).in_flight == 0
        books_closed(admission)

    layer.run(scenario)


def test_cancelling_the_task_of_an_unrevocable_body_still_ends_it(layer: Layer, pool: Any) -> None:
    """revocable=False opts out of fencing's cancellation, not of the task's own: cancelling the
    task ends the body at its next await and releases the lease."""

    async def scenario() -> None:
        admission = layer.admission(pool.shared(capacity=1))
        admission.connect("node-a")
        reached: list[str] = []

        async def body() -> None:
            async with admission.lease(pool.big, revocable=False):
                reached.append("in")
                await layer.sleep(100)
                reached.append("past the sleep")

        async with layer.tasks() as spawn:
            holder = spawn(body)
            await layer.settle()
            holder.cancel()
            await layer.settle()
        assert reached == ["in"] and holder.outcome == "cancelled"
        assert _row(admission).in_flight == 0
        books_closed(admission)

    layer.run(scenario)
