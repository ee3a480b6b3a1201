"""[token-ledger] The engine's own view against the ledger: :func:`engine_cut`'s rule, the core
applying a node's report of KV use and preemptions to a provider's effective budget (and giving
it back), and both layers doing the same. The random paths are the ledger core machine's
(``test_ledger_core_machine.py``, rule ``engine_reports``)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests.admission.steps import connected
from tests.admission.token_pools import A, token_pool, tokens_spec

from iop_admission import Admission, AdmissionEvent, PoolConfig, ProviderKey, ProviderReport
from iop_admission.aio import AsyncAdmission
from iop_admission.core import AdmissionState, BudgetChanged, Decision, Granted, Lease, Waiter, engine_cut
from iop_admission.testing import AsyncioLayer, Layer, TrioLayer

pytestmark = pytest.mark.req("token-ledger")


def _one_budget() -> PoolConfig:
    return token_pool(tokens_spec(100, window=100))


def _state() -> AdmissionState:
    return connected(_one_budget())


def _budget(state: AdmissionState) -> tuple[int | None, int | None, float | None, int | None]:
    snap = state.provider_snapshots()[0]
    return snap.token_budget, snap.effective_token_budget, snap.reported_kv_use, snap.reported_preemptions


def _moved(decisions: list[Decision]) -> list[tuple[ProviderKey, int, int]]:
    """The ``BudgetChanged`` decisions, as (provider, before, budget); asserting they come first."""
    moves = [(d.provider, d.before, d.budget) for d in decisions if type(d) is BudgetChanged]
    assert all(type(d) is BudgetChanged for d in decisions[: len(moves)])
    return moves


def test_the_cut_is_the_use_the_reservations_do_not_explain() -> None:
    """100 configured, 30 reserved: 0.5 of the cache is 50 tokens held, 20 unexplained; a full
    cache leaves only what is reserved; use within the reservations, or none said, cuts nothing;
    a preemption leaves no room above what is reserved."""
    assert engine_cut(100, 30, 0.5, False) == 20
    assert engine_cut(100, 30, 1.0, False) == 70
    assert engine_cut(100, 30, 0.3, False) == 0
    assert engine_cut(100, 30, 0.001, False) == 0
    assert engine_cut(100, 30, None, False) == 0
    assert engine_cut(100, 30, 0.0, True) == 70
    assert engine_cut(100, 130, 1.0, True) == 0  # a settle above the budget: nothing left to cut


@given(
    configured=st.integers(0, 10**6),
    reserved=st.integers(0, 2 * 10**6),
    kv_use=st.one_of(st.none(), st.floats(0.0, 1.0)),
    preempted=st.booleans(),
)
def test_the_cut_never_raises_the_budget_nor_takes_it_below_the_reservations(
    configured: int, reserved: int, kv_use: float | None, preempted: bool
) -> None:
    cut = engine_cut(configured, reserved, kv_use, preempted)
    assert 0 <= cut <= max(0, configured - reserved)
    assert min(configured, reserved) <= configured - cut <= configured


def test_reported_use_cuts_the_budget_and_its_end_gives_it_back() -> None:
    """A 30-token lease runs; the engine says half its cache is in use: 20 tokens nobody reserved
    here, so a 60-token request (30 + 60 <= 100) waits on the 80 left; the engine's next report
    (0.3: all of it ours) gives the budget back and that report's dispatch grants it."""
    state = _state()
    lease = state.request("m", False, 0.0, tokens=30)
    assert isinstance(lease, Lease)
    assert _moved(state.report_health(A, ProviderReport("ready", kv_use=0.5), 1.0)) == [(A, 100, 80)]
    assert _budget(state) == (100, 80, 0.5, None)
    assert state.report_health(A, ProviderReport("ready", kv_use=0.5), 1.5) == []  # the same cut: no news
    waiter = state.request("m", False, 1.0, tokens=60)
    assert isinstance(waiter, Waiter)
    decisions = state.report_health(A, ProviderReport("ready", kv_use=0.3), 2.0)
    assert _moved(decisions) == [(A, 80, 100)]
    granted = decisions[1]
    assert len(decisions) == 2 and isinstance(granted, Granted) and granted.waiter is waiter
    assert _budget(state) == (100, 100, 0.3, None)


def test_a_preemption_holds_the_budget_at_what_is_reserved_until_a_report_without_one() -> None:
    """The first count is a baseline; a rise holds the budget at the 30 reserved (a 1-token request
    waits); the same count again gives it back."""
    state = _state()
    assert isinstance(state.request("m", False, 0.0, tokens=30), Lease)
    assert state.report_health(A, ProviderReport("ready", preemptions=3), 1.0) == []
    assert _budget(state) == (100, 100, None, 3)
    assert _moved(state.report_health(A, ProviderReport("ready", preemptions=4), 2.0)) == [(A, 100, 30)]
    assert _budget(state) == (100, 30, None, 4)
    waiter = state.request("m", False, 2.0, tokens=1)
    assert isinstance(waiter, Waiter)
    raised, granted = state.report_health(A, ProviderReport("ready", preemptions=4), 3.0)
    assert _moved([raised]) == [(A, 30, 100)]
    assert isinstance(granted, Granted) and granted.waiter is waiter
    assert _budget(state) == (100, 100, None, 4)


def test_a_request_the_cut_keeps_out_waits_it_is_not_refused() -> None:
    """The cut is passing pressure: a request above the cut budget but within the configured one
    queues (a request above the configured budget is refused at once, as before)."""
    state = _state()
    assert _moved(state.report_health(A, ProviderReport("ready", kv_use=0.9), 0.0)) == [(A, 100, 10)]
    assert _budget(state)[1] == 10
    assert isinstance(state.request("m", False, 0.0, tokens=50), Waiter)


def test_a_reconnect_or_an_engine_that_says_nothing_forgets_the_cut() -> None:
    """The node's reports start over on a new connection; a report without the engine's view
    (its engine stopped saying) leaves no cut either."""
    state = _state()
    state.report_health(A, ProviderReport("ready", kv_use=0.9), 0.0)
    assert _budget(state) == (100, 10, 0.9, None)
    state.disconnect("node-a", state.generation("node-a"))
    assert _moved(state.connect("node-a")[1]) == [(A, 10, 100)]
    assert _budget(state) == (100, 100, None, None)
    state.report_health(A, ProviderReport("ready", kv_use=0.9), 1.0)
    assert _moved(state.report_health(A, ProviderReport("ready"), 2.0)) == [(A, 10, 100)]
    assert _budget(state) == (100, 100, None, None)


def test_a_report_out_of_bounds_is_refused() -> None:
    for bad in ({"kv_use": 1.5}, {"kv_use": -0.1}, {"kv_use": float("nan")}, {"preemptions": -1}):
        with pytest.raises(ValueError):
            ProviderReport("ready", **bad)  # type: ignore[arg-type]


async def test_the_trio_layer_cuts_as_the_core_does() -> None:
    admission = Admission(_one_budget())
    admission.connect("node-a")
    async with admission.lease("m", tokens=30):
        admission.report_health(A, ProviderReport("ready", kv_use=0.5, preemptions=0))
        snap = admission.snapshot().provider("node-a", "gpu0")
        assert (snap.reserved_tokens, snap.effective_token_budget, snap.reported_kv_use) == (30, 80, 0.5)


def test_the_asyncio_layer_cuts_as_the_core_does() -> None:
    async def main() -> tuple[int, int | None, float | None]:
        admission = AsyncAdmission(_one_budget())
        admission.connect("node-a")
        async with admission.lease("m", tokens=30):
            admission.report_health(A, ProviderReport("ready", kv_use=0.5, preemptions=0))
            snap = admission.snapshot().provider("node-a", "gpu0")
            return snap.reserved_tokens, snap.effective_token_budget, snap.reported_kv_use

    assert asyncio.run(main()) == (30, 80, 0.5)


@pytest.mark.parametrize("layer", [TrioLayer(), AsyncioLayer()], ids=lambda layer: layer.name)
def test_both_layers_tell_each_move_of_the_budget_as_an_event(layer: Layer) -> None:
    """A 30-token lease; the engine says 0.5 (the budget 100 -> 80: ``lowered``), 0.5 again (no
    move, no event), 0.9 (80 -> 40), then 0.3 (all of it ours: back to 100, ``raised``); a
    reconnect after a cut gives the budget back too. The same events on both layers."""
    events: list[AdmissionEvent] = []

    async def scenario() -> None:
        admission = layer.admission(_one_budget())
        async with layer.tasks() as spawn, admission.subscribe() as stream:

            async def collect() -> None:
                async for event in stream:
                    events.append(event)

            collector = spawn(collect)
            generation = admission.connect("node-a")
            async with admission.lease("m", tokens=30):
                for kv_use in (0.5, 0.5, 0.9, 0.3, 0.9):
                    admission.report_health(A, ProviderReport("ready", kv_use=kv_use))
                    await layer.sleep(1.0)
            admission.disconnect("node-a", generation)
            admission.connect("node-a")
            await layer.settle()
            collector.cancel()

    layer.run(scenario)
    moves = [(e.time, e.provider, e.node_id, e.reason, e.token_budget) for e in events if e.kind == "budget_changed"]
    assert moves == [
        (0.0, A, "node-a", "lowered", 80),
        (2.0, A, "node-a", "lowered", 40),
        (3.0, A, "node-a", "raised", 100),
        (4.0, A, "node-a", "lowered", 40),
        (5.0, A, "node-a", "raised", 100),  # the reconnect forgets the engine's view
    ]
