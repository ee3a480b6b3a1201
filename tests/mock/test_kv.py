"""The mock engine's KV cache (``iop_mock.kv``): what overcommit costs, and that reserving prevents it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iop_mock.kv import MODES, KvEngine

REQUESTS = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 20)), min_size=1, max_size=12)


def _run(engine: KvEngine, requests: list[tuple[int, int]], reserve: bool) -> tuple[set[int], set[int]]:
    """Submit ``requests`` (all at once, or as reservations of prompt + max_tokens fit); step until idle."""
    pending = list(enumerate(requests))
    held: dict[int, int] = {}
    finished: set[int] = set()
    failed: set[int] = set()
    for _ in range(10_000):
        while pending and (
            not reserve or sum(held.values()) + sum(pending[0][1]) <= engine.total or sum(pending[0][1]) > engine.total
        ):
            sid, (prompt, out) = pending.pop(0)
            if engine.submit(sid, prompt, out):
                held[sid] = prompt + out
            else:
                failed.add(sid)
        if not pending and not engine.running and not engine.waiting:
            break
        step = engine.step()
        assert engine.used <= engine.total
        for sid in step.finished + step.failed:
            held.pop(sid)
        finished.update(step.finished)
        failed.update(step.failed)
    return finished, failed


@settings(max_examples=200, deadline=None)
@given(REQUESTS, st.integers(40, 120), st.sampled_from(MODES))
def test_reservations_that_fit_never_preempt_nor_fail(requests: list[tuple[int, int]], total: int, mode: str) -> None:
    """Admitted while prompt + max_tokens of all fit the cache: every request finishes, none evicted."""
    engine = KvEngine(total, n_ctx=60, mode=mode, prefill_per_step=16)
    finished, failed = _run(engine, requests, reserve=True)
    too_long = {sid for sid, (p, o) in enumerate(requests) if p + o > min(60, total)}
    assert failed == too_long
    assert finished == set(range(len(requests))) - too_long
    assert engine.preemptions == 0 and engine.context_errors == len(too_long)
    assert engine.used == 0


@settings(max_examples=200, deadline=None)
@given(REQUESTS, st.integers(40, 120), st.sampled_from(MODES))
def test_overcommit_ends_every_request_and_frees_the_cache(
    requests: list[tuple[int, int]], total: int, mode: str
) -> None:
    """Everything at once: each request finishes or fails, exactly once, the cache never over its size;
    in mode ``preempt`` only the requests past ``n_ctx`` fail (the rest are recomputed)."""
    engine = KvEngine(total, n_ctx=60, mode=mode, prefill_per_step=16)
    finished, failed = _run(engine, requests, reserve=False)
    assert finished | failed == set(range(len(requests))) and not finished & failed
    assert engine.used == 0 and engine.peak <= total
    if mode == "preempt":
        assert failed == {sid for sid, (p, o) in enumerate(requests) if p + o > min(60, total)}


@pytest.mark.parametrize(
    ("mode", "preempted", "failed"), [("preempt", [2], []), ("fail-newest", [], [2]), ("fail", [], [1, 2])]
)
def test_an_overcommitted_cache_preempts_the_newest_or_fails(
    mode: str, preempted: list[int], failed: list[int]
) -> None:
    """Two sequences of prompt 4 and 6 tokens to generate in a cache of 12: they start together
    (8 of 12), and the step that needs 2 more than the 12 evicts the one started last (``preempt``,
    ``fail-newest``) or fails both (``fail``: llama.cpp's server ends every sequence in progress)."""
    engine = KvEngine(12, n_ctx=12, mode=mode, prefill_per_step=100)
    assert engine.submit(1, 4, 6) and engine.submit(2, 4, 6)
    steps = [engine.step()]
    assert steps[0].first == [1, 2] and engine.used == 10
    steps += [engine.step(), engine.step()]
    assert (steps[2].preempted, steps[2].failed) == (preempted, failed)
    assert steps[2].tokens == ([] if mode == "fail" else [1])
    assert engine.used == (0 if mode == "fail" else 7)  # the one left: 4 + 3
    assert (engine.preemptions, engine.context_errors) == (len(preempted), len(failed))


def test_in_mode_fail_a_prompt_takes_the_cache_as_it_is_prefilled() -> None:
    """llama.cpp gives a request a slot at once: its prompt's entries are taken chunk by chunk, so
    a second request starts beside a first whose cache would not leave it room, and the step that
    finds none fails both."""
    engine = KvEngine(10, n_ctx=10, mode="fail", prefill_per_step=3)
    assert engine.submit(1, 6, 2) and engine.submit(2, 6, 2)
    assert engine.step().tokens == [] and (engine.running, engine.waiting, engine.used) == (2, 0, 3)
    step = engine.step()  # the rest of 1's prompt (6), then its first token
    assert (step.first, engine.used) == ([1], 7)
    step = engine.step()  # 3 of 2's prompt (10) and 1's second token: no room
    assert (step.failed, step.finished, engine.used, engine.context_errors) == ([1, 2], [], 0, 2)


def test_a_sequence_ends_at_its_own_end_of_sequence_within_max_tokens() -> None:
    """``output``: what it really generates; ``n_ctx`` is checked against ``max_tokens``."""
    engine = KvEngine(100, n_ctx=20)
    assert engine.submit(1, 5, 10, output=3)
    assert not engine.submit(2, 5, 16, output=3)  # 21 > n_ctx, whatever it would generate
    steps = [engine.step() for _ in range(3)]
    assert steps[-1].finished == [1] and engine.used == 0


def test_a_request_past_n_ctx_is_a_context_error_at_once_and_cancel_frees() -> None:
    engine = KvEngine(100, n_ctx=10)
    assert not engine.submit(1, 8, 3)
    assert engine.context_errors == 1 and engine.waiting == 0
    assert engine.submit(2, 5, 5) and engine.submit(3, 5, 5)
    engine.step()
    assert engine.used == 12 and engine.usage == pytest.approx(0.12)
    engine.cancel(2)
    engine.cancel(9)
    assert engine.used == 6 and engine.running == 1
    with pytest.raises(ValueError, match="mode"):
        KvEngine(1, 1, mode="swap")
    with pytest.raises(ValueError, match=">= 1"):
        KvEngine(0, 1)


def test_a_step_costs_its_weights_its_prefill_and_the_cache_it_reads() -> None:
    """Chunked prefill slows the step it shares; a fuller cache slows every step; no cost model: 0."""
    engine = KvEngine(100, n_ctx=50, prefill_per_step=16, cost=(1.0, 0.5, 0.01))
    assert engine.submit(1, 20, 2)
    first = engine.step()  # starts it: 20 entries read, 16 of its prompt prefilled
    assert first.seconds == pytest.approx(1.0 + 16 * 0.5 + 20 * 0.01)
    second = engine.step()  # 4 more prefilled, then its first token
    assert second.first == [1] and second.seconds == pytest.approx(1.0 + 4 * 0.5 + 20 * 0.01)
    third = engine.step()
    assert third.finished == [1] and third.seconds == pytest.approx(1.0 + 21 * 0.01)
    assert KvEngine(100, n_ctx=50).step().seconds == 0.0
    with pytest.raises(ValueError, match="costs"):
        KvEngine(100, n_ctx=50, cost=(0.0, -1.0, 0.0))
