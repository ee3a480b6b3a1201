"""[tls] The node socket over TLS and mutual TLS, with certificates made by ``trustme`` at test time.

Real in-process nodes (``EdgeClient``) dial ``wss://127.0.0.1:<port>`` with the
node config's ``tls`` settings; the Edge serves ``node_tls`` from files, so a
reload re-reads them.
"""

from __future__ import annotations

import random
from pathlib import Path

import attrs
import pytest
import trio

from edge.harness import Edge, EdgeLayout, eventually, mock_provider, node_config, real_node, running_edge
from edge.tls_certs import CertFiles, PrivateCA
from iop_config import client_ssl_context
from iop_node import EdgeClient, NodeConfig, NodeRuntime, RegistrationRejected
from iop_node.config import TlsConfig

pytestmark = pytest.mark.req("tls")


def _tls_layout(server: CertFiles, client_ca: Path | None = None) -> EdgeLayout:
    fields = f"cert_file: '{server.cert_file}', key_file: '{server.key_file}'"
    if client_ca is not None:
        fields += f", client_ca_file: '{client_ca}'"
    return EdgeLayout(extra=(f"node_tls: {{{fields}}}",))


def _wss_node(edge: Edge, node_id: str, ca: Path, client: CertFiles | None = None) -> NodeConfig:
    provider = mock_provider("gpu0" if node_id == "node-a" else "gpu1")
    tls = TlsConfig(
        ca_file=str(ca),
        cert_file=None if client is None else str(client.cert_file),
        key_file=None if client is None else str(client.key_file),
    )
    config = node_config(edge, node_id, [provider])
    return attrs.evolve(config, edge_url=f"wss://127.0.0.1:{edge.node_port}", tls=tls)


def _metric(edge: Edge, name: str, **labels: str) -> float:
    value = edge.service.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def _refused_at_tls(edge: Edge, config: NodeConfig) -> None:
    """Run a node that the Edge refuses during the TLS handshake; return once the Edge counted it."""
    before = _metric(edge, "iop_node_pending_closed_total", reason="tls_handshake")
    async with NodeRuntime.from_config(config) as runtime:
        client = EdgeClient(config, runtime, rng=random.Random(3))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.run)
            await eventually(lambda: _metric(edge, "iop_node_pending_closed_total", reason="tls_handshake") > before)
            client.shutdown()
    assert not edge.service.admission.is_connected(config.node_id)
    await eventually(lambda: edge.service.registry.limits.pending == 0)


async def test_node_over_wss_without_client_certificates(tmp_path: Path) -> None:
    """[tls] node_tls without client_ca_file: a node that trusts the Edge's private CA registers over
    wss:// and serves a request."""
    edge_ca = PrivateCA(tmp_path, "edge")
    server = edge_ca.issue("edge", "127.0.0.1", "localhost")
    with trio.fail_after(20):
        async with running_edge(tmp_path, _tls_layout(server)) as edge:
            async with real_node(edge, _wss_node(edge, "node-a", edge_ca.ca_file)):
                response = await edge.chat("ornith-fast")
                assert response.status_code == 200
            await edge.assert_drained()


async def test_mutual_tls_node_certificate_must_name_its_node_id(tmp_path: Path) -> None:
    """[tls] with client_ca_file: node-a with a certificate for node-a registers; node-b presenting a
    certificate for node-a is rejected (bad_token, not retryable; counted as cert_mismatch); a node
    without a client certificate is refused in the TLS handshake."""
    edge_ca, node_ca = PrivateCA(tmp_path, "edge"), PrivateCA(tmp_path, "nodes")
    server = edge_ca.issue("edge", "127.0.0.1")
    node_a = node_ca.issue("node-a", "node-a")
    with trio.fail_after(30):
        async with running_edge(tmp_path, _tls_layout(server, node_ca.ca_file)) as edge:
            async with real_node(edge, _wss_node(edge, "node-a", edge_ca.ca_file, node_a)):
                assert (await edge.chat("ornith-fast")).status_code == 200
                impostor = _wss_node(edge, "node-b", edge_ca.ca_file, node_a)
                async with NodeRuntime.from_config(impostor) as runtime:
                    with pytest.raises(RegistrationRejected) as rejected:
                        await EdgeClient(impostor, runtime, rng=random.Random(5)).run()
                assert (rejected.value.code, rejected.value.retryable) == ("bad_token", False)
                failures = "iop_node_registration_failures_total"
                assert _metric(edge, failures, reason="cert_mismatch", address_class="loopback") == 1
                assert not edge.service.admission.is_connected("node-b")
                await _refused_at_tls(edge, _wss_node(edge, "node-b", edge_ca.ca_file))
            await edge.assert_drained()


async def test_expired_node_certificate_is_refused(tmp_path: Path) -> None:
    """[tls] a node certificate from the right CA for the right node id, but expired, is refused in the
    TLS handshake; nothing stays pending."""
    edge_ca, node_ca = PrivateCA(tmp_path, "edge"), PrivateCA(tmp_path, "nodes")
    server = edge_ca.issue("edge", "127.0.0.1")
    expired = node_ca.issue("node-a-old", "node-a", expired=True)
    with trio.fail_after(30):
        async with running_edge(tmp_path, _tls_layout(server, node_ca.ca_file)) as edge:
            await _refused_at_tls(edge, _wss_node(edge, "node-a", edge_ca.ca_file, expired))
            assert _metric(edge, "iop_node_connects_total", node="node-a") == 0


async def _tls_handshake(edge: Edge, ca_file: Path) -> None:
    """A bare TLS handshake with the node socket, trusting only ``ca_file``."""
    stream = await trio.open_ssl_over_tcp_stream(
        "127.0.0.1", edge.node_port, ssl_context=client_ssl_context(str(ca_file))
    )
    try:
        await stream.do_handshake()
    finally:
        await trio.aclose_forcefully(stream)


async def test_reload_reads_new_certificates_without_dropping_connections(tmp_path: Path) -> None:
    """[tls] new certificate files at the same paths, then a reload: the node registered over the old
    certificate keeps its connection (same generation, still serving); new connections get the new
    certificate (a client trusting only the old CA is refused, one trusting the new CA registers)."""
    old_ca, new_ca = PrivateCA(tmp_path, "old"), PrivateCA(tmp_path, "new")
    server = old_ca.issue("edge", "127.0.0.1")
    with trio.fail_after(300):  # a bound for a hang, not a budget: a busy machine is slow
        async with running_edge(tmp_path, _tls_layout(server)) as edge:
            async with real_node(edge, _wss_node(edge, "node-a", old_ca.ca_file)):
                generation = edge.service.admission.generation("node-a")
                await _tls_handshake(edge, old_ca.ca_file)
                renewed = new_ca.issue("renewed", "127.0.0.1")
                server.cert_file.write_bytes(renewed.cert_file.read_bytes())
                server.key_file.write_bytes(renewed.key_file.read_bytes())
                assert await edge.service.reload() == []
                with pytest.raises(trio.BrokenResourceError):
                    await _tls_handshake(edge, old_ca.ca_file)
                async with real_node(edge, _wss_node(edge, "node-b", new_ca.ca_file)):
                    assert edge.service.admission.generation("node-a") == generation
                    assert edge.service.admission.is_connected("node-a")
                    assert (await edge.chat("ornith-fast")).status_code == 200
            await edge.assert_drained()
