"""The whole-system check, short profile (``make chaos`` runs 200 schedules of it): real etcd, two
Edges with ``ha:``, two Nodes listing both, a counting backend per provider, clients that retry
on the other Edge, and a seeded nemesis; the checker judges the history.

The seeds are chosen so the schedules hold the faults that matter most here (a leader paused past
its TTL with requests in flight and queued, a Node killed under load, a partition between the Nodes
and an Edge); a failing seed is replayed
with ``python -m tests.system --seed SEED --schedules 1``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from .nemesis import schedule
from .run import run_schedule

pytestmark = pytest.mark.req("epoch-fencing", "warm-standby", "ha-step-down")

LENGTH_S = 10.0
SEEDS = (3, 8)


def test_the_profile_holds_the_faults_that_matter() -> None:
    kinds = {fault.kind for seed in SEEDS for fault in schedule(seed, LENGTH_S)}
    assert {"pause_leader", "kill_node", "partition_link"} <= kinds, kinds


@pytest.mark.parametrize("seed", SEEDS)
async def test_a_seeded_schedule_keeps_every_promise(seed: int, tmp_path: Path) -> None:
    with trio.fail_after(180):
        result = await run_schedule(seed, tmp_path, length=LENGTH_S)
    assert result.answered > 0, result
    assert result.terms, "no leader term in the Edges' logs: the step-down check had nothing to judge"
    if "pause_leader" in {fault.kind for fault in schedule(seed, LENGTH_S)}:
        assert any(term.stepped_down for term in result.terms), result.terms
    assert result.violations == [], (result.faults, result.violations)
