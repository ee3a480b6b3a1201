"""The core's plain queries: nodes, generations, connectivity, the latest time, the queue and
the live leases (what the layers' snapshots and the Edge's status read)."""

from __future__ import annotations

import pytest

from iop_admission import Unavailable
from iop_admission.core import AdmissionState, Lease, Waiter

BIG = "ornith:35b"
FAST = "ornith-fast"


def test_node_queries_before_and_after_connecting(pool):
    """A node never connected has generation 0 and is not connected; a node of no config is
    unknown; ``nodes`` lists each node once, in provider order."""
    core = AdmissionState(pool.two_nodes())
    assert core.nodes() == ("node-a", "node-b")
    assert (core.generation("node-a"), core.generation("nowhere")) == (0, 0)
    assert (core.knows_node("node-b"), core.knows_node("nowhere")) == (True, False)
    assert (core.is_connected("node-a"), core.is_connected("nowhere")) == (False, False)
    core.connect("node-b")
    core.connect("node-b")
    assert (core.generation("node-b"), core.is_connected("node-b"), core.is_connected("node-a")) == (2, True, False)
    core.disconnect("node-b", 2)
    assert (core.generation("node-b"), core.is_connected("node-b")) == (2, False)


def test_queue_leases_and_latest_time(pool):
    core = AdmissionState(pool.shared(capacity=2))
    core.connect("node-a")
    assert (core.queue_depth, list(core.waiters()), list(core.live_leases()), core.last_time) == (0, [], [], 0.0)
    first = core.request(BIG, False, 3.0)
    second = core.request(FAST, False, 2.0)
    waiter = core.request(BIG, False, 4.0)
    assert isinstance(first, Lease) and isinstance(second, Lease) and isinstance(waiter, Waiter)
    assert (core.queue_depth, list(core.waiters()), core.last_time) == (1, [waiter], 4.0)
    assert list(core.live_leases()) == [first, second]
    assert core.config.models[BIG].candidates == (pool.gpu0,)


def test_unavailable_names_the_node_to_connect(pool):
    """A request whose candidates' nodes never connected is refused with one reason per
    candidate naming its node."""
    core = AdmissionState(pool.two_nodes())
    with pytest.raises(Unavailable) as caught:
        core.request(BIG, False, 0.0)
    assert caught.value.reasons == (
        "node-a/gpu0: node 'node-a' is not connected (call connect('node-a'))",
        "node-b/gpu1: node 'node-b' is not connected (call connect('node-b'))",
    )
