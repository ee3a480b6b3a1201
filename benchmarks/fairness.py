"""Fair share in-process: ``python -m benchmarks.fairness``.

Drives :class:`iop_admission.core.FairShare` alone (no Edge, no Node):
the 1:1:2 share of three flooding tenants on a capacity-4 provider over 10,000
grants, token mode (8,000- against 500-token prompts, one million tokens), and
the decision cost of a grant+release cycle with 1,000 tenants and 10,000
waiters as a ratio to one tenant with 10,000 waiters, measured in the same run.
Then the same cycle through the wired admission core (``AdmissionState``: a
release that grants the next waiter, and a new request), 1,000 tenants against
no tenants configured (the global FIFO), 10,000 waiters on a capacity-4 provider;
and the whole lease cycle through the trio layer, 10,000 tasks asking at once.
"""

from __future__ import annotations

import statistics
import time

import trio

from iop_admission import Admission, ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy, TenantSpec
from iop_admission.core import AdmissionState, FairShare, Granted


def share(grants: int = 10_000) -> dict[str, float]:
    core = FairShare([TenantSpec("a"), TenantSpec("b"), TenantSpec("c", weight=2)])
    held: list[object] = []
    for name in ("a", "b", "c"):
        for n in range(grants):
            core.enqueue(name, (name, n))
    for _ in range(grants):
        if len(held) == 4:
            core.release(held.pop(0))  # type: ignore[arg-type]
        ticket = core.grant(lambda item: len(held) < 4)
        assert ticket is not None
        held.append(ticket)
    return {n: 100 * core.grants(n) / grants for n in ("a", "b", "c")}


def tokens(total: float = 1_000_000) -> dict[str, float]:
    core = FairShare([TenantSpec("big"), TenantSpec("small")])
    for n in range(200):
        core.enqueue("big", n, 8000.0)
    for n in range(3000):
        core.enqueue("small", n, 500.0)
    used = 0.0
    while used < total:
        ticket = core.grant()
        assert ticket is not None
        core.settle(ticket, ticket.cost * 0.9)
        core.release(ticket)
        used += ticket.charged
    return {"big": core.served("big"), "small": core.served("small")}


def cycle(tenants: int, waiters: int, cycles: int = 2_000) -> float:
    """Seconds per grant+release+enqueue cycle with ``waiters`` queued over ``tenants``."""
    core = FairShare([TenantSpec(f"t{i}") for i in range(tenants)])
    names = [f"t{i}" for i in range(tenants)]
    for n in range(waiters):
        core.enqueue(names[n % tenants], n)
    start = time.perf_counter()
    for n in range(cycles):
        ticket = core.grant()
        assert ticket is not None
        core.release(ticket)
        core.enqueue(ticket.tenant, waiters + n)
    return (time.perf_counter() - start) / cycles


def core_cycle(tenants: int, waiters: int = 10_000, cycles: int = 20_000) -> float:
    """Seconds per release (granting the next waiter) + request through ``AdmissionState``.

    ``tenants`` 0: none configured (today's FIFO); otherwise weights 1, 2, 3 in turn.
    """
    key = ProviderKey("node", "gpu")
    spec = ProviderSpec(capacity=4, long_context_capacity=1, context_window_tokens=32768, total_context_tokens=32768)
    specs = tuple(TenantSpec(f"t{i}", weight=1 + i % 3) for i in range(tenants))
    state = AdmissionState(
        PoolConfig(
            policy=QueuePolicy(max_queue=10 * waiters, queue_timeout=1e9),
            providers={key: spec},
            models={"m": ModelGroup(candidates=(key,))},
            tenants=specs,
        )
    )
    state.connect("node")
    names = [s.name for s in specs] or [None]
    held = [state.request("m", False, 0.0, names[0]) for _ in range(4)]
    for n in range(waiters):
        state.request("m", False, 0.0, names[n % len(names)])
    start = time.perf_counter()
    for _ in range(cycles):
        (granted,) = state.release(held.pop(0))  # type: ignore[arg-type]
        assert isinstance(granted, Granted)
        held.append(granted.lease)
        state.request("m", False, 0.0, granted.lease.tenant)
    return (time.perf_counter() - start) / cycles


def lease_cycle(tenants: int, requests: int = 10_000) -> float:
    """Seconds per lease through the trio layer: ``requests`` tasks all asking at once
    (so up to that many waiting) on a capacity-4 provider, over ``tenants`` (0: none configured)."""
    key = ProviderKey("node", "gpu")
    spec = ProviderSpec(capacity=4, long_context_capacity=1, context_window_tokens=32768, total_context_tokens=32768)
    specs = tuple(TenantSpec(f"t{i}", weight=1 + i % 3) for i in range(tenants))
    admission = Admission(
        PoolConfig(
            policy=QueuePolicy(max_queue=2 * requests, queue_timeout=1e9),
            providers={key: spec},
            models={"m": ModelGroup(candidates=(key,))},
            tenants=specs,
        )
    )
    admission.connect("node")
    names = [s.name for s in specs] or [None]

    async def one(name: str | None) -> None:
        async with admission.lease("m", tenant=name):
            await trio.lowlevel.checkpoint()

    async def run() -> float:
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for n in range(requests):
                nursery.start_soon(one, names[n % len(names)])
        return (time.perf_counter() - start) / requests

    return trio.run(run)


def main() -> None:
    print("share 1:1:2 over 10,000 grants (%):", {k: round(v, 2) for k, v in share().items()})
    served = tokens()
    print("tokens served (8,000 vs 500-token prompts):", {k: round(v) for k, v in served.items()})
    one = statistics.median(cycle(1, 10_000) for _ in range(3))
    many = statistics.median(cycle(1_000, 10_000) for _ in range(3))
    print(f"decision cost: 1 tenant {one * 1e6:.1f} us, 1,000 tenants {many * 1e6:.1f} us, ratio {many / one:.1f}x")
    none = statistics.median(core_cycle(0) for _ in range(3))
    wired = statistics.median(core_cycle(1_000) for _ in range(3))
    print(
        f"admission core cycle, 10,000 waiters: no tenants {none * 1e6:.1f} us,"
        f" 1,000 tenants {wired * 1e6:.1f} us, ratio {wired / none:.1f}x"
    )
    plain = statistics.median(lease_cycle(0) for _ in range(3))
    fair = statistics.median(lease_cycle(1_000) for _ in range(3))
    print(
        f"trio lease cycle, 10,000 tasks asking at once: no tenants {plain * 1e6:.1f} us,"
        f" 1,000 tenants {fair * 1e6:.1f} us, ratio {fair / plain:.1f}x"
    )


if __name__ == "__main__":
    main()
