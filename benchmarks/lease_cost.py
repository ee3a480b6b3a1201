"""What a lease costs, by interleaved and shuffled rounds of CPU time, each ratio in one process.

A wall-clock median of separate runs moves with whatever else the box does between them; here
every contestant runs once per round, in a shuffled order, and each round's figure is the CPU
time (``time.process_time``) of that contestant's cycles divided by the reference's in the same
round. The ratio reported is the median over the rounds. Setup (the pool, the event loop) is
outside the timed part.

Contestants (trio), against the bare ``trio.CapacityLimiter`` cycle:

- ``limiter``: ``async with limiter`` -- the reference;
- ``hand_written``: what a user writes for what the lease promises: the limiter entered under
  ``trio.fail_after`` (a queue timeout) and the body in its own ``trio.CancelScope`` (so it can be
  revoked);
- ``lease``: ``async with admission.lease(model)``;
- ``unrevocable``: ``async with admission.lease(model, revocable=False)`` (no body scope).

The contended hand-off (capacity 1, 100 tasks on two model keys) compares the lease with the
limiter under the same load; the asyncio layer compares ``AsyncAdmission.lease`` with a bare
``asyncio.Semaphore`` and with the semaphore under ``asyncio.timeout`` (the hand-written
equivalent there).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Awaitable, Callable

import trio

from iop_admission import Admission, ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy
from iop_admission.aio import AsyncAdmission

GPU0 = ProviderKey("node-a", "gpu0")
QUEUE_TIMEOUT = 3600.0
Contestant = Callable[[int], float]
"""Runs ``n`` cycles and returns the CPU seconds they took."""


def single(capacity: int) -> PoolConfig:
    """One provider of ``capacity`` behind two model keys."""
    return PoolConfig(
        policy=QueuePolicy(max_queue=1_000, queue_timeout=QUEUE_TIMEOUT),
        providers={GPU0: ProviderSpec(capacity=capacity)},
        models={"ornith:35b": ModelGroup((GPU0,)), "ornith-fast": ModelGroup((GPU0,))},
    )


def _trio_cycles(make: Callable[[], Callable[[], Awaitable[None]]]) -> Contestant:
    def contestant(n: int) -> float:
        async def main() -> float:
            cycle = make()
            t0 = time.process_time()
            for _ in range(n):
                await cycle()
            return time.process_time() - t0

        return trio.run(main)

    return contestant


def _limiter() -> Callable[[], Awaitable[None]]:
    limiter = trio.CapacityLimiter(4)

    async def cycle() -> None:
        async with limiter:
            pass

    return cycle


def _hand_written() -> Callable[[], Awaitable[None]]:
    limiter = trio.CapacityLimiter(4)

    async def cycle() -> None:
        with trio.fail_after(QUEUE_TIMEOUT):
            await limiter.acquire()
        try:
            with trio.CancelScope():  # noqa: ASYNC100 -- the body's own scope (revocation); the body is empty here
                pass
        finally:
            limiter.release()

    return cycle


def _lease() -> Callable[[], Awaitable[None]]:
    admission = Admission(single(4))
    admission.connect("node-a")

    async def cycle() -> None:
        async with admission.lease("ornith:35b"):
            pass

    return cycle


def _unrevocable() -> Callable[[], Awaitable[None]]:
    admission = Admission(single(4))
    admission.connect("node-a")

    async def cycle() -> None:
        async with admission.lease("ornith:35b", revocable=False):
            pass

    return cycle


def _contended(use_lease: bool, tasks: int = 100) -> Contestant:
    def contestant(n: int) -> float:
        cycles = max(1, n // tasks)

        async def main() -> float:
            admission = Admission(single(1))
            admission.connect("node-a")
            limiter = trio.CapacityLimiter(1)
            models = ("ornith:35b", "ornith-fast")

            async def worker(i: int) -> None:
                for _ in range(cycles):
                    if use_lease:
                        async with admission.lease(models[i % 2]):
                            await trio.lowlevel.checkpoint()
                    else:
                        async with limiter:
                            await trio.lowlevel.checkpoint()

            t0 = time.process_time()
            async with trio.open_nursery() as nursery:
                for i in range(tasks):
                    nursery.start_soon(worker, i)
            return time.process_time() - t0

        return trio.run(main)

    return contestant


def _asyncio_cycles(kind: str) -> Contestant:
    def contestant(n: int) -> float:
        async def main() -> float:
            admission = AsyncAdmission(single(4))
            admission.connect("node-a")
            semaphore = asyncio.Semaphore(4)
            t0 = time.process_time()
            if kind == "lease":
                for _ in range(n):
                    async with admission.lease("ornith:35b"):
                        pass
            elif kind == "hand_written":
                for _ in range(n):
                    async with asyncio.timeout(QUEUE_TIMEOUT):
                        await semaphore.acquire()
                    try:
                        pass
                    finally:
                        semaphore.release()
            else:
                for _ in range(n):
                    async with semaphore:
                        pass
            return time.process_time() - t0

        return asyncio.run(main())

    return contestant


def interleaved(
    contestants: dict[str, Contestant], reference: str, n: int, rounds: int, seed: int = 1
) -> dict[str, float]:
    """The median over ``rounds`` of each contestant's CPU time / the reference's in the same round."""
    rng = random.Random(seed)
    ratios: dict[str, list[float]] = {name: [] for name in contestants if name != reference}
    for _ in range(rounds):
        order = list(contestants)
        rng.shuffle(order)
        spent = {name: contestants[name](n) for name in order}
        for name in ratios:
            ratios[name].append(spent[name] / spent[reference])
    return {name: statistics.median(values) for name, values in ratios.items()}


def run(rounds: int = 15, n: int = 20_000) -> dict[str, dict[str, float]]:
    """Every ratio, each from its own interleaved rounds."""
    return {
        "trio": interleaved(
            {
                "limiter": _trio_cycles(_limiter),
                "hand_written": _trio_cycles(_hand_written),
                "lease": _trio_cycles(_lease),
                "unrevocable": _trio_cycles(_unrevocable),
            },
            "limiter",
            n,
            rounds,
        ),
        "trio_contended": interleaved(
            {"limiter": _contended(False), "lease": _contended(True)}, "limiter", n // 4, rounds
        ),
        "asyncio": interleaved(
            {
                "semaphore": _asyncio_cycles("semaphore"),
                "hand_written": _asyncio_cycles("hand_written"),
                "lease": _asyncio_cycles("lease"),
            },
            "semaphore",
            n,
            rounds,
        ),
    }


TARGETS = {"trio": 2.5, "trio_unrevocable": 1.8, "trio_contended": 3.0, "asyncio": 5.0}
"""The lease's cost goals against the bare primitive (issue 42)."""


def table(result: dict[str, dict[str, float]]) -> str:
    """``run``'s ratios as a Markdown table, with the targets."""
    t, c, a = result["trio"], result["trio_contended"], result["asyncio"]
    rows = [
        "| cycle | lease / bare primitive | target | hand-written equivalent / bare | lease / hand-written |",
        "|---|---|---|---|---|",
        f"| trio, uncontended | {t['lease']:.2f}x `CapacityLimiter` | <= {TARGETS['trio']}x | {t['hand_written']:.2f}x "
        f"(limiter + `fail_after` + body `CancelScope`) | {t['lease'] / t['hand_written']:.2f}x |",
        f"| trio, uncontended, `revocable=False` | {t['unrevocable']:.2f}x `CapacityLimiter` | "
        f"<= {TARGETS['trio_unrevocable']}x | — | — |",
        f"| trio, contended hand-off (capacity 1, 100 tasks) | {c['lease']:.2f}x `CapacityLimiter` | "
        f"<= {TARGETS['trio_contended']}x | — | — |",
        f"| asyncio, uncontended | {a['lease']:.2f}x `asyncio.Semaphore` | <= {TARGETS['asyncio']}x | "
        f"{a['hand_written']:.2f}x (semaphore + `asyncio.timeout`) | {a['lease'] / a['hand_written']:.2f}x |",
    ]
    return "\n".join(rows)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.lease_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--cycles", type=int, default=20_000)
    args = parser.parse_args()
    print(table(run(args.rounds, args.cycles)))
