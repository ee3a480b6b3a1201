"""Prove a service's own use of admission with ``iop_admission.testing``, on both layers.

Run it: ``python examples/testing_guard.py``. It needs the testing extra
(``pip install "iop-admission[testing]"``, which adds Hypothesis). Under pytest,
the two ``test_`` functions are ordinary tests.

``Guard`` is the service's own code: every request goes through it, and it
counts what runs per model. Hypothesis draws programs from ``CONFIG`` --
requests and bursts of them, bodies that end or fail, cancellations while
queued and while holding, node disconnects and reconnects, refreshes that
remove a GPU under live leases, clock advances -- and ``run_program`` runs each
against a fresh admission with ``Guard`` taking the leases, checking the
library's promises after every step (docs/testing.md lists them).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import AsyncIterator

from hypothesis import given, settings

from iop_admission import Admission, Lease, ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy, TenantSpec
from iop_admission.aio import AsyncAdmission
from iop_admission.testing import Client, Step, programs, run_program

GPU0 = ProviderKey("node-a", "gpu0")
GPU1 = ProviderKey("node-b", "gpu1")
CONFIG = PoolConfig(
    policy=QueuePolicy(max_queue=16, queue_timeout=10.0),
    providers={
        GPU0: ProviderSpec(capacity=2, long_context_capacity=1),
        GPU1: ProviderSpec(capacity=2, long_context_capacity=1),
    },
    models={"chat": ModelGroup([GPU0, GPU1]), "summarize": ModelGroup([GPU1])},
    tenants=(TenantSpec("free"), TenantSpec("paid", weight=3.0)),
)


class Guard:
    """The service's wrapper around admission: one lease per request, what runs counted per model."""

    def __init__(self, admission: Admission | AsyncAdmission) -> None:
        self.admission = admission
        self.running: collections.Counter[str] = collections.Counter()

    @contextlib.asynccontextmanager
    async def run(self, model: str, *, long: bool = False, tenant: str | None = None) -> AsyncIterator[Lease]:
        async with self.admission.lease(model, long=long, tenant=tenant) as lease:
            self.running[model] += 1
            try:
                yield lease
            finally:
                self.running[model] -= 1


def guard_client(admission: Admission | AsyncAdmission) -> Client:
    """The code under test, made once per program: each call goes through one ``Guard``."""
    guard = Guard(admission)
    return lambda ask: guard.run(ask.model, long=ask.long, tenant=ask.tenant)


@settings(max_examples=100, deadline=None)
@given(program=programs(CONFIG))
def test_guard_on_trio(program: list[Step]) -> None:
    run_program(program, CONFIG, layer="trio", client=guard_client)


@settings(max_examples=100, deadline=None)
@given(program=programs(CONFIG))
def test_guard_on_asyncio(program: list[Step]) -> None:
    run_program(program, CONFIG, layer="asyncio", client=guard_client)


if __name__ == "__main__":
    test_guard_on_trio()
    test_guard_on_asyncio()
    print("Guard kept every promise on trio and asyncio (100 programs each)")
