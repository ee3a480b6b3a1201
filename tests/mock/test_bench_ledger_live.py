"""[token-ledger] The live ledger benchmark's machinery (``benchmarks.ledger_live``) on a tiny trace,
through real processes: two ``iop-mock-backend --kv-tokens`` behind a Node and an Edge.

Each mock holds 2,048 tokens (``n_ctx`` 1,024). Twelve streamed chats arrive at once, each a prompt
of 600 tokens and ``max_tokens`` 400, half of them ending at their own end of sequence after 150
tokens (``mock_output_tokens``). The slots arm (six per provider) sends six to each mock, whose
prompts alone (3,600) overflow its cache: it preempts (``preempt``) or fails every sequence in
progress (``fail``) whatever the box's speed. The ledger reserves 1,010 tokens a request (the prompt
and its chat template's 10, counted with the run's tokenizer, plus 400): two run on each mock at
once, the others wait (the queue's timeout is generous here: the test is about the cache), and the
mocks neither preempt nor fail.
"""

from __future__ import annotations

import pathlib
import random

import pytest
from benchmarks import ledger, ledger_live

pytestmark = pytest.mark.req("token-ledger")

PROMPT, MAX_TOKENS, EARLY = 600, 400, 150
RESERVE = PROMPT + ledger_live.TEMPLATE_TOKENS + MAX_TOKENS
GENEROUS = 300.0  # the queue timeout and the objective: a busy 2-core box


def tiny_trace() -> list[ledger.Request]:
    return [ledger.Request(i, 0.01 * i, PROMPT, MAX_TOKENS, EARLY if i % 2 else MAX_TOKENS) for i in range(12)]


def engine(mode: str) -> ledger_live.Engine:
    return ledger_live.Engine(mode, kv_tokens=2_048, n_ctx=1_024, tokens_per_second=200, prefill_tokens_per_second=0)


def test_the_spread_delays_each_arrival_by_less_than_a_step() -> None:
    """``--spread``: the virtual replay on copies of the trace whose arrivals move within a step."""
    requests = ledger.trace(60, seed=2, long_share=0.08, chats="history")
    moved = ledger_live.delayed(requests, random.Random(1))
    by_id = {r.id: r for r in moved}
    assert [r.arrival for r in moved] == sorted(r.arrival for r in moved)
    assert all(0 <= by_id[r.id].arrival - r.arrival < ledger.STEP for r in requests)
    runs = ledger_live.spread(ledger_live.Arm(), requests, "preempt", 3)
    assert len(runs) == 3 and all(r["preemptions"] == r["context_errors"] == 0 for r in runs)


@pytest.mark.parametrize("mode", ["preempt", "fail"])
def test_the_ledger_holds_a_trace_the_slots_overcommit(tmp_path: pathlib.Path, mode: str) -> None:
    requests = tiny_trace()
    kept = ledger_live.live(
        tmp_path / "ledger", ledger_live.Arm(queue_timeout=GENEROUS), engine(mode), requests, GENEROUS
    )
    assert (kept["preemptions"], kept["context_errors"]) == (0, 0)
    assert kept["finished"] == kept["good"] == len(requests) and kept["refused"] == {}
    # The hint went through the Edge and the Node: each stream carried the tokens its request asked.
    assert kept["tokens_as_asked"] == len(requests)
    # Two reservations fit a provider's budget, a third never: exact (the prompt counted by the tokenizer).
    assert kept["reserved_peak"] == {"gpu0": 2 * RESERVE, "gpu1": 2 * RESERVE}
    assert kept["kv_peak"] <= 2 * (PROMPT + MAX_TOKENS) / 2_048

    slots = ledger_live.Arm(slots=(6, 1), queue_timeout=GENEROUS)
    harmed = ledger_live.live(tmp_path / "slots", slots, engine(mode), requests, GENEROUS)
    assert harmed["preemptions" if mode == "preempt" else "context_errors"] > 0
