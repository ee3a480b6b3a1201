"""[token-ledger] The ledger's edges that mutation testing (``make mutate`` over issue 40's code,
docs/reliability.md) found untested: each test names the behaviour a surviving mutant broke; and
the bug found while arguing them (a refresh that moves a pinned waiter off a provider).

Sans-I/O, exact steps; patience 0 (``TokenLedger.PATIENCE``) where a pin is wanted at the first pass.
"""

from __future__ import annotations

import pytest
from tests.admission.steps import as_lease as _lease
from tests.admission.steps import as_waiter as _waiter
from tests.admission.steps import connected, grants
from tests.admission.token_pools import A, B, token_pool, tokens_spec

import iop_admission as adm
from iop_admission import ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy
from iop_admission.core import AdmissionState, Failed, TokenLedger, Waiter, reservation

pytestmark = pytest.mark.req("token-ledger")


def _config(*specs: ProviderSpec, x: tuple[ProviderKey, ...] = (A, B)) -> PoolConfig:
    """Model ``x`` on the providers ``x`` names (of those given), ``a`` on A alone, ``b`` on B alone."""
    keys = (A, B)[: len(specs)]
    return token_pool(*specs, models={"x": x[: len(keys)], **{key.node_id[-1]: (key,) for key in keys}})


def _state(*specs: ProviderSpec) -> AdmissionState:
    return connected(_config(*specs))


def _headroom(state: AdmissionState) -> list[int]:
    return [row.token_headroom for row in state.provider_snapshots()]


def test_a_window_of_one_token_bounds_a_reservation() -> None:
    """The smallest window still bounds: only 0 means unbounded."""
    assert reservation(5, 5, 1) == 1
    assert reservation(5, 5, 0) == 10


def test_a_long_waiter_passed_over_by_tokens_is_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Admitting by tokens alone, a long request needs no long slot: a long 60 that waits behind a
    50 is kept off by its tokens only, so the 20 granted past it pins it (patience 0), and a 20
    that arrives next waits beside the 60 held (50 + 20 + 20 + 60 > 100)."""
    monkeypatch.setattr(TokenLedger, "PATIENCE", 0)
    state = _state(tokens_spec())
    _lease(state.request("a", False, 0.0, tokens=50))
    big = _waiter(state.request("a", True, 0.0, tokens=60))
    _lease(state.request("a", False, 0.0, tokens=20))
    assert _headroom(state) == [60]
    _waiter(state.request("a", False, 0.0, tokens=20))
    assert big.state.value == "queued"


def test_a_waiter_that_arrived_after_the_grant_is_not_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 60 and then a 70 wait behind a 50. The 50 leaves: the 60 is granted; the 70 did not fit
    either, but it arrived after the 60, so nothing passed it and nothing is held for it (patience
    0 would pin it at once): a 10 still runs beside the 60."""
    monkeypatch.setattr(TokenLedger, "PATIENCE", 0)
    state = _state(tokens_spec())
    first = _lease(state.request("a", False, 0.0, tokens=50))
    sixty = _waiter(state.request("a", False, 0.0, tokens=60))
    seventy = _waiter(state.request("a", False, 0.0, tokens=70))
    assert grants(state.release(first)) == [(sixty, A)]
    assert _headroom(state) == [0] and seventy.state.value == "queued"
    assert _lease(state.request("a", False, 0.0, tokens=10)).reserved_tokens == 10


def test_a_long_waiter_without_figures_is_held_a_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long request that names no tokens reserves the window (60): behind a 50 it waits, and
    the 20 granted past it pins it with its window held."""
    monkeypatch.setattr(TokenLedger, "PATIENCE", 0)
    state = _state(tokens_spec(window=60))
    _lease(state.request("a", False, 0.0, tokens=50))
    _waiter(state.request("a", True, 0.0))
    _lease(state.request("a", False, 0.0, tokens=20))
    assert _headroom(state) == [60]


def _pinned_on_both(state: AdmissionState) -> Waiter:
    """A 50 of ``x`` that waits behind a 60 on A and on B (budgets of 100), pinned on both by a 10
    granted past it on each (patience 0): 50 held on each."""
    _lease(state.request("a", False, 0.0, tokens=60))
    _lease(state.request("b", False, 0.0, tokens=60))
    big = _waiter(state.request("x", False, 0.0, tokens=50))
    _lease(state.request("a", False, 0.0, tokens=10))
    _lease(state.request("b", False, 0.0, tokens=10))
    assert _headroom(state) == [50, 50]
    return big


def test_a_waiter_pinned_on_two_providers_gives_both_back_when_it_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 50 of ``x`` waits behind a 60 on A and on B; a 10 on A, then one on B, pass it: pinned on
    both, 50 held on each. Withdrawn, it gives back the room on both."""
    monkeypatch.setattr(TokenLedger, "PATIENCE", 0)
    state = _state(tokens_spec(), tokens_spec())
    big = _pinned_on_both(state)
    assert state.withdraw(big)
    assert state.drain_decisions() == []
    assert _headroom(state) == [0, 0]


def test_a_waiter_too_big_for_a_provider_holds_nothing_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 150 of ``x`` can run on B (budget 200, 100 taken) but never on A (budget 100): the 10s
    granted on A do not pass it there, so A holds nothing for it and a second 10 runs."""
    monkeypatch.setattr(TokenLedger, "PATIENCE", 0)
    state = _state(tokens_spec(), tokens_spec(200))
    _lease(state.request("b", False, 0.0, tokens=100))
    _waiter(state.request("x", False, 0.0, tokens=150))
    _lease(state.request("a", False, 0.0, tokens=10))
    assert _headroom(state) == [0, 0]
    assert _lease(state.request("a", False, 0.0, tokens=10)).provider == A


def test_a_refresh_that_takes_a_provider_off_a_pinned_waiter_gives_its_headroom_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 50 of ``x`` waits behind a 60 on A and on B, pinned on both by a 10 granted past it on
    each; a 20 of ``a`` waits beside the 50 held on A. A refresh leaves ``x`` on B alone: the 50
    waits on, but it can no longer run on A, so A holds nothing for it and the refresh grants the
    20 (60 + 10 + 20). B still holds its 50, until it leaves."""
    monkeypatch.setattr(TokenLedger, "PATIENCE", 0)
    spec = tokens_spec()
    state = _state(spec, spec)
    big = _pinned_on_both(state)
    small = _waiter(state.request("a", False, 0.0, tokens=20))
    assert grants(state.refresh(_config(spec, spec, x=(B,)))) == [(small, A)]
    assert big.state.value == "queued" and _headroom(state) == [0, 50]
    assert state.withdraw(big) and _headroom(state) == [0, 0]


def test_a_new_ledger_bounds_nothing_holds_nothing_and_fills_to_its_budget() -> None:
    """A ledger made alone (no provider sets its window) bounds no reservation, reserves nothing
    for a request without figures, holds no headroom: its whole budget fits."""
    ledger = TokenLedger(10)
    assert (ledger.window, ledger.headroom, ledger.pinned) == (0, 0, None)
    assert ledger.need(50, False) == 50 and ledger.need(None, True) == 0 and ledger.need(None, False) == 0
    assert ledger.fits(10) and ledger.fits_request(10, False)
    ledger.reserve(1, 10)
    assert (ledger.reserved, ledger.free) == (10, 0)


def test_a_negative_figure_is_refused_before_it_takes_an_arrival_or_a_lease() -> None:
    """``tokens=-1`` is refused when the choice asks whether it fits, before the request takes an
    arrival number or a lease id: the next request is the first."""
    state = _state(tokens_spec())
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        state.request("a", False, 0.0, tokens=-1)
    first = _lease(state.request("a", False, 0.0, tokens=10))
    assert (first.id, first.arrival) == (1, 1)


def test_settling_tokens_on_a_provider_without_a_budget_changes_nothing() -> None:
    """The Edge settles every run that reports usage: on a provider that admits by slots it is a no-op."""
    state = _state(ProviderSpec(capacity=1))
    running = _lease(state.request("a", False, 0.0, tokens=50))
    assert state.settle_tokens(running, 5) == [] and running.reserved_tokens == 0


def test_a_settle_that_frees_one_token_grants_the_waiter_it_lets_in() -> None:
    state = _state(tokens_spec())
    running = _lease(state.request("a", False, 0.0, tokens=80))
    waiting = _waiter(state.request("a", False, 0.0, tokens=21))
    assert grants(state.settle_tokens(running, 79)) == [(waiting, A)]


def test_a_settle_that_frees_nothing_leaves_the_drain_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pinned 60 is withdrawn: the 20 it let in is granted by the drain that follows, not by a
    settle in between that frees no token."""
    monkeypatch.setattr(TokenLedger, "PATIENCE", 0)
    state = _state(tokens_spec())
    running = _lease(state.request("a", False, 0.0, tokens=50))
    big = _waiter(state.request("a", False, 0.0, tokens=60))
    _lease(state.request("a", False, 0.0, tokens=20))
    late = _waiter(state.request("a", False, 0.0, tokens=20))
    assert state.withdraw(big)
    assert state.settle_tokens(running, 50) == []
    assert grants(state.drain_decisions()) == [(late, A)]


@pytest.mark.parametrize("tenants", [(), (adm.TenantSpec("t"),)], ids=["untenanted", "tenants"])
def test_a_long_waiter_in_panic_mode_is_granted_while_the_normal_kind_is_not_in_panic(
    tenants: tuple[adm.TenantSpec, ...],
) -> None:
    """``x`` runs on A (tokens: any request may be long) and B (slots, no long slot, full). A long 50
    waits behind A's 80; A's failure ejects it: long requests of ``x`` are in panic mode (A was
    their only candidate), normal ones are not (B admits). A's 80 leaves: the long 50 is granted
    on A in panic mode, though no slot is free for a normal request (with tenants too: the fair
    dispatch's first test)."""
    config = PoolConfig(
        policy=QueuePolicy(max_queue=8, queue_timeout=60.0),
        providers={A: tokens_spec(), B: ProviderSpec(capacity=1)},
        models={"x": ModelGroup((A, B)), "a": ModelGroup((A,)), "b": ModelGroup((B,))},
        outlier=adm.OutlierPolicy(consecutive_failures=1, base_ejection=5.0, max_ejection=5.0),
        tenants=tenants,
    )
    state = connected(config)
    on_a = _lease(state.request("a", False, 0.0, tokens=80))
    long = _waiter(state.request("x", True, 0.0, tokens=50))
    _lease(state.request("b", False, 0.0))
    assert len(state.report_failure(on_a, 0.0)) == 1  # ejected; the 50 does not fit beside the 80
    assert grants(state.release(on_a)) == [(long, A)]


def test_a_budget_of_one_token_is_a_budget() -> None:
    assert ProviderSpec(capacity=1, total_context_tokens=1, admit_by="tokens").problems() == []


def test_with_tenants_a_normal_waiter_is_granted_while_the_long_slot_is_taken() -> None:
    """A admits by slots and tokens (one long slot, taken by a long 50); a normal 40 waits beside a
    normal 30 (120 > 100). The 30 leaves: with tenants the fair dispatch grants the 40 (90), though
    no long slot is free."""
    both = ProviderSpec(
        capacity=4, long_context_capacity=1, context_window_tokens=60, total_context_tokens=100, admit_by="both"
    )
    config = PoolConfig(
        policy=QueuePolicy(max_queue=8, queue_timeout=60.0),
        providers={A: both},
        models={"a": ModelGroup((A,))},
        tenants=(adm.TenantSpec("t"),),
    )
    state = connected(config)
    _lease(state.request("a", True, 0.0, tokens=50))
    thirty = _lease(state.request("a", False, 0.0, tokens=30))
    forty = _waiter(state.request("a", False, 0.0, tokens=40))
    assert grants(state.release(thirty)) == [(forty, A)]


def test_with_tenants_a_queued_retry_is_granted_by_its_own_tokens() -> None:
    """A long request of ``x`` that reserves nothing (0 tokens, window 60) fails on A and is retried:
    B, its one untried candidate, has no slot (a 60, a 40 and a 0 of ``b``) and no token left. The
    0 of ``b`` leaves: a slot is free, and the retry's 0 tokens fit beside the 100 reserved, so the
    fair dispatch grants it there (neither the window nor any other figure counts)."""
    spec = ProviderSpec(capacity=3, context_window_tokens=60, total_context_tokens=100, admit_by="tokens")
    config = PoolConfig(
        policy=QueuePolicy(max_queue=8, queue_timeout=60.0),
        providers={A: spec, B: spec},
        models={"x": ModelGroup((A, B)), "b": ModelGroup((B,))},
        tenants=(adm.TenantSpec("t"),),
    )
    state = connected(config)
    first = _lease(state.request("x", True, 0.0, tokens=0))
    assert first.provider == A
    _lease(state.request("b", False, 0.0, tokens=60))
    _lease(state.request("b", False, 0.0, tokens=40))
    nothing = _lease(state.request("b", False, 0.0, tokens=0))
    retry = _waiter(state.retry(first, 0.0))
    assert state.release(first) == []
    assert grants(state.release(nothing)) == [(retry, B)]


@pytest.mark.parametrize("admit_by", ["tokens", "both"])
def test_a_long_request_larger_than_the_budget_is_refused_naming_the_budget(admit_by: str) -> None:
    """A provider that runs long requests (by tokens alone, or with one long slot) refuses a long
    one too big for its budget by the budget."""
    state = _state(
        ProviderSpec(
            capacity=8, long_context_capacity=int(admit_by == "both"), total_context_tokens=100, admit_by=admit_by
        )
    )
    with pytest.raises(adm.Unavailable) as refused:
        state.request("a", True, 0.0, tokens=150)
    assert refused.value.reasons == (
        "node-a/gpu0: budget of 100 context tokens (total_context_tokens) < the 150 reserved",
    )


def test_a_long_request_without_figures_is_refused_where_the_window_exceeds_the_budget() -> None:
    """Without figures a long request reserves the window: 200 can never fit a budget of 100."""
    state = _state(tokens_spec(window=200))
    with pytest.raises(adm.Unavailable) as refused:
        state.request("a", True, 0.0)
    assert refused.value.reasons == (
        "node-a/gpu0: budget of 100 context tokens (total_context_tokens) < the 200 reserved",
    )


def test_a_provider_that_stops_admitting_by_tokens_runs_any_figure_again() -> None:
    """A admitted by a budget of 100 and now by slots (its ledger kept for the leases it holds): a
    150 that no budget of ``x`` holds can still run on A, so it waits for A's slot."""
    slots = ProviderSpec(capacity=1)
    state = _state(ProviderSpec(capacity=1, total_context_tokens=100, admit_by="tokens"), tokens_spec())
    state.refresh(_config(slots, tokens_spec()))
    _lease(state.request("a", False, 0.0, tokens=10))
    assert _waiter(state.request("x", False, 0.0, tokens=150)).tokens == 150


def test_a_disconnect_fails_the_waiters_no_budget_left_can_hold() -> None:
    """``x`` on A (budget 100) and B (200, full); a 150 (B alone could hold it) and a 50 behind A's
    80 wait. B's node drops: the 150 fails at once, the 50 waits on for A."""
    state = _state(tokens_spec(), tokens_spec(200))
    _lease(state.request("a", False, 0.0, tokens=80))
    _lease(state.request("b", False, 0.0, tokens=200))
    big = _waiter(state.request("x", False, 0.0, tokens=150))
    small = _waiter(state.request("x", False, 0.0, tokens=50))
    ok, decisions = state.disconnect("node-b", state.generation("node-b"))
    assert ok and [d.waiter for d in decisions if isinstance(d, Failed)] == [big]
    assert isinstance(big.error, adm.Unavailable) and small.state.value == "queued"


def test_a_disconnect_fails_a_long_waiter_that_only_a_provider_without_long_slots_could_hold() -> None:
    """``x`` on A (one long slot, budget 100), B (slots, no long slot) and C (budget 200, full). A long
    150 waits for C. C's node drops: A runs long requests but cannot hold 150, B holds any figure
    but runs no long request: the 150 fails at once."""
    c = ProviderKey("node-c", "gpu2")
    both = ProviderSpec(capacity=4, long_context_capacity=1, total_context_tokens=100, admit_by="both")
    config = PoolConfig(
        policy=QueuePolicy(max_queue=8, queue_timeout=60.0),
        providers={A: both, B: ProviderSpec(capacity=1), c: tokens_spec(200)},
        models={"x": ModelGroup((A, B, c)), "c": ModelGroup((c,))},
    )
    state = connected(config)
    _lease(state.request("c", False, 0.0, tokens=200))
    long = _waiter(state.request("x", True, 0.0, tokens=150))
    ok, decisions = state.disconnect("node-c", state.generation("node-c"))
    assert ok and [d.waiter for d in decisions if isinstance(d, Failed)] == [long]


def test_a_disconnect_fails_a_queued_retry_no_budget_left_can_hold() -> None:
    """A 150 of ``x`` runs on A (budget 200) and is retried: its untried candidates are B (budget
    100: never) and C (200, full), so it waits for C. C's node drops: the retry fails at once."""
    c = ProviderKey("node-c", "gpu2")
    config = PoolConfig(
        policy=QueuePolicy(max_queue=8, queue_timeout=60.0),
        providers={A: tokens_spec(200), B: tokens_spec(), c: tokens_spec(200)},
        models={"x": ModelGroup((A, B, c)), "c": ModelGroup((c,))},
    )
    state = connected(config)
    first = _lease(state.request("x", False, 0.0, tokens=150))
    assert first.provider == A
    _lease(state.request("c", False, 0.0, tokens=200))
    retry = _waiter(state.retry(first, 0.0))
    assert state.release(first) == []
    ok, decisions = state.disconnect("node-c", state.generation("node-c"))
    assert ok and [d.waiter for d in decisions if isinstance(d, Failed)] == [retry]


def test_a_pinned_waiter_granted_beside_a_second_due_waiter_reserves_before_the_pin_moves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pin moves to the next waiter due only once the pinned one has reserved: its own grant
    never has to fit beside the next one's headroom. Patience 0; A's budget 100.

    t's 30 waits behind u's 80 and is pinned by u's 0 granted past it; t then reaches its cap (a
    lease on C) and u's 80 leaves, so the 30 fits but waits for its tenant. u's 50 runs beside the
    30 held. u's 40 of ``y`` (on B, full) arrived first; a refresh puts ``y`` on A too, where it
    does not fit beside the 30 held; u's 10 passes it there: due too. t's lease on C ends: the 30
    is granted on A (60 + 30), then the 40 is pinned."""
    monkeypatch.setattr(TokenLedger, "PATIENCE", 0)
    c = ProviderKey("node-c", "gpu2")

    def config(y: tuple[ProviderKey, ...]) -> PoolConfig:
        return PoolConfig(
            policy=QueuePolicy(max_queue=8, queue_timeout=60.0),
            providers={A: tokens_spec(), B: tokens_spec(), c: ProviderSpec(capacity=1)},
            models={"a": ModelGroup((A,)), "y": ModelGroup(y), "c": ModelGroup((c,))},
            tenants=(adm.TenantSpec("t", max_in_flight=1), adm.TenantSpec("u")),
        )

    state = connected(config((B,)))
    _lease(state.request("y", False, 0.0, "u", tokens=100))
    early = _waiter(state.request("y", False, 0.0, "u", tokens=40))
    eighty = _lease(state.request("a", False, 0.0, "u", tokens=80))
    thirty = _waiter(state.request("a", False, 0.0, "t", tokens=30))
    _lease(state.request("a", False, 0.0, "u", tokens=0))
    assert _headroom(state)[0] == 30
    on_c = _lease(state.request("c", False, 0.0, "t"))
    assert state.release(eighty) == []  # the 30 fits, its tenant is at its cap
    _lease(state.request("a", False, 0.0, "u", tokens=50))
    assert state.refresh(config((A, B))) == []
    _lease(state.request("a", False, 0.0, "u", tokens=10))
    assert grants(state.release(on_c)) == [(thirty, A)]
    assert _headroom(state)[0] == 40 and early.state.value == "queued"


def test_a_refresh_to_a_token_budget_keeps_the_capacity_the_backend_reported() -> None:
    """A reports it runs 2 at once (its spec says 8); a refresh that gives it a bigger budget keeps
    the reported bound: the third request waits."""
    state = _state(tokens_spec())
    assert state.report_health(A, adm.ProviderReport("ready", capacity=2), 0.0) == []
    state.refresh(_config(tokens_spec(200)))
    _lease(state.request("a", False, 0.0, tokens=10))
    _lease(state.request("a", False, 0.0, tokens=10))
    _waiter(state.request("a", False, 0.0, tokens=10))


@pytest.mark.parametrize("prepared", [False, True], ids=["refresh", "prepared"])
def test_a_refresh_that_gives_a_second_candidate_a_budget_keeps_the_group_fitting_tokens(prepared: bool) -> None:
    """``x`` on A (budget 100) and B (slots); a refresh (direct, or prepared: the groups kept) gives
    B a budget of 100 too. Two 90s run, one on each; a 50 fits neither and waits."""
    state = _state(tokens_spec(), ProviderSpec(capacity=8))
    config = _config(tokens_spec(), tokens_spec())
    state.refresh(state.prepare_refresh(config) if prepared else config)
    assert {_lease(state.request("x", False, 0.0, tokens=90)).provider for _ in range(2)} == {A, B}
    assert _waiter(state.request("x", False, 0.0, tokens=50)).tokens == 50


def test_a_prepared_refresh_that_takes_one_budget_away_keeps_the_group_fitting_the_other() -> None:
    """``x`` on A and B (budgets of 100); a prepared refresh (the groups kept) puts B on slots (one
    slot). A 90 runs on A, a 90 on B (its slot); a 50 does not fit A and waits."""
    state = _state(tokens_spec(), tokens_spec())
    state.refresh(state.prepare_refresh(_config(tokens_spec(), ProviderSpec(capacity=1))))
    assert [_lease(state.request("x", False, 0.0, tokens=90)).provider for _ in range(2)] == [A, B]
    assert _waiter(state.request("x", False, 0.0, tokens=50)).tokens == 50


def test_an_engine_report_says_whether_the_budget_rose() -> None:
    """A cut of 50 (half the cache in use, nothing reserved) lowers the budget; the same report again
    changes nothing; a report without the view gives the budget back: it rose."""
    ledger = TokenLedger(100)
    assert ledger.engine_report(0.5, False) is False and ledger.budget == 50
    assert ledger.engine_report(0.5, False) is False
    assert ledger.engine_report(None, False) is True and ledger.budget == 100


def test_a_budget_may_be_set_to_zero() -> None:
    """0 is a budget (nothing fits); only a negative one is refused."""
    ledger = TokenLedger(10)
    ledger.set_budget(0)
    assert (ledger.budget, ledger.configured) == (0, 0) and not ledger.fits(1)


def test_a_new_configured_budget_keeps_the_engines_cut() -> None:
    """A cut of 30 (30 % of the cache in use, nothing reserved); a refresh to 80 keeps it: 50."""
    ledger = TokenLedger(100)
    ledger.engine_report(0.3, False)
    ledger.set_budget(80)
    assert (ledger.configured, ledger.cut, ledger.budget) == (80, 30, 50)
