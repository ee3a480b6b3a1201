"""The asyncio layer on several loops: one ``AsyncAdmission`` serves whichever loop a lease is
entered on. The layer keeps the loop of the latest lease to spare ``asyncio.get_running_loop()``
(a ``getpid()`` system call each time); these tests hold it to being a cache, never a binding.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import trio

from iop_admission import LeaseRevoked, ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy, QueueTimeout
from iop_admission.aio import AsyncAdmission
from iop_admission.testing import VirtualTimeLoop

GPU0 = ProviderKey("local", "gpu0")
TIMEOUT = 30.0
CONFIG = PoolConfig(
    policy=QueuePolicy(queue_timeout=TIMEOUT),
    providers={GPU0: ProviderSpec(capacity=1)},
    models={"m": ModelGroup([GPU0])},
)


def test_each_lease_takes_the_loop_and_task_it_is_entered_on() -> None:
    """One admission used on one loop, then (while that loop's task blocks) on a loop of another
    thread, then on a second loop of the first thread, then under trio: each lease takes the
    time, the timers and the task of the loop it is entered on (its enqueue time is that loop's
    clock, a queue timeout fires there, a revocation cancels that task), and under trio the error
    names the trio layer."""
    admission = AsyncAdmission(CONFIG)
    generation = admission.connect("local")
    seen: list[tuple[str, float, bool]] = []

    async def lease_at(name: str, at: float) -> None:
        """At virtual time ``at``: enter a lease; time out in the queue behind a run held
        elsewhere; enter one more and be revoked in its body."""
        nonlocal generation
        await asyncio.sleep(at)
        async with admission.lease("m") as lease:
            seen.append((name, lease.enqueue_time, False))
        admission.hold(GPU0, 1)
        with pytest.raises(QueueTimeout):
            async with admission.lease("m"):
                pass
        admission.hold(GPU0, 0)
        with pytest.raises(LeaseRevoked):
            async with admission.lease("m") as lease:
                assert admission.disconnect("local", generation)
                generation = admission.connect("local")
                await asyncio.sleep(1)  # cancelled here: this task's body, on this loop
        seen.append((name, lease.enqueue_time, lease.revoked))

    def other_thread() -> None:
        with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
            runner.run(lease_at("thread", 500.0))

    async def first() -> None:
        await lease_at("first", 100.0)
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()  # this task stays the current one of this loop meanwhile

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        runner.run(first())
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        runner.run(lease_at("second", 700.0))
    assert seen == [
        ("first", 100.0, False),
        ("first", 100.0 + TIMEOUT, True),
        ("thread", 500.0, False),
        ("thread", 500.0 + TIMEOUT, True),
        ("second", 700.0, False),
        ("second", 700.0 + TIMEOUT, True),
    ]

    async def under_trio() -> None:
        with pytest.raises(RuntimeError, match=r"^AsyncAdmission\.lease\(\) runs under asyncio only; under trio use"):
            async with admission.lease("m"):
                pass

    trio.run(under_trio)
    assert admission.provider_rows()[0]["in_flight"] == 0 and admission.waiters() == ()
