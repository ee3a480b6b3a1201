"""One library on two layers, in behaviour [layer-parity]: code written once against the public
calls -- ``waiters()``, ``provider_rows()``, ``watch_ejections()`` in a task beside the users --
runs unchanged on trio and asyncio with the same outcome, and a cancellation racing a grant
has the same outcome on both: the body never starts and the grant goes back.

Each test is a scenario written once against :class:`~tests.admission.layers.Layer` and run on
both layers, on virtual time.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import pytest
from tests.admission.layers import Layer, books_closed, now

from iop_admission import OutlierPolicy


@pytest.mark.req("layer-parity")
def test_a_cancellation_racing_a_grant_never_enters_the_body(layer: Layer, pool: Any) -> None:
    """The holder leaves (the waiter is granted, its task not resumed yet) and the waiter's task
    is cancelled in the same step: on both layers the body never starts, the task ends
    cancelled, and the grant goes back to the pool."""

    async def scenario() -> None:
        admission = layer.admission(pool.shared())
        admission.connect("node-a")
        entered: list[bool] = []

        async def wait_and_run() -> None:
            async with admission.lease(pool.big):
                entered.append(True)  # no await before: trio used to run this line

        async with layer.tasks() as spawn:
            holder = admission.lease(pool.big)
            await holder.__aenter__()
            waiter = spawn(wait_and_run)
            await layer.settle()
            await holder.__aexit__(None, None, None)  # grants the waiter
            assert admission.snapshot().providers[0].in_flight == 1  # the waiter owns it now
            waiter.cancel()
        assert waiter.outcome == "cancelled" and entered == []
        books_closed(admission)

    layer.run(scenario)


@pytest.mark.req("layer-parity")
def test_waiters_and_provider_rows_read_the_same_on_both_layers(layer: Layer, pool: Any) -> None:
    """Two requests queue behind a holder: ``waiters()`` lists them in arrival order with their
    age on the layer's clock, ``provider_rows()`` is ``snapshot().providers`` as dicts."""

    async def scenario() -> None:
        admission = layer.admission(pool.shared())
        admission.connect("node-a")

        async def take(model: str) -> None:
            async with admission.lease(model):
                pass

        async with layer.tasks() as spawn:
            holder = admission.lease(pool.big)
            await holder.__aenter__()
            spawn(lambda: take(pool.big))
            await layer.sleep(2)
            spawn(lambda: take(pool.fast))
            await layer.sleep(1)
            rows = [(w.order, w.position, w.model, w.age, w.candidates) for w in admission.waiters()]
            assert rows == [(1, 1, pool.big, 3.0, (pool.gpu0,)), (2, 1, pool.fast, 1.0, (pool.gpu0,))]
            provider_rows = admission.provider_rows()
            assert provider_rows == [attrs.asdict(p) for p in admission.snapshot().providers]
            assert (provider_rows[0]["in_flight"], provider_rows[0]["queued"]) == (1, 2)
            await holder.__aexit__(None, None, None)
        assert admission.waiters() == ()
        books_closed(admission)

    layer.run(scenario)


@pytest.mark.req("layer-parity", "outlier-ejection")
def test_watch_ejections_beside_the_users_gives_the_probe_at_the_ejection_end(layer: Layer, pool: Any) -> None:
    """``watch_ejections()`` started in a task, as trio code does, on both layers: a request
    parked while gpu0 is ejected and gpu1 full gets gpu0's probe at the instant the ejection ends."""

    async def scenario() -> None:
        ejection = 4.0
        config = attrs.evolve(pool.two_nodes(), outlier=OutlierPolicy(1, ejection, ejection))
        admission = layer.admission(config)
        admission.connect("node-a")
        admission.connect("node-b")
        probes: list[tuple[float, bool]] = []

        async def wait_for_probe() -> None:
            async with admission.lease(pool.big) as lease:
                probes.append((now(layer), lease.probe))

        async with layer.tasks() as spawn:
            watcher = spawn(admission.watch_ejections)
            async with admission.lease(pool.big) as first:
                assert first.provider == pool.gpu0
                admission.report_failure(first)
            busy = admission.lease(pool.big)
            assert (await busy.__aenter__()).provider == pool.gpu1
            spawn(wait_for_probe)
            await layer.sleep(ejection + 1)
            watcher.cancel()
            await busy.__aexit__(None, None, None)
        assert probes == [(ejection, True)]
        assert watcher.outcome == "cancelled"
        books_closed(admission)

    layer.run(scenario)


@pytest.mark.req("layer-parity", "outlier-ejection")
def test_a_report_made_outside_any_loop_ejects_and_the_next_lease_ends_the_ejection(layer: Layer, pool: Any) -> None:
    """The synchronous calls work with no loop running, on both layers: a failure reported
    between two runs ejects the provider at the latest time seen, and the first lease after
    the ejection's end (no timer could be armed for it) is the provider's probe."""
    config = attrs.evolve(pool.shared(), outlier=OutlierPolicy(1, 1.0, 1.0))
    admission = layer.admission(config)
    admission.connect("node-a")
    leases: list[Any] = []

    def take(at: float) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            await layer.sleep(at)  # each run's clock starts at 0
            async with admission.lease(pool.big) as lease:
                leases.append(lease)

        return run

    layer.run(take(2.0))
    admission.report_failure(leases[0])  # no loop runs: the time is the latest one seen (2.0)
    (row,) = admission.snapshot().providers
    assert (row.health, row.ejections) == ("ejected", 1)
    layer.run(take(4.0))  # past the ejection's end (3.0): the lease ends it and is the probe
    assert [lease.probe for lease in leases] == [False, True]
    books_closed(admission)
