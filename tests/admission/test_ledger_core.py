"""The token ledger in the admission core ([token-ledger]): reserve at the grant, return at the
release, no head-of-line blocking, refusal at once past every budget, settle, headroom for a
starved request, the snapshot, both layers; and today's configurations decide as before."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

import pytest
import trio
import trio.testing
from tests.admission.steps import connected
from tests.admission.token_pools import A, B, token_pool, tokens_spec

from iop_admission import (
    Admission,
    ConfigError,
    PoolConfig,
    ProviderSpec,
    Unavailable,
)
from iop_admission.aio import AsyncAdmission
from iop_admission.core import AdmissionState, Decision, Failed, Granted, Lease, TokenLedger, Waiter

pytestmark = pytest.mark.req("token-ledger")

M = "m"


def state(*specs: ProviderSpec) -> AdmissionState:
    return connected(token_pool(*specs))


def lease(core: AdmissionState, tokens: int | None, long: bool = False) -> Lease:
    got = core.request(M, long, 0.0, tokens=tokens)
    assert isinstance(got, Lease)
    return got


def waiter(core: AdmissionState, tokens: int | None, long: bool = False) -> Waiter:
    got = core.request(M, long, 0.0, tokens=tokens)
    assert isinstance(got, Waiter)
    return got


def granted(decisions: Sequence[Decision]) -> list[Waiter]:
    return [d.waiter for d in decisions if isinstance(d, Granted)]


def test_admit_by_is_checked_with_the_budget_it_needs() -> None:
    assert tokens_spec().budget == 100 and tokens_spec().runs_long
    assert ProviderSpec(capacity=1).budget is None and not ProviderSpec(capacity=1).runs_long
    with pytest.raises(ConfigError) as bad:
        ProviderSpec(capacity=2, long_context_capacity=1, admit_by="tokens")
    assert list(bad.value.problems) == [
        "provider.total_context_tokens: admit_by tokens needs a budget >= 1, got None",
        "provider.long_context_capacity: must be 0 with admit_by tokens (long requests run by their tokens), got 1",
    ]
    with pytest.raises(ConfigError) as bad:
        ProviderSpec(capacity=2, total_context_tokens=10, admit_by="both")
    assert list(bad.value.problems) == ["provider.long_context_capacity: admit_by both needs long slots >= 1, got 0"]
    with pytest.raises(ConfigError) as bad:
        ProviderSpec(capacity=2, admit_by="kv")
    assert list(bad.value.problems) == ["provider.admit_by: must be one of slots, tokens, both, got 'kv'"]
    # A budget that is not the product of the slots is fine once tokens admit.
    ProviderSpec(
        capacity=4, long_context_capacity=1, context_window_tokens=8, total_context_tokens=100, admit_by="both"
    )


def test_reserve_at_the_grant_return_at_the_release_and_no_head_of_line() -> None:
    """Budget 100: 50 runs; 60 waits (110 > 100); 30 behind it fits and runs (80): a big waiter
    does not hold back a smaller one. The 50's release lets the 60 in (90)."""
    core = state(tokens_spec(100))
    first = lease(core, 50)
    big = waiter(core, 60)
    small = lease(core, 30)
    assert (first.reserved_tokens, small.reserved_tokens, first.tokens) == (50, 30, 50)
    (row,) = core.provider_snapshots()
    assert (row.token_budget, row.reserved_tokens, row.token_headroom) == (100, 80, 0)
    assert granted(core.release(first)) == [big]
    assert big.lease is not None and big.lease.reserved_tokens == 60
    assert first.reserved_tokens == 0
    assert core.release(first) == []  # returned once
    (row,) = core.provider_snapshots()
    assert row.reserved_tokens == 90


def test_a_reservation_is_bounded_by_the_window_and_a_request_without_figures_by_its_kind() -> None:
    core = state(tokens_spec(100, window=40))
    assert lease(core, 1000).reserved_tokens == 40
    assert lease(core, None).reserved_tokens == 0
    assert lease(core, None, long=True).reserved_tokens == 40  # a long request: the window


def test_a_request_larger_than_every_budget_is_refused_at_once_naming_it() -> None:
    core = state(tokens_spec(100), tokens_spec(80))
    with pytest.raises(Unavailable) as refused:
        core.request(M, False, 0.0, tokens=150)
    assert refused.value.reasons == (
        "node-a/gpu0: budget of 100 context tokens (total_context_tokens) < the 150 reserved",
        "node-b/gpu1: budget of 80 context tokens (total_context_tokens) < the 150 reserved",
    )
    assert core.queue_depth == 0
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        core.request(M, False, 0.0, tokens=-1)
    assert lease(core, 90).provider == A  # fits the first only


def test_a_request_goes_where_its_tokens_fit() -> None:
    """The choice rule among the candidates the tokens fit: the emptier one is full of tokens."""
    core = state(tokens_spec(100), tokens_spec(100))
    assert lease(core, 90).provider == A
    assert lease(core, 20).provider == B  # the least loaded is B anyway
    assert lease(core, 70).provider == B  # A has 10 left, B 80


def test_settle_lowers_or_raises_the_reservation_and_lowering_grants() -> None:
    core = state(tokens_spec(100))
    running = lease(core, 80)
    queued = waiter(core, 50)
    assert core.settle_tokens(running, 90) == []  # the prompt was longer than estimated: 90 held
    assert running.reserved_tokens == 90
    assert granted(core.settle_tokens(running, 0)) == [queued]  # the stream ended: its cache is free
    assert core.settle_tokens(running, -5) == []
    assert running.reserved_tokens == 0
    core.release(running)
    assert core.settle_tokens(running, 10) == [] and running.reserved_tokens == 0


def test_a_big_request_passed_over_is_given_headroom_then_runs_first() -> None:
    """Budget 100: 60 + 20 run; a 30 waits; 10s pass it, and once 30 tokens have (its own size)
    it is pinned: 30 held, so a 10 no longer fits beside it. When the 60 leaves, the 30 runs
    before the 10 queued behind it, which then fits beside it."""
    core = state(tokens_spec(100))
    sixty, twenty = lease(core, 60), lease(core, 20)
    big = waiter(core, 30)
    lease(core, 10)
    lease(core, 10)
    assert core.release(twenty) == []  # 80 reserved: the 30 does not fit
    assert core.provider_snapshots()[0].token_headroom == 0
    lease(core, 10)  # 30 tokens passed it
    assert core.provider_snapshots()[0].token_headroom == 30
    late = waiter(core, 10)  # 90 reserved + 10 > 100 - 30 held
    assert granted(core.release(sixty)) == [big, late]  # 30 + 30, then 10 beside them
    assert core.provider_snapshots()[0].token_headroom == 0


def test_a_pinned_waiter_that_leaves_gives_its_headroom_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TokenLedger, "PATIENCE", 0)
    core = state(tokens_spec(100))
    lease(core, 50)
    big = waiter(core, 60)
    lease(core, 20)  # passes it: pinned at once (patience 0), 60 held
    late = waiter(core, 20)
    assert core.drain_decisions() == []
    assert core.withdraw(big)
    assert granted(core.drain_decisions()) == [late]
    assert core.provider_snapshots()[0].token_headroom == 0


def test_a_lower_budget_fails_the_waiters_it_can_no_longer_hold() -> None:
    core = state(tokens_spec(100))
    lease(core, 50)
    big = waiter(core, 90)
    small = waiter(core, 60)
    decisions = core.refresh(token_pool(tokens_spec(70)))
    (failed,) = decisions
    assert isinstance(failed, Failed) and failed.waiter is big and isinstance(big.error, Unavailable)
    assert small.state.value == "queued"


def test_both_slots_and_tokens_bound_a_long_request() -> None:
    spec = ProviderSpec(
        capacity=4, long_context_capacity=1, context_window_tokens=60, total_context_tokens=100, admit_by="both"
    )
    core = state(spec)
    lease(core, 50, long=True)
    second_long = waiter(core, 10, long=True)  # tokens fit, the one long slot does not
    lease(core, 40)
    assert waiter(core, 20).tokens == 20  # a slot is free, the tokens are not (50 + 40 + 20)
    assert second_long.state.value == "queued"


def _trace(seed: int) -> list[tuple[str, int, bool, int]]:
    rng = random.Random(seed)
    return [(rng.choice("rrrrx"), rng.randrange(8), rng.random() < 0.3, rng.randrange(1, 40_000)) for _ in range(300)]


def _replay(config: PoolConfig, trace: list[tuple[str, int, bool, int]], with_tokens: bool) -> list[object]:
    """Run ``trace`` (request, or release of the n-th lease alive) and record every decision."""
    core = AdmissionState(config)
    out: list[object] = [core.connect("node-a")[0], core.connect("node-b")[0]]
    alive: list[Lease] = []
    for op, n, long, tokens in trace:
        if op == "r":
            try:
                got = core.request(M, long, 0.0, tokens=tokens if with_tokens else None)
            except Exception as exc:
                out.append(type(exc).__name__)
                continue
            out.append((type(got).__name__, getattr(got, "provider", None)))
            if isinstance(got, Lease):
                alive.append(got)
        elif alive:
            gone = alive.pop(n % len(alive))
            for d in core.release(gone):
                assert isinstance(d, Granted)
                out.append(("granted", d.waiter.seq, d.lease.provider))
                alive.append(d.lease)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_todays_configs_decide_as_before(seed: int) -> None:
    """A provider that admits by slots (the default, ``total_context_tokens`` the static product)
    ignores the token figures; one that admits by both with the product as its budget decides
    exactly as the slots alone for requests that name no tokens."""
    slots = ProviderSpec(capacity=3, long_context_capacity=1, context_window_tokens=32768, total_context_tokens=32768)
    both = ProviderSpec(
        capacity=3, long_context_capacity=1, context_window_tokens=32768, total_context_tokens=32768, admit_by="both"
    )
    trace = _trace(seed)
    before = _replay(token_pool(slots, slots), trace, with_tokens=False)
    assert _replay(token_pool(slots, slots), trace, with_tokens=True) == before
    assert _replay(token_pool(both, both), trace, with_tokens=False) == before


async def test_the_trio_layer_reserves_settles_and_returns(autojump_clock: trio.testing.MockClock) -> None:
    admission = Admission(token_pool(tokens_spec(100)))
    admission.connect("node-a")
    order: list[str] = []

    async def one(name: str, tokens: int, hold: trio.Event) -> None:
        async with admission.lease(M, tokens=tokens) as held:
            order.append(name)
            assert held.reserved_tokens == tokens
            await hold.wait()
            admission.settle_tokens(held, 0)  # its stream ended: the rest waits for nothing

    async with trio.open_nursery() as nursery:
        first_done, second_done = trio.Event(), trio.Event()
        nursery.start_soon(one, "first", 70, first_done)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(one, "second", 60, second_done)
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["first"] and admission.snapshot().providers[0].reserved_tokens == 70
        first_done.set()
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["first", "second"]
        second_done.set()
    assert admission.snapshot().providers[0].reserved_tokens == 0
    with pytest.raises(Unavailable):
        async with admission.lease(M, tokens=101):
            pass  # pragma: no cover


def test_the_asyncio_layer_reserves_settles_and_returns() -> None:
    async def main() -> list[str]:
        admission = AsyncAdmission(token_pool(tokens_spec(100)))
        admission.connect("node-a")
        order: list[str] = []
        release = asyncio.Event()

        async def one(name: str, tokens: int) -> None:
            async with admission.lease(M, tokens=tokens) as held:
                order.append(name)
                await release.wait()
                admission.settle_tokens(held, 0)

        first = asyncio.create_task(one("first", 70))
        await asyncio.sleep(0)
        second = asyncio.create_task(one("second", 60))
        await asyncio.sleep(0)
        assert order == ["first"] and admission.snapshot().providers[0].reserved_tokens == 70
        release.set()
        await asyncio.gather(first, second)
        assert admission.snapshot().providers[0].reserved_tokens == 0
        with pytest.raises(Unavailable):
            async with admission.lease(M, tokens=101):
                pass  # pragma: no cover
        return order

    assert asyncio.run(main()) == ["first", "second"]
