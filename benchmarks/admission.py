"""Admission micro-benchmarks, each against a reference measured in the same run.

1. The lease's cost (:mod:`benchmarks.lease_cost`): interleaved, shuffled rounds of CPU time,
   the trio lease against the bare ``trio.CapacityLimiter`` and the hand-written equivalent
   (limiter + ``fail_after`` + body ``CancelScope``), the contended hand-off (capacity 1, 100
   tasks) against the limiter, the asyncio lease against ``asyncio.Semaphore`` (and the
   semaphore under ``asyncio.timeout``).
2. The floor: each part a trio lease cannot do without, measured alone.
3. Scaling: one release + re-evaluation (and the request that refills the
   queue) with 10, 1,000 and 10,000 waiters spread over 50 model groups and 20
   providers, on the sans-I/O core.
4. Candidate choice [candidate-choice-scale]: one admission cycle (grant and
   release) on a model key with 10,000 candidates, half of them partly loaded,
   vs a model key with 2, the smallest the index serves (a key of 1 candidate is
   chosen without it): ``async with admission.lease(...)`` and the
   core's ``request`` + ``release`` alone.

Each figure of 2-4 is the median of ``--runs`` runs (default 5); 1 runs ``3 * runs`` rounds. Run with
``python -m benchmarks admission``.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable

import trio

from iop_admission import (
    Admission,
    ModelGroup,
    PoolConfig,
    ProviderKey,
    ProviderSpec,
    QueuePolicy,
)
from iop_admission.core import AdmissionState, Granted, Lease

from . import lease_cost

GPU0 = ProviderKey("node-a", "gpu0")


def _single(capacity: int) -> PoolConfig:
    return PoolConfig(
        policy=QueuePolicy(max_queue=1_000, queue_timeout=3600.0),
        providers={GPU0: ProviderSpec(capacity=capacity)},
        models={"ornith:35b": ModelGroup((GPU0,)), "ornith-fast": ModelGroup((GPU0,))},
    )


def _median(fn: Callable[[], float], runs: int) -> float:
    return statistics.median(fn() for _ in range(runs))


# ------------------------------------------------------------------ uncontended


def _uncontended_semaphore(n: int) -> float:
    async def main() -> float:
        semaphore = asyncio.Semaphore(4)
        t0 = time.perf_counter()
        for _ in range(n):
            async with semaphore:
                pass
        return (time.perf_counter() - t0) / n

    return asyncio.run(main())


def _uncontended_limiter(n: int) -> float:
    async def main() -> float:
        limiter = trio.CapacityLimiter(4)
        t0 = time.perf_counter()
        for _ in range(n):
            async with limiter:
                pass
        return (time.perf_counter() - t0) / n

    return trio.run(main)


# ------------------------------------------------------------------------ floor


def _floor_parts(n: int) -> dict[str, float]:
    """Seconds per call of each part a lease cycle cannot do without, measured alone.

    - ``checkpoints``: the limiter's own checkpoint pair (``checkpoint_if_cancelled``, then
      ``cancel_shielded_checkpoint``): a trio lease enters with the same;
    - ``body_scope``: one ``trio.CancelScope`` entered and exited: the scope around the lease's
      body that revocation cancels (a fenced node, a removed provider);
    - ``core``: the sans-I/O core's ``request`` + ``release`` of an uncontended lease, the decision
      itself (with nothing else, it is also the asyncio layer's floor: ``asyncio.Semaphore``'s
      uncontended cycle never yields).
    """

    async def main() -> dict[str, float]:
        t0 = time.perf_counter()
        for _ in range(n):
            await trio.lowlevel.checkpoint_if_cancelled()
            await trio.lowlevel.cancel_shielded_checkpoint()
        checkpoints = (time.perf_counter() - t0) / n
        t0 = time.perf_counter()
        for _ in range(n):
            scope = trio.CancelScope()  # entered and exited as the trio layer does around a body
            scope.__enter__()
            scope.__exit__(None, None, None)
        body_scope = (time.perf_counter() - t0) / n
        return {"checkpoints": checkpoints, "body_scope": body_scope}

    parts = trio.run(main)
    core = AdmissionState(_single(4))
    core.connect("node-a")
    t0 = time.perf_counter()
    for _ in range(n):
        lease = core.request("ornith:35b", False, 0.0)
        assert type(lease) is Lease
        core.release(lease)
    parts["core"] = (time.perf_counter() - t0) / n
    return parts


# ------------------------------------------------------------- candidate choice


def _fleet(candidates: int) -> Admission:
    """A model key ``m`` over ``candidates`` providers (one per node), half of them partly loaded."""
    keys = [ProviderKey(f"node-{i}", "gpu0") for i in range(candidates)]
    admission = Admission(
        PoolConfig(
            policy=QueuePolicy(max_queue=1_000, queue_timeout=3600.0),
            providers={k: ProviderSpec(capacity=4, long_context_capacity=1) for k in keys},
            models={"m": ModelGroup(tuple(keys))},
        )
    )
    for k in keys:
        admission.connect(k.node_id)
    rng = random.Random(3)
    core = admission._core
    for k in rng.sample(keys, candidates // 2):
        for _ in range(rng.randint(1, 3)):  # preload: no request behind it
            core._dispatcher.grant(core._pool.providers[k], "m", False, 0, 0.0)
    return admission


def _choice_cycle(candidates: int, n: int, core_only: bool) -> float:
    admission = _fleet(candidates)
    core = admission._core

    async def main() -> float:
        t0 = time.perf_counter()
        if core_only:
            for _ in range(n):
                lease = core.request("m", False, 0.0)
                assert isinstance(lease, Lease)
                core.release(lease)
        else:
            for _ in range(n):
                async with admission.lease("m"):
                    pass
        return (time.perf_counter() - t0) / n

    return trio.run(main)


# ---------------------------------------------------------------------- scaling


def _scaling(waiters: int, ops: int, seed: int = 7) -> float:
    rng = random.Random(seed)
    keys = [ProviderKey(f"node-{i % 5}", f"gpu{i}") for i in range(20)]
    models = {f"model-{m}": ModelGroup(tuple(rng.sample(keys, rng.randint(1, 3)))) for m in range(50)}
    config = PoolConfig(
        policy=QueuePolicy(max_queue=waiters + 1_000, queue_timeout=3600.0),
        providers={k: ProviderSpec(capacity=2) for k in keys},
        models=models,
    )
    core = AdmissionState(config)
    for node in {k.node_id for k in keys}:
        core.connect(node)
    names = list(models)
    leases: list[Lease] = []
    # Fill every provider, then queue ``waiters`` requests.
    while len(leases) < 2 * len(keys) or core.queue_depth < waiters:
        result = core.request(rng.choice(names), False, 0.0)
        if isinstance(result, Lease):
            leases.append(result)
        elif core.queue_depth > waiters:
            core.withdraw(result)
    picks = [rng.randrange(len(leases)) for _ in range(ops)]
    refills = [rng.choice(names) for _ in range(ops)]
    clock = time.perf_counter
    spent = 0.0
    for i in range(ops):
        j = picks[i]
        lease = leases[j]
        t0 = clock()
        decisions = core.release(lease)  # the release and the re-evaluation it triggers
        spent += clock() - t0
        for d in decisions:
            assert isinstance(d, Granted)
            leases[j] = d.lease
        if not decisions:
            # The released provider had no waiter for it; take the slot back.
            while True:
                result = core.request(refills[i], False, 0.0)
                if isinstance(result, Lease):
                    leases[j] = result
                    break
                core.withdraw(result)
                refills[i] = rng.choice(names)
        else:
            core.request(refills[i], False, 0.0)  # keep the queue at its size
    assert core.queue_depth >= waiters - 1
    return spent / ops


def run(runs: int = 5) -> dict[str, object]:
    """Run the three admission benchmarks and return their figures."""
    n = 20_000
    cost = lease_cost.run(rounds=3 * runs, n=n)
    limiter = _median(lambda: _uncontended_limiter(n), runs)
    semaphore = _median(lambda: _uncontended_semaphore(n), runs)
    floor_runs = [_floor_parts(n) for _ in range(runs)]
    floor = {k: statistics.median(r[k] for r in floor_runs) for k in floor_runs[0]}
    scaling = {w: _median(lambda w=w: _scaling(w, 20_000), runs) for w in (10, 1_000, 10_000)}
    # Against 2 candidates, the smallest model key the choice index serves (a key of one
    # candidate is chosen without it: cheaper, and not what the index's scale is about).
    choice = {
        (c, core_only): _median(lambda c=c, k=core_only: _choice_cycle(c, n, k), runs)
        for c in (2, 10_000)
        for core_only in (False, True)
    }
    return {
        "cost": cost,
        "limiter_us": limiter * 1e6,
        "semaphore_us": semaphore * 1e6,
        "floor": {
            **{f"{k}_us": v * 1e6 for k, v in floor.items()},
            "trio_us": sum(floor.values()) * 1e6,
            "trio_ratio": sum(floor.values()) / limiter,
            "asyncio_ratio": floor["core"] / semaphore,
        },
        "scaling": {
            "release_us": {str(w): t * 1e6 for w, t in scaling.items()},
            "ratio_10000_vs_10": scaling[10_000] / scaling[10],
            "target": "<= 3x",
        },
        "choice": {
            "lease_us": {"2": choice[2, False] * 1e6, "10000": choice[10_000, False] * 1e6},
            "core_us": {"2": choice[2, True] * 1e6, "10000": choice[10_000, True] * 1e6},
            "lease_ratio": choice[10_000, False] / choice[2, False],
            "core_ratio": choice[10_000, True] / choice[2, True],
            "target": "<= 1.2x",
        },
        "runs": runs,
    }


def table(result: dict[str, object]) -> str:
    """Format :func:`run`'s result as a Markdown table."""
    cost = result["cost"]
    limiter, semaphore = result["limiter_us"], result["semaphore_us"]
    s = result["scaling"]
    ch = result["choice"]
    assert isinstance(cost, dict) and isinstance(s, dict) and isinstance(ch, dict)
    assert isinstance(limiter, float) and isinstance(semaphore, float)
    rel = s["release_us"]
    f = result["floor"]
    assert isinstance(f, dict)
    lines = [
        "| benchmark | ours | reference | ratio | target |",
        "|---|---|---|---|---|",
        f"| floor: checkpoint pair {f['checkpoints_us']:.2f} + body CancelScope {f['body_scope_us']:.2f} + core "
        f"request/release {f['core_us']:.2f} µs | {f['trio_us']:.2f} µs | CapacityLimiter {limiter:.2f} µs "
        f"| {f['trio_ratio']:.2f}x | — (the least a trio lease with revocation costs) |",
        f"| asyncio floor: core request/release | {f['core_us']:.2f} µs | asyncio.Semaphore "
        f"{semaphore:.2f} µs | {f['asyncio_ratio']:.2f}x | — (the least an asyncio lease costs) |",
        f"| release + re-evaluation, 10 / 1,000 / 10,000 waiters | {rel['10']:.2f} / {rel['1000']:.2f} "
        f"/ {rel['10000']:.2f} µs | 10 waiters | {s['ratio_10000_vs_10']:.2f}x | <= 3x |",
        f"| lease cycle, model key with 10,000 candidates | {ch['lease_us']['10000']:.2f} µs | 2 candidates "
        f"{ch['lease_us']['2']:.2f} µs | {ch['lease_ratio']:.2f}x | <= 1.2x |",
        f"| core request + release, 10,000 candidates | {ch['core_us']['10000']:.2f} µs | 2 candidates "
        f"{ch['core_us']['2']:.2f} µs | {ch['core_ratio']:.2f}x | — (the core alone: the index's O(log n) depth) |",
    ]
    return lease_cost.table(cost) + "\n\n" + "\n".join(lines)
