"""The seeded whole-system simulation in CI: 200 seeds, every fault site hit, no violation;
16 seeds of the HA world (Edge replicas, tests/sim/_ha.py), every HA fault site hit.

[lease-lifecycle] [cross-group-wakeup] [disconnect-exclusion] [disconnect-queue-resolution]
[refresh-consistency] [snapshot-source] [provider-state] [long-state] [cross-model-tests]
"""

from __future__ import annotations

import json
import logging
import pathlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from iop_admission._core import dispatch
from iop_admission.core import AdmissionState, Decision, Lease
from iop_edge.ha import EdgeHa
from iop_edge.nodes import peer_watch
from iop_node.edges.fence import EpochFence

from ._ha import HA_SITES, ha_summary, run_ha_seed
from ._report import run_and_summarize
from ._tenants import run_tenant_seed
from ._world import SITES, run_seed

CI_SEEDS = range(200)
HA_SEEDS = range(16)
"""Of the HA world (2 or 3 Edges by seed parity): about 0.5 s each."""
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def quiet_daemons() -> Iterator[None]:
    """The daemons log every dropped node; thousands of lines would only slow the run."""
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.req(
    "lease-lifecycle",
    "cross-group-wakeup",
    "disconnect-queue-resolution",
    "failover-before-first-byte",
    "outlier-ejection",
    "first-token-timeout",
)
def test_ci_seeds_hold_every_invariant_and_hit_every_fault_site() -> None:
    """[lease-lifecycle] [cross-group-wakeup] [disconnect-queue-resolution] 200 seeds: no
    violation, and every fault site fired at least once (counts printed with ``-s``).
    Fault sites "backend down", "5xx burst" and "first token never comes" with the checks:
    no run starts after a response head ([failover-before-first-byte]), at most one deciding
    probe per ejection and ejections end on time ([outlier-ejection]), retried requests
    end within the bound, every counter drains ([first-token-timeout] cuts the stuck runs)."""
    summary = run_and_summarize(CI_SEEDS)
    print("\n" + summary.render())
    failed = [(r.seed, r.violations[:5]) for r in summary.failed_seeds]
    assert not failed, (
        f"seeds with violations (rerun: python -m tests.sim --first-seed SEED --seeds 1 --trace): {failed}"
    )
    assert summary.steps > 0
    assert {site: summary.fired[site] for site in SITES if not summary.fired[site]} == {}


@pytest.mark.parametrize(("seed", "world"), [(5, ""), (12, ""), (13, "--ha"), (2, "--tenants")])
def test_a_seed_replays_the_same_trace(seed: int, world: str) -> None:
    """Two runs of one seed (of any world), each in a fresh process, give an identical trace
    hash (faults, refreshes, every outcome), and neither saw a wakeup from
    outside the simulation.

    Fresh processes, because the schedule repeats only when nothing outside the
    simulation touches its loop, and the pytest process carries whatever every
    earlier test left behind: a run here took another path at a clock jump in
    CI, the path one callback queued from outside gives. A run in this process
    is still printed (``-s``) for comparison.
    """
    first, second = _replay_in_fresh_process(seed, world), _replay_in_fresh_process(seed, world)
    assert first["trace"] and first["outside_wakeups"] == 0 == second["outside_wakeups"]
    assert first["trace_hash"] == second["trace_hash"], _first_difference(first["trace"], second["trace"])
    assert first["outcomes"] == second["outcomes"]
    here = {"--ha": run_ha_seed, "--tenants": run_tenant_seed}.get(world, run_seed)(seed)
    same = "the same trace" if here.trace_hash == first["trace_hash"] else _first_difference(here.trace, first["trace"])
    print(f"seed {seed} in the pytest process: {here.outside_wakeups} outside wakeups, {same}")


def _replay_in_fresh_process(seed: int, world: str) -> dict[str, Any]:
    """``python -m tests.sim --json`` (``world``: ``--ha`` or ``--tenants``, else the one-Edge world)
    for one seed, in a new interpreter."""
    command = [sys.executable, "-m", "tests.sim", "--json", "--first-seed", str(seed), "--seeds", "1"]
    command += [world] if world else []
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def _first_difference(first: list[str], second: list[str]) -> str:
    """Where two traces part, with a few lines of context: a failure carries its own diagnosis."""
    at = next((i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b), min(len(first), len(second)))
    context = slice(max(0, at - 3), at + 3)
    return (
        f"traces part at line {at} of {len(first)} / {len(second)}:\n"
        f"first:  {first[context]}\nsecond: {second[context]}"
    )


def test_the_checker_sees_a_stranded_waiter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sensitivity: with re-evaluation after release broken, the checker reports waiters
    queued while a provider is dispatchable for them, with the seed."""
    monkeypatch.setattr(dispatch.Dispatcher, "dispatch", lambda self, groups: [])
    result = run_seed(3)
    assert any("is dispatchable for it" in v for v in result.violations), result.violations[:5]


def test_the_checker_sees_a_leaked_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sensitivity: with a release that forgets the lease, the final liveness check reports it."""
    release = AdmissionState.release

    def leaky(self: AdmissionState, lease: Lease) -> list[Decision]:
        if lease.id == 2:
            return []
        return release(self, lease)

    monkeypatch.setattr(AdmissionState, "release", leaky)
    result = run_seed(8)  # no fault enabled: no fencing that would mask the leak
    assert any("not 0 at the end" in v or "live leases left" in v for v in result.violations), result.violations[:5]


def test_the_checker_sees_a_pending_connection_never_released(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sensitivity: with the node socket's pending slot never released, the final check reports
    the connections still counted pending (in production they would end up refusing every node)."""
    monkeypatch.setattr(peer_watch.PendingSlot, "release", lambda self: None)
    result = run_seed(8)
    assert any("still counted pending at the end" in v for v in result.violations), result.violations[:5]


@pytest.mark.req("ha-election", "ha-step-down", "warm-standby", "epoch-fencing")
def test_ha_seeds_hold_every_invariant_and_hit_every_ha_fault_site() -> None:
    """[ha-election] [ha-step-down] [warm-standby] [epoch-fencing] Two or three Edges elected on an
    in-memory etcd, each node registered with every Edge on one runtime: leader step-downs, pauses
    past the TTL, partitions from etcd, with every fault of the one-Edge world. No violation of the
    one-Edge invariants on any Edge (each with its own lease ledger, no lease leak at the end), no run
    of a fenced epoch dispatched on a node, no Edge admitting after its lease could have expired in
    etcd, the backend never past a provider's capacity; the node fence refused stale runs in these
    seeds (it was exercised, not only idle)."""
    summary = run_and_summarize(HA_SEEDS, run=run_ha_seed, summary=ha_summary())
    print("\n" + summary.render())
    failed = [(r.seed, r.violations[:5]) for r in summary.failed_seeds]
    assert not failed, (
        f"seeds with violations (rerun: python -m tests.sim --ha --first-seed SEED --seeds 1 --trace): {failed}"
    )
    assert {site: summary.fired[site] for site in HA_SITES if not summary.fired[site]} == {}
    assert summary.fired["runs refused stale"] > 0
    assert summary.fired["runs past the node fence"] > 0


def test_the_checker_sees_a_run_of_a_fenced_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sensitivity: with the node's fence letting every epoch through, the checker reports a run of
    a fenced epoch dispatched (seed 9: the leader loses its lease while it still sends runs)."""
    monkeypatch.setattr(EpochFence, "check", lambda self, epoch: self.raise_to(epoch or 0))
    result = run_ha_seed(9)
    assert any("run of fenced epoch" in v for v in result.violations), result.violations[:5]


def test_the_checker_sees_a_leader_outliving_its_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sensitivity: with an Edge that admits while it believes it leads, without its own count of its
    lease, the checker reports an Edge admitting after its lease could have expired in etcd (seed 17:
    the leader paused past its TTL)."""
    monkeypatch.setattr(EdgeHa, "admits", lambda self: self.leadership.leading)
    result = run_ha_seed(17)
    assert any("expired in etcd" in v for v in result.violations), result.violations[:5]
