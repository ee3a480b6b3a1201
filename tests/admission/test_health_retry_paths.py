"""Targeted sans-I/O tests of the health and retry paths the state machine reaches only now and then.

Each test pins one path with exact steps, so the bug it guards against is caught
in every run, not when Hypothesis happens to get there: a probe out closes its
provider to ordinary grants; a queued retry goes back to its arrival place (the
order ``expire()`` walks); a refresh keeps what a queued retry has tried.
"""

from __future__ import annotations

import attrs
import pytest
from tests.admission.steps import as_lease as _lease
from tests.admission.steps import as_waiter as _waiter

from iop_admission import (
    ModelGroup,
    ModelNotFound,
    OutlierPolicy,
    PoolConfig,
    ProviderKey,
    ProviderSpec,
    QueuePolicy,
    QueueTimeout,
    RetriesExhausted,
    RetryPolicy,
    Unavailable,
)
from iop_admission.core import AdmissionState, Ejected, Failed, Granted, WaiterState

BIG = "ornith:35b"
FAST = "ornith-fast"


def _core(config: PoolConfig) -> AdmissionState:
    core = AdmissionState(config)
    for node in {key.node_id for key in config.providers}:
        core.connect(node)
    return core


@pytest.mark.req("outlier-ejection")
@pytest.mark.parametrize("model", [BIG, FAST])
def test_probe_out_closes_provider_to_ordinary_grants(pool, model):
    """[outlier-ejection] while gpu0's probe runs, BIG (gpu0 preferred, room left) goes to gpu1;
    FAST, whose only candidate is probing, is in panic mode: granted on gpu0, but not as a second probe."""
    config = attrs.evolve(
        pool.two_nodes(gpu0=pool.spec(capacity=3), gpu1=pool.spec(capacity=3, priority=-1)),
        outlier=OutlierPolicy(1, 1.0, 4.0),
    )
    core = _core(config)
    first = _lease(core.request(BIG, False, 0.0))
    assert first.provider == pool.gpu0
    core.release(first)
    core.report_failure(first, 0.0)
    assert core.advance(1.0) == []
    probe = _lease(core.request(BIG, False, 1.0))
    assert (probe.provider, probe.probe) == (pool.gpu0, True)
    after = _lease(core.request(model, False, 1.0))
    if model == BIG:  # gpu1 is admitting: the ordinary grant must not go to the probing gpu0
        assert (after.provider, after.probe) == (pool.gpu1, False)
    else:  # FAST's only candidate is probing: panic mode, a grant beside the probe, not a second probe
        assert (after.provider, after.probe) == (pool.gpu0, False)
        assert core.panic_models() == (FAST,)
    assert [p.health for p in core.provider_snapshots() if p.provider_id == "gpu0"] == ["ejected"]


@pytest.mark.req("failover-before-first-byte")
def test_queued_retry_takes_its_arrival_place_and_expires_there(pool):
    """A retry queued behind a later arrival goes back before it: waiters() lists it first and
    expire() at its deadline returns it, although the later waiter is still in time."""
    core = _core(pool.two_nodes(gpu1=pool.spec(priority=-1), queue_timeout=10.0))
    first = _lease(core.request(BIG, False, 0.0))
    second = _lease(core.request(BIG, False, 0.0))
    assert (first.provider, second.provider) == (pool.gpu0, pool.gpu1)
    third = _waiter(core.request(BIG, False, 1.0))
    fourth = _waiter(core.request(BIG, False, 2.0))
    [grant] = core.release(first)  # gpu0 goes to the third arrival
    assert isinstance(grant, Granted) and grant.waiter is third
    retried = _waiter(core.retry(first, 3.0))  # gpu0 tried, gpu1 busy: queued at arrival place 1
    assert retried.seq == first.arrival < fourth.seq
    assert list(core.waiters()) == [retried, fourth]
    assert core.expire(9.9) == []
    assert core.expire(10.0) == [retried]
    assert list(core.waiters()) == [fourth] and fourth.state is WaiterState.QUEUED
    assert core.expire(12.0) == [fourth]


@pytest.mark.req("failover-before-first-byte")
def test_queued_retry_is_granted_before_later_arrivals(pool):
    """A queued retry gets the next free candidate before a waiter that arrived after the request."""
    core = _core(pool.two_nodes(gpu1=pool.spec(priority=-1)))
    first = _lease(core.request(BIG, False, 0.0))
    second = _lease(core.request(BIG, False, 0.0))
    third = _waiter(core.request(BIG, False, 1.0))
    fourth = _waiter(core.request(BIG, False, 1.0))
    [to_third] = core.release(first)
    assert to_third.waiter is third and to_third.lease.provider == pool.gpu0
    retried = _waiter(core.retry(first, 2.0))
    [grant] = core.release(second)
    assert grant.waiter is retried and grant.lease.tried == (pool.gpu0, pool.gpu1)
    assert fourth.state is WaiterState.QUEUED and list(core.waiters()) == [fourth]


@pytest.mark.req("failover-before-first-byte", "refresh-consistency")
@pytest.mark.parametrize("prepared", [False, True])
@pytest.mark.parametrize("change", ["timeout", "same", "groups"])
def test_refresh_keeps_what_a_queued_retry_tried(pool, prepared, change):
    """A refresh while a retry is queued: the retry still excludes gpu0 (the provider that just
    failed it), though gpu0 is free and preferred; it waits for gpu1 and gets it next."""
    base = pool.two_nodes(gpu1=pool.spec(priority=-1))
    core = _core(base)
    first = _lease(core.request(BIG, False, 0.0))
    second = _lease(core.request(BIG, False, 0.0))
    core.release(first)
    retried = _waiter(core.retry(first, 1.0))
    assert retried.candidates == (pool.gpu1,)
    if change == "timeout":
        config = attrs.evolve(base, policy=QueuePolicy(max_queue=64, queue_timeout=20.0))
    elif change == "same":
        config = base
    else:  # the model groups are rebuilt: a new group object for BIG
        config = attrs.evolve(base, models=dict(base.models))
    assert core.refresh(core.prepare_refresh(config) if prepared else config) == []
    assert retried.state is WaiterState.QUEUED and retried.tried == (pool.gpu0,)
    assert retried.candidates == (pool.gpu1,)
    assert list(core.waiters()) == [retried]
    [grant] = core.release(second)
    assert grant.waiter is retried and grant.lease.provider == pool.gpu1
    assert grant.lease.tried == (pool.gpu0, pool.gpu1)


@pytest.mark.req("outlier-ejection", "failover-before-first-byte")
@pytest.mark.parametrize("long", [False, True])
def test_retry_in_panic_mode_of_its_own(pool, long):
    """A retry whose only untried candidate is ejected is in panic mode of its own and is granted
    there at once, though its model is not in panic (gpu0, which it tried, is healthy and free);
    a request of the same model goes to gpu0, not to the ejected gpu1; a third attempt has no
    candidate left."""
    config = attrs.evolve(
        pool.two_nodes(gpu1=pool.spec(priority=-1)), outlier=OutlierPolicy(1, 10.0, 10.0), retry=RetryPolicy(3)
    )
    core = _core(config)
    first = _lease(core.request(BIG, long, 0.0))
    second = _lease(core.request(BIG, long, 0.0))
    assert (first.provider, second.provider) == (pool.gpu0, pool.gpu1)
    core.release(second)
    [ejected] = core.report_failure(second, 0.0)
    assert isinstance(ejected, Ejected) and ejected.provider == pool.gpu1
    core.release(first)
    assert core.panic_models() == ()
    retried = _lease(core.retry(first, 1.0))
    assert (retried.provider, retried.probe, retried.tried) == (pool.gpu1, False, (pool.gpu0, pool.gpu1))
    other = _lease(core.request(BIG, long, 1.0))
    assert other.provider == pool.gpu0
    core.release(retried)
    with pytest.raises(Unavailable):  # both candidates tried: none left, whatever their health
        core.retry(retried, 2.0)


GPU2 = ProviderKey("node-b", "gpu2")


def _three(pool, gpu0: ProviderSpec, gpu1: ProviderSpec, gpu2: ProviderSpec) -> PoolConfig:
    """BIG on gpu0, gpu2, gpu1 (in that order); one failure ejects for 10 s."""
    return PoolConfig(
        policy=QueuePolicy(),
        providers={pool.gpu0: gpu0, pool.gpu1: gpu1, GPU2: gpu2},
        models={BIG: ModelGroup(candidates=(pool.gpu0, GPU2, pool.gpu1))},
        outlier=OutlierPolicy(1, 10.0, 10.0),
    )


@pytest.mark.req("outlier-ejection", "failover-before-first-byte")
def test_long_retry_panic_ignores_candidates_without_long_slots(pool):
    """A long retry's untried candidates: gpu2 (admitting, no long slot) and gpu1 (ejected): gpu2
    could never run it, so the retry is in panic mode and granted on gpu1 at once."""
    core = _core(_three(pool, pool.spec(), pool.spec(2, priority=-1), pool.spec(2, 0, priority=-2)))
    first = _lease(core.request(BIG, True, 0.0))
    second = _lease(core.request(BIG, True, 0.0))
    assert (first.provider, second.provider) == (pool.gpu0, pool.gpu1)
    core.release(second)
    core.report_failure(second, 0.0)
    core.release(first)
    retried = _lease(core.retry(first, 1.0))
    assert (retried.provider, retried.long, retried.probe) == (pool.gpu1, True, False)


@pytest.mark.req("outlier-ejection", "failover-before-first-byte")
def test_retry_not_in_panic_while_an_untried_candidate_admits(pool):
    """A retry's untried candidates: gpu1 (healthy, full) and gpu2 (ejected, free): not panic mode,
    so the retry waits for gpu1 instead of going to the ejected gpu2."""
    core = _core(_three(pool, pool.spec(), pool.spec(1, priority=-1), pool.spec(2, priority=-2)))
    first, second, third = (_lease(core.request(BIG, False, 0.0)) for _ in range(3))
    assert (first.provider, second.provider, third.provider) == (pool.gpu0, pool.gpu1, GPU2)
    core.release(third)
    core.report_failure(third, 0.0)
    core.release(first)
    retried = _waiter(core.retry(first, 1.0))
    assert retried.candidates == (GPU2, pool.gpu1)
    [grant] = core.release(second)
    assert grant.waiter is retried and grant.lease.provider == pool.gpu1


@pytest.mark.req("outlier-ejection", "failover-before-first-byte")
def test_long_retry_in_panic_waits_for_a_long_slot(pool):
    """In panic mode a long retry still needs a free long slot: gpu1 (ejected) has a free slot but
    its one long slot is held by the lease that failed, so the retry waits."""
    core = _core(_three(pool, pool.spec(), pool.spec(2, priority=-1), pool.spec(2, 0, priority=-2)))
    first = _lease(core.request(BIG, True, 0.0))
    second = _lease(core.request(BIG, True, 0.0))
    core.report_failure(second, 0.0)  # gpu1 ejected, its long slot still held
    core.release(first)
    retried = _waiter(core.retry(first, 1.0))
    assert retried.candidates == (GPU2, pool.gpu1)
    [grant] = core.release(second)
    assert grant.waiter is retried and grant.lease.provider == pool.gpu1 and grant.lease.long


@pytest.mark.req("outlier-ejection", "refresh-consistency")
@pytest.mark.parametrize("prepared", [False, True])
def test_provider_back_in_config_starts_healthy_and_old_reports_are_stale(pool, prepared):
    """gpu0 ejected, then probing, leaves the config while two leases of it run (one from before
    the ejection, the probe) and comes back: it is healthy, admits ordinary grants (BIG prefers it
    again, no panic mode), counts failures
    from zero, ejects for the base time again, and the reports of both old leases change nothing."""
    config = attrs.evolve(
        pool.two_nodes(gpu0=pool.spec(capacity=5), gpu1=pool.spec(priority=-1)),
        outlier=OutlierPolicy(2, 1.0, 8.0),
    )
    core = _core(config)
    old, a, b = (_lease(core.request(FAST, False, 0.0)) for _ in range(3))
    assert core.report_failure(a, 0.0) == []
    assert [type(d) for d in core.report_failure(b, 0.0)] == [Ejected]
    core.release(a)
    core.release(b)
    core.advance(1.0)
    probe = _lease(core.request(FAST, False, 1.0))
    assert (probe.provider, probe.probe) == (pool.gpu0, True)
    without = pool.single(pool.gpu1)
    core.refresh(core.prepare_refresh(without) if prepared else without)
    core.refresh(core.prepare_refresh(config) if prepared else config)
    assert [p.health for p in core.provider_snapshots() if p.provider_id == "gpu0"] == ["online"]
    assert core.panic_models() == ()
    preferred = _lease(core.request(BIG, False, 1.0))  # gpu0 is admitting: BIG prefers it to gpu1
    assert (preferred.provider, preferred.probe) == (pool.gpu0, False)
    assert core.report_failure(probe, 1.0) == []
    assert core.report_failure(old, 1.0) == []
    fresh = _lease(core.request(FAST, False, 1.0))
    assert (fresh.provider, fresh.probe) == (pool.gpu0, False)
    assert core.report_failure(fresh, 1.0) == []
    again = _lease(core.request(FAST, False, 1.0))
    assert (again.provider, again.probe) == (pool.gpu0, False)
    ejected = core.report_failure(again, 1.0)
    assert [(d.provider, d.until, d.duration, d.failures) for d in ejected if isinstance(d, Ejected)] == [
        (pool.gpu0, 2.0, 1.0, 2)
    ]
    assert core.next_ejection_end() == 2.0


@pytest.mark.req("outlier-ejection")
def test_restore_makes_reports_of_leases_from_before_stale(pool):
    """gpu0 restored by its probe's success: the failures of a lease granted before the ejection
    and of one granted in panic mode during it are stale (each would eject it again at threshold 1)."""
    config = attrs.evolve(pool.two_nodes(gpu0=pool.spec(capacity=3)), outlier=OutlierPolicy(1, 1.0, 4.0))
    core = _core(config)
    before, failing = (_lease(core.request(FAST, False, 0.0)) for _ in range(2))
    assert [type(d) for d in core.report_failure(failing, 0.0)] == [Ejected]
    core.release(failing)
    panic = _lease(core.request(FAST, False, 0.5))  # FAST's only candidate is ejected: panic mode
    assert (panic.provider, panic.probe) == (pool.gpu0, False)
    core.advance(1.0)
    probe = _lease(core.request(FAST, False, 1.0))
    assert probe.probe
    assert [type(d).__name__ for d in core.report_success(probe, 1.0)] == ["Restored"]
    core.release(probe)
    assert core.report_failure(panic, 1.0) == []
    assert core.report_failure(before, 1.0) == []
    assert [p.health for p in core.provider_snapshots() if p.provider_id == "gpu0"] == ["online"]


@pytest.mark.req("outlier-ejection")
def test_probe_released_without_report_reopens_for_the_next_probe(pool):
    """gpu0's probe ends without a report (released): the next BIG request probes gpu0 again,
    rather than going to the less preferred gpu1."""
    config = attrs.evolve(pool.two_nodes(gpu1=pool.spec(priority=-1)), outlier=OutlierPolicy(1, 1.0, 4.0))
    core = _core(config)
    first = _lease(core.request(BIG, False, 0.0))
    core.release(first)
    core.report_failure(first, 0.0)
    core.advance(1.0)
    probe = _lease(core.request(BIG, False, 1.0))
    assert (probe.provider, probe.probe) == (pool.gpu0, True)
    core.release(probe)
    again = _lease(core.request(BIG, False, 1.0))
    assert (again.provider, again.probe) == (pool.gpu0, True)


@pytest.mark.req("outlier-ejection")
def test_second_ejection_makes_reports_of_the_first_ones_panic_leases_stale(pool):
    """A lease granted in panic mode during gpu0's first ejection is still running when gpu0,
    restored, is ejected again: its success must not restore gpu0 from the second ejection."""
    config = attrs.evolve(pool.two_nodes(gpu0=pool.spec(capacity=3)), outlier=OutlierPolicy(1, 1.0, 4.0))
    core = _core(config)
    failing = _lease(core.request(FAST, False, 0.0))
    core.release(failing)
    core.report_failure(failing, 0.0)
    panic = _lease(core.request(FAST, False, 0.5))
    assert (panic.provider, panic.probe) == (pool.gpu0, False)
    core.advance(1.0)
    probe = _lease(core.request(FAST, False, 1.0))
    assert probe.probe
    core.report_success(probe, 1.0)
    core.release(probe)
    again = _lease(core.request(FAST, False, 1.0))
    assert [type(d) for d in core.report_failure(again, 1.0)] == [Ejected]
    assert core.report_success(panic, 1.5) == []
    assert [p.health for p in core.provider_snapshots() if p.provider_id == "gpu0"] == ["ejected"]


@pytest.mark.req("outlier-ejection")
def test_advance_while_a_probe_is_out_does_not_reopen_the_provider(pool):
    """advance() past the ejection's end while gpu0's probe runs changes nothing: the next BIG
    request goes to gpu1, not as a second probe (or ordinary grant) on gpu0, which has room."""
    config = attrs.evolve(
        pool.two_nodes(gpu0=pool.spec(capacity=2), gpu1=pool.spec(priority=-1)), outlier=OutlierPolicy(1, 1.0, 4.0)
    )
    core = _core(config)
    first = _lease(core.request(BIG, False, 0.0))
    core.release(first)
    core.report_failure(first, 0.0)
    core.advance(1.0)
    probe = _lease(core.request(BIG, False, 1.0))
    assert (probe.provider, probe.probe) == (pool.gpu0, True)
    assert core.advance(5.0) == []
    other = _lease(core.request(BIG, False, 5.0))
    assert (other.provider, other.probe) == (pool.gpu1, False)


@pytest.mark.req("failover-before-first-byte")
def test_retry_refusals_name_the_model_and_what_ran_out(pool):
    """Each refusal of retry() carries the model and its figure; the queue deadline is reached
    at ``enqueue_time + queue_timeout`` exactly; a refused retry can still be retried."""
    config = attrs.evolve(pool.two_nodes(queue_timeout=10.0), retry=RetryPolicy(2))
    core = _core(config)
    first = _lease(core.request(FAST, False, 1.0))
    with pytest.raises(QueueTimeout) as late:
        core.retry(first, 11.0)
    assert (late.value.model, late.value.waited) == (FAST, 10.0)
    with pytest.raises(Unavailable) as none_left:  # FAST's only candidate, gpu0, was tried
        core.retry(first, 9.0)
    assert (none_left.value.model, none_left.value.long) == (FAST, False)
    assert none_left.value.reasons == (f"{pool.gpu0}: already tried by this request",)
    core.release(first)
    big = _lease(core.request(BIG, False, 1.0))
    second = _lease(core.retry(big, 2.0))
    assert (second.attempt, second.arrival, second.enqueue_time) == (2, big.arrival, 1.0)
    assert second.tried == (big.provider, second.provider)
    with pytest.raises(RetriesExhausted) as spent:
        core.retry(second, 3.0)
    assert (spent.value.model, spent.value.attempts) == (BIG, 2)
    with pytest.raises(RuntimeError, match="retried already"):
        core.retry(big, 3.0)
    core.release(big)
    core.release(second)
    third = _lease(core.request(BIG, False, 3.0))
    core.refresh(pool.single(pool.gpu1, models=(FAST,)))
    with pytest.raises(ModelNotFound) as gone:
        core.retry(third, 3.0)
    assert gone.value.model == BIG


@pytest.mark.req("failover-before-first-byte")
def test_long_retry_refused_when_no_untried_candidate_has_a_long_slot(pool):
    """A long BIG request on gpu0 retried: gpu1, the only untried candidate, has no long slot,
    so the retry is refused as long (not queued for a slot that never comes)."""
    core = _core(pool.two_nodes(gpu1=pool.spec(long_cap=0)))
    first = _lease(core.request(BIG, True, 0.0))
    assert first.provider == pool.gpu0
    with pytest.raises(Unavailable) as refused:
        core.retry(first, 1.0)
    assert (refused.value.model, refused.value.long) == (BIG, True)
    assert refused.value.reasons == (
        f"{pool.gpu0}: already tried by this request",
        f"{pool.gpu1}: runs no long requests (long_context_capacity=0)",
    )
    assert core.queue_depth == 0


@pytest.mark.req("failover-before-first-byte")
def test_two_queued_retries_keep_arrival_order(pool):
    """Two retries queued at once, the later arrival first: both go back to their arrival places,
    before the waiter that arrived after them."""
    core = _core(pool.two_nodes())
    a = _lease(core.request(BIG, False, 0.0))
    b = _lease(core.request(BIG, False, 0.0))
    later = _waiter(core.request(BIG, False, 0.0))
    retry_b = _waiter(core.retry(b, 1.0))
    retry_a = _waiter(core.retry(a, 1.0))
    assert list(core.waiters()) == [retry_a, retry_b, later]


@pytest.mark.req("failover-before-first-byte", "refresh-consistency")
def test_refresh_removing_the_model_fails_its_queued_retry_and_waiter_naming_it(pool):
    """A refresh that removes BIG while a BIG retry and a later BIG request are queued: both end
    ``ModelNotFound`` naming BIG, in arrival order."""
    config = attrs.evolve(pool.two_nodes(), retry=RetryPolicy(2))
    core = _core(config)
    first = _lease(core.request(BIG, False, 0.0))
    second = _lease(core.request(BIG, False, 0.0))
    core.release(first)
    retried = _waiter(core.retry(first, 1.0))  # gpu1, its only untried candidate, is busy
    third = _lease(core.request(BIG, False, 1.0))  # gpu0, freed by the first
    later = _waiter(core.request(BIG, False, 1.0))
    decisions = core.refresh(attrs.evolve(config, models={FAST: config.models[FAST]}))
    assert [(type(d), d.waiter) for d in decisions] == [(Failed, retried), (Failed, later)]
    for d in decisions:
        assert isinstance(d, Failed) and isinstance(d.error, ModelNotFound) and d.error.model == BIG
    core.release(second)
    core.release(third)
    assert core.queue_depth == 0


@pytest.mark.req("refresh-consistency")
@pytest.mark.parametrize("prepared", [False, True])
def test_refresh_ending_long_slots_fails_a_long_waiter_of_a_kept_group(pool, prepared):
    """A refresh that keeps BIG's candidates but leaves none with a long slot: the queued long
    BIG waiter fails Unavailable (long) at once, FAILED, instead of waiting for a slot that
    never comes; the short waiter behind it keeps its place."""
    base = pool.two_nodes()
    core = _core(base)
    held = [_lease(core.request(BIG, True, 0.0)), _lease(core.request(BIG, True, 0.0))]
    long_waiter = _waiter(core.request(BIG, True, 0.0))
    short_waiter = _waiter(core.request(BIG, False, 0.0))
    config = pool.two_nodes(gpu0=pool.spec(long_cap=0), gpu1=pool.spec(long_cap=0))
    decisions = core.refresh(core.prepare_refresh(config) if prepared else config)
    assert [(type(d), d.waiter) for d in decisions] == [(Failed, long_waiter)]
    assert isinstance(decisions[0], Failed) and decisions[0].error is long_waiter.error
    assert long_waiter.state is WaiterState.FAILED
    assert isinstance(long_waiter.error, Unavailable)
    assert (long_waiter.error.model, long_waiter.error.long) == (BIG, True)
    assert list(core.waiters()) == [short_waiter]
    for lease in held:
        core.release(lease)
    assert short_waiter.state is not WaiterState.QUEUED


@pytest.mark.req("failover-before-first-byte", "refresh-consistency")
@pytest.mark.parametrize("prepared", [False, True])
@pytest.mark.parametrize("long", [False, True])
def test_refresh_leaving_a_queued_retry_no_untried_candidate_fails_it(pool, prepared, long):
    """A BIG retry queued for gpu1 (it tried gpu0); a refresh disables gpu1 (or, for a long
    retry, leaves it no long slot): the retry fails Unavailable (model BIG, its kind) at once,
    FAILED, though gpu0 is free -- it never goes back to the provider that failed it."""
    base = attrs.evolve(pool.two_nodes(), retry=RetryPolicy(2))
    core = _core(base)
    first = _lease(core.request(BIG, long, 0.0))
    second = _lease(core.request(BIG, long, 0.0))
    core.release(first)
    retried = _waiter(core.retry(first, 1.0))
    gpu1 = pool.spec(long_cap=0) if long else pool.spec(enabled=False)
    config = attrs.evolve(base, providers={**base.providers, pool.gpu1: gpu1})
    decisions = core.refresh(core.prepare_refresh(config) if prepared else config)
    assert [(type(d), d.waiter) for d in decisions] == [(Failed, retried)]
    assert retried.state is WaiterState.FAILED
    assert isinstance(retried.error, Unavailable)
    assert (retried.error.model, retried.error.long) == (BIG, long)
    assert core.queue_depth == 0
    core.release(second)


@pytest.mark.req("outlier-ejection")
def test_failure_of_a_probe_released_without_report_ejects_nothing(pool):
    """gpu0's probe is released without a report, so the next grant probes again; a failure
    reported afterwards for that first probe is not the current probe's: gpu0 is not ejected
    again, and its next probe (the second) still decides."""
    config = attrs.evolve(pool.two_nodes(gpu1=pool.spec(priority=-1)), outlier=OutlierPolicy(1, 1.0, 4.0))
    core = _core(config)
    first = _lease(core.request(BIG, False, 0.0))
    core.release(first)
    core.report_failure(first, 0.0)
    core.advance(1.0)
    probe = _lease(core.request(BIG, False, 1.0))
    core.release(probe)
    assert core.report_failure(probe, 1.0) == []
    second = _lease(core.request(BIG, False, 1.0))
    assert (second.provider, second.probe) == (pool.gpu0, True)
    core.release(second)
    again = _lease(core.request(BIG, False, 1.0))
    assert (again.provider, again.probe) == (pool.gpu0, True)
    assert core.report_failure(again, 1.0) != []


@pytest.mark.req("failover-before-first-byte")
def test_retry_goes_to_the_untried_candidate_with_the_lowest_load_ratio(pool):
    """A retry chooses by a scan of its own candidates: equal priority, so the lowest
    ``in_flight / capacity`` wins -- gpu1 at 1 / 4, not gpu2 at 1 / 2 (which holds fewer slots)."""
    core = _core(_three(pool, pool.spec(priority=1), pool.spec(4), pool.spec(2)))
    first, second, third = (_lease(core.request(BIG, False, 0.0)) for _ in range(3))
    assert (first.provider, second.provider, third.provider) == (pool.gpu0, GPU2, pool.gpu1)
    core.release(first)
    retried = _lease(core.retry(first, 1.0))
    assert retried.provider == pool.gpu1


@pytest.mark.req("outlier-ejection")
def test_panic_models_names_models_in_panic_for_normal_requests(pool):
    """FAST's only candidate, gpu0, runs no long requests and is ejected: FAST is in panic mode
    (for the requests it can run), BIG (gpu1 still admits) is not."""
    config = attrs.evolve(pool.two_nodes(gpu0=pool.spec(1, 0)), outlier=OutlierPolicy(1, 10.0, 10.0))
    core = _core(config)
    lease = _lease(core.request(FAST, False, 0.0))
    core.release(lease)
    assert [type(d) for d in core.report_failure(lease, 0.0)] == [Ejected]
    assert core.panic_models() == (FAST,)


@pytest.mark.req("outlier-ejection")
def test_long_request_in_panic_when_its_only_long_candidate_is_ejected(pool):
    """BIG's long requests can run on gpu1 only (gpu0 has no long slot): gpu1 ejected, a long
    request is in panic mode of the index and granted on gpu1 at once, though gpu0 admits."""
    config = attrs.evolve(
        pool.two_nodes(gpu0=pool.spec(1, 0), gpu1=pool.spec(2, 2)), outlier=OutlierPolicy(1, 10.0, 10.0)
    )
    core = _core(config)
    failing = _lease(core.request(BIG, True, 0.0))
    assert failing.provider == pool.gpu1
    core.release(failing)
    assert [type(d) for d in core.report_failure(failing, 0.0)] == [Ejected]
    panic = _lease(core.request(BIG, True, 0.5))
    assert (panic.provider, panic.long, panic.probe) == (pool.gpu1, True, False)


@pytest.mark.req("outlier-ejection")
def test_long_request_not_in_panic_while_a_long_candidate_admits(pool):
    """gpu0 admits but its long slot is taken; gpu1 is ejected with long slots free: not panic
    mode for long requests, so the next one waits for gpu0 instead of going to gpu1."""
    config = attrs.evolve(
        pool.two_nodes(gpu0=pool.spec(1, 1), gpu1=pool.spec(2, 2, priority=-1)), outlier=OutlierPolicy(1, 10.0, 10.0)
    )
    core = _core(config)
    held = _lease(core.request(BIG, True, 0.0))
    failing = _lease(core.request(BIG, True, 0.0))
    assert (held.provider, failing.provider) == (pool.gpu0, pool.gpu1)
    assert [type(d) for d in core.report_failure(failing, 0.0)] == [Ejected]
    core.release(failing)
    waiter = _waiter(core.request(BIG, True, 0.5))
    [grant] = core.release(held)
    assert grant.waiter is waiter and grant.lease.provider == pool.gpu0


@pytest.mark.req("failover-before-first-byte")
def test_queued_retries_sharing_a_candidate_both_count_in_its_pressure(pool):
    """Two queued retries whose untried candidates both include gpu1 count twice in gpu1's
    ``queued`` (candidate pressure), once in gpu2's and gpu0's."""
    core = _core(_three(pool, pool.spec(), pool.spec(), pool.spec()))
    a, b, c = (_lease(core.request(BIG, False, 0.0)) for _ in range(3))
    assert (a.provider, b.provider, c.provider) == (pool.gpu0, GPU2, pool.gpu1)
    _waiter(core.retry(a, 1.0))
    _waiter(core.retry(b, 1.0))
    queued = {(s.node_id, s.provider_id): s.queued for s in core.provider_snapshots()}
    assert queued == {("node-a", "gpu0"): 1, ("node-b", "gpu2"): 1, ("node-b", "gpu1"): 2}
