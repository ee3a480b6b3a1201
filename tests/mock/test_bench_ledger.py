"""The ledger benchmark's replay (``benchmarks.ledger``) on small traces.

The figures in docs/benchmarks.md come from this replay, so its trace and its
bound are checked here: the trace has the shape the docs state, the ledger never
overcommits the mock's KV engine in any of its modes, and the ceiling is what no arm
can pass (every request of the trace good).
"""

from __future__ import annotations

import pytest
from benchmarks import ledger

from iop_mock.kv import MODES


def test_the_short_trace_has_the_documented_shape() -> None:
    requests = ledger.trace(2_000, seed=3)
    longs = [r for r in requests if r.prompt >= 16_000]
    chats = [r for r in requests if r.prompt < 16_000]
    assert 0.12 < len(longs) / len(requests) < 0.18
    assert all(100 <= r.prompt <= 2_000 and r.max_tokens in (128, 256, 512, 1024) for r in chats)
    assert all(r.prompt <= 28_000 and r.reserve <= ledger.N_CTX for r in longs)
    assert all(1 <= r.output <= r.max_tokens for r in requests)
    assert [r.arrival for r in requests] == sorted(r.arrival for r in requests)


def test_the_history_trace_has_the_documented_shape() -> None:
    requests = ledger.trace(2_000, seed=3, long_share=0.08, chats="history")
    chats = [r for r in requests if r.prompt < 16_000]
    assert 0.05 < 1 - len(chats) / len(requests) < 0.11
    assert all(50 <= r.prompt <= 7_000 and r.max_tokens in (256, 512, 1024, 2048) for r in chats)
    assert max(r.prompt for r in chats) > 2_000  # the chats' history: a longer tail than the short chats


def test_an_unknown_chat_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="chats must be one of"):
        ledger.trace(10, seed=1, chats="long")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chats", ["short", "history"])
def test_the_ledger_never_overcommits_the_engine(mode: str, chats: str) -> None:
    requests = ledger.trace(300, seed=5, long_share=0.15, chats=chats)
    result = ledger.simulate(ledger.ledger_arm, requests, mode)
    assert result["preemptions"] == 0
    assert result["context_errors"] == 0
    assert result["kv_peak"] <= 1.0
    assert result["finished"] + result["refused"] == len(requests)


def test_the_ceiling_bounds_every_arm() -> None:
    run = ledger.replay(120, seed=2, mode="fail")
    best_other = max(run["slots"]["good"], run["reactive"]["good"])
    assert run["ceiling"] == pytest.approx(120 / best_other)
    assert run["ledger"]["good"] / best_other <= run["ceiling"]
    harmless = run["slots_harmless"]
    assert harmless is None or (harmless["preemptions"] == 0 and harmless["context_errors"] == 0)


def test_in_mode_fail_an_overcommit_fails_every_sequence_in_progress() -> None:
    """The same trace and slots in modes ``fail`` (llama.cpp's server) and ``fail-newest``: a count that
    overcommits loses more requests when a full cache ends every sequence in progress."""
    requests = ledger.trace(300, seed=5, long_share=0.15, chats="history")
    every, newest = (ledger.simulate(ledger.slots_arm(32, 3), requests, mode) for mode in ("fail", "fail-newest"))
    assert newest["context_errors"] > 0
    assert every["context_errors"] > newest["context_errors"]
    assert every["finished"] + every["context_errors"] + every["refused"] == len(requests)
