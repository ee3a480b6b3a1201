"""The choice index of a model group built by a prepared refresh (``_build_group``): its counts
of eligible and admitting candidates come from the candidates' state at that moment, so panic
mode and the choice behave as in a group that lived through the same events. [outlier-ejection]"""

from __future__ import annotations

import attrs
from tests.admission.steps import as_lease as _lease

from iop_admission import ModelGroup, OutlierPolicy, PoolConfig, ProviderKey, QueuePolicy
from iop_admission.core import AdmissionState, Lease, Waiter

BIG = "ornith:35b"
FAST = "ornith-fast"
GPU2 = ProviderKey("node-c", "gpu2")


def _config(pool, big: tuple[ProviderKey, ...]) -> PoolConfig:
    """gpu0 and gpu2 have a long slot, gpu1 none; FAST runs on gpu2 alone; one failure ejects for 10 s."""
    return PoolConfig(
        policy=QueuePolicy(max_queue=64, queue_timeout=30.0),
        providers={pool.gpu0: pool.spec(2, 1), pool.gpu1: pool.spec(1, 0), GPU2: pool.spec(2, 1)},
        models={BIG: ModelGroup(candidates=big), FAST: ModelGroup(candidates=(GPU2,))},
        outlier=OutlierPolicy(1, 10.0, 60.0),
    )


def _eject(core: AdmissionState, model: str, long: bool, now: float) -> Lease:
    lease = _lease(core.request(model, long, now))
    core.release(lease)
    core.report_failure(lease, now)
    return lease


def test_group_built_by_a_prepared_refresh_counts_its_long_candidates(pool):
    """BIG gains gpu2 (ejected already) and gpu1 (no long slot) in a prepared refresh; once gpu0,
    its only admitting long candidate, is ejected too, a long BIG request is in panic mode and is
    granted on an ejected candidate at once, like a normal one."""
    base = _config(pool, (pool.gpu0,))
    core = AdmissionState(base)
    for node in ("node-a", "node-b", "node-c"):
        core.connect(node)
    assert _eject(core, FAST, False, 0.0).provider == GPU2
    core.refresh(core.prepare_refresh(_config(pool, (pool.gpu0, GPU2, pool.gpu1))))
    assert _lease(core.request(BIG, True, 1.0)).provider == pool.gpu0  # gpu0 admits: no panic
    core.release(next(iter(core.live_leases())))
    assert _eject(core, BIG, True, 1.0).provider == pool.gpu0
    long = _lease(core.request(BIG, True, 2.0))
    assert long.provider in (pool.gpu0, GPU2) and not long.probe
    normal = _lease(core.request(BIG, False, 2.0))
    assert normal.provider == pool.gpu1  # gpu1 admits normal requests: no panic for them


def test_provider_losing_its_long_slots_in_a_prepared_refresh_leaves_long_panic_to_the_rest(pool):
    """gpu0 stays eligible and admitting but loses its long slot in a prepared refresh; once
    gpu1, BIG's other long candidate, is ejected, a long BIG request is in panic mode and gets
    the ejected gpu1 at once (gpu0 no longer counts as an admitting long candidate)."""
    two = {pool.gpu0: pool.spec(2, 1), pool.gpu1: pool.spec(2, 1, priority=1)}
    base = PoolConfig(
        policy=QueuePolicy(max_queue=64, queue_timeout=30.0),
        providers=two,
        models={BIG: ModelGroup(candidates=(pool.gpu0, pool.gpu1))},
        outlier=OutlierPolicy(1, 10.0, 60.0),
    )
    core = AdmissionState(base)
    core.connect("node-a")
    core.connect("node-b")
    core.refresh(core.prepare_refresh(attrs.evolve(base, providers={**two, pool.gpu0: pool.spec(2, 0)})))
    assert _eject(core, BIG, True, 0.0).provider == pool.gpu1
    long = _lease(core.request(BIG, True, 1.0))
    assert (long.provider, long.probe) == (pool.gpu1, False)


def test_a_provider_of_one_candidate_groups_joins_a_new_group_of_several_with_its_load(pool):
    """gpu0 and gpu1 each run a model key alone (groups of one keep no heap); a prepared refresh
    adds BIG over both, touching neither provider. BIG's choice index then follows their load:
    two grants fill both (capacity 1 each), and the third BIG request queues."""
    providers = {pool.gpu0: pool.spec(1, 0), pool.gpu1: pool.spec(1, 0)}
    alone = {"a": ModelGroup(candidates=(pool.gpu0,)), "b": ModelGroup(candidates=(pool.gpu1,))}
    base = PoolConfig(policy=QueuePolicy(max_queue=64, queue_timeout=30.0), providers=providers, models=alone)
    core = AdmissionState(base)
    core.connect("node-a")
    core.connect("node-b")
    core.release(_lease(core.request("a", False, 0.0)))  # a grant and a release on a provider of no heap
    core.refresh(core.prepare_refresh(attrs.evolve(base, models={**alone, BIG: ModelGroup((pool.gpu0, pool.gpu1))})))
    first, second = _lease(core.request(BIG, False, 1.0)), _lease(core.request(BIG, False, 1.0))
    assert {first.provider, second.provider} == {pool.gpu0, pool.gpu1}
    assert isinstance(core.request(BIG, False, 1.0), Waiter)
