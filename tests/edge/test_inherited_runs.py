"""[held-elsewhere] What a new leader makes of the nodes' ``in_flight`` reports (``LeaderFence``).

Pure: the fence's ``hold`` is a recorder, no Edge and no etcd.
"""

from __future__ import annotations

import pytest

from iop_admission import ProviderKey
from iop_edge.ha.fencing import LeaderFence
from iop_wire import InFlight

pytestmark = pytest.mark.req("held-elsewhere")

GPU0, GPU1 = ProviderKey("node-a", "gpu0"), ProviderKey("node-a", "gpu1")


def leading() -> tuple[LeaderFence, list[tuple[ProviderKey, int, int]]]:
    held: list[tuple[ProviderKey, int, int]] = []
    fence = LeaderFence(hold=lambda key, runs, long_runs: held.append((key, runs, long_runs)))
    fence.lead(7, [])
    return fence, held


def test_each_change_of_a_report_holds_the_runs_and_the_long_ones() -> None:
    fence, held = leading()
    fence.answered("node-a", InFlight(7, (("gpu0", 2), ("gpu1", 1)), (("gpu0", 1),)))
    assert sorted(held) == [(GPU0, 2, 1), (GPU1, 1, 0)]
    assert fence.inherited == {"node-a": {"gpu0": (2, 1), "gpu1": (1, 0)}} and fence.inherited_runs == 3
    held.clear()
    fence.answered("node-a", InFlight(7, (("gpu0", 2), ("gpu1", 1))))  # the long run on gpu0 ended
    assert held == [(GPU0, 2, 0)]
    held.clear()
    fence.answered("node-a", InFlight(6, ()))  # an answer to an older leader: dropped
    fence.answered("node-a", InFlight(7, ()))
    assert sorted(held) == [(GPU0, 0, 0), (GPU1, 0, 0)]
    assert fence.inherited == {} and fence.inherited_runs == 0


def test_a_nodes_bad_counts_are_made_sense_of_not_raised() -> None:
    """A count below 0 is none, a long count above the runs is the runs (``hold`` would refuse either)."""
    fence, held = leading()
    fence.answered("node-a", InFlight(7, (("gpu0", 2), ("gpu1", -3)), (("gpu0", 5), ("gpu1", 1))))
    assert held == [(GPU0, 2, 2)]
    held.clear()
    fence.answered("node-a", InFlight(7, (("gpu0", 1),), (("gpu0", -1),)))
    assert held == [(GPU0, 1, 0)]


def test_a_new_term_forgets_the_last_terms_reports() -> None:
    fence, held = leading()
    fence.answered("node-a", InFlight(7, (("gpu0", 1),), (("gpu0", 1),)))
    held.clear()
    fence.lead(8, [])
    assert held == [(GPU0, 0, 0)] and fence.inherited == {}
