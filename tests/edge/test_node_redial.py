"""[edge-liveness] A node refused at accept or in the TLS handshake dials again after its backoff.

Real sockets on 127.0.0.1, bounded: the attempt must end with the refusal
(the peer's close, the failed handshake), never with the node's own connect
timeout (``trio.TooSlowError`` after ``CONNECT_TIMEOUT``, 10 s).
"""

from __future__ import annotations

import functools
import logging
import random
from pathlib import Path

import pytest
import trio

from edge.harness import eventually, mock_provider, running_edge
from edge.test_node_tls import _metric, _tls_layout, _wss_node
from edge.tls_certs import PrivateCA
from iop_node import EdgeClient, NodeConfig, NodeRuntime, ReconnectConfig

pytestmark = pytest.mark.req("edge-liveness")


@pytest.fixture(autouse=True)
def node_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="iop_node")


def refusal_reasons(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "reconnecting in" in r.getMessage()]


async def test_closed_at_accept_dials_again_after_its_backoff(caplog: pytest.LogCaptureFixture) -> None:
    accepted = 0

    async def close_at_once(stream: trio.SocketStream) -> None:
        nonlocal accepted
        accepted += 1
        await stream.aclose()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            (listener,) = await nursery.start(functools.partial(trio.serve_tcp, close_at_once, 0, host="127.0.0.1"))
            port = listener.socket.getsockname()[1]
            config = NodeConfig(
                node_id="node-a",
                edge_url=f"ws://127.0.0.1:{port}",
                providers=(mock_provider(),),
                token="t",
                reconnect=ReconnectConfig(initial_ms=10, max_ms=50),
            )
            async with NodeRuntime.from_config(config) as runtime:
                client = EdgeClient(config, runtime, rng=random.Random(2))
                nursery.start_soon(client.run)
                await eventually(lambda: accepted >= 3)
                client.shutdown()
            nursery.cancel_scope.cancel()
    reasons = refusal_reasons(caplog)
    assert len(reasons) >= 2 and all("HandshakeError" in r for r in reasons), reasons


async def test_refused_in_the_tls_handshake_dials_again_after_its_backoff(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    edge_ca, node_ca = PrivateCA(tmp_path, "edge"), PrivateCA(tmp_path, "nodes")
    server = edge_ca.issue("edge", "127.0.0.1")
    with trio.fail_after(30):
        async with running_edge(tmp_path, _tls_layout(server, node_ca.ca_file)) as edge:
            config = _wss_node(edge, "node-a", edge_ca.ca_file)  # no client certificate: refused
            async with NodeRuntime.from_config(config) as runtime:
                client = EdgeClient(config, runtime, rng=random.Random(3))
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(client.run)
                    await eventually(
                        lambda: _metric(edge, "iop_node_pending_closed_total", reason="tls_handshake") >= 3
                    )
                    client.shutdown()
    reasons = refusal_reasons(caplog)
    assert len(reasons) >= 2 and not any("TooSlowError" in r for r in reasons), reasons
