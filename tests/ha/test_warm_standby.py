"""[warm-standby] A Node with ``edge_urls`` stays registered with every Edge; the standby that wins admits at once."""

from __future__ import annotations

import random
from pathlib import Path

import attrs
import pytest
import trio
from tests.edge.harness import BIG, mock_provider, node_config

from iop_node import EdgeClients, NodeRuntime

from .etcd_server import EtcdServer
from .harness import BOUND_S, leader_and_standby, leads, until

pytestmark = pytest.mark.req("warm-standby")


async def test_the_node_is_registered_with_both_edges_and_the_new_leader_serves_without_a_new_registration(
    etcd: EtcdServer, tmp_path: Path
) -> None:
    with trio.fail_after(BOUND_S):
        async with trio.open_nursery() as nursery:
            a, stop_a, b, stop_b = await leader_and_standby(nursery, etcd, tmp_path)
            one = node_config(a, "node-a", [mock_provider()])
            config = attrs.evolve(
                one, edge_url=None, edge_urls=(f"ws://127.0.0.1:{a.node_port}", f"ws://127.0.0.1:{b.node_port}")
            )
            async with NodeRuntime.from_config(config) as runtime:
                clients = EdgeClients(config, runtime, rng=random.Random(3))
                nursery.start_soon(clients.run)
                await until(
                    lambda: a.service.admission.is_connected("node-a") and b.service.admission.is_connected("node-a")
                )
                assert (await a.chat(BIG)).status_code == 200
                assert (await b.chat(BIG)).status_code == 503  # b stands by, though it holds the node

                assert a.service.ha is not None and b.service.ha is not None
                epoch_a = a.service.ha.leadership.epoch
                assert runtime.fence.seen == epoch_a  # a's Leader message, and its run's epoch
                to_b = clients.clients[1]
                assert (to_b.edge, to_b.connections) == (config.edge_urls[1], 1)
                stop_a.cancel()
                await until(lambda: leads(b))
                answer = await b.chat(BIG)
                assert answer.status_code == 200, answer.text
                assert to_b.connections == 1  # served over the registration b held while standing by
                # [epoch-fencing] b announced its term: the node's fence is at b's epoch, above a's.
                assert runtime.fence.seen == b.service.ha.leadership.epoch > epoch_a
                clients.shutdown()
            stop_b.cancel()
