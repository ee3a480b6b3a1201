"""[tls] The HTTP API over TLS: the official ``openai`` client over https, and certificate reload.

Certificates come from ``trustme`` at test time; clients trust the test CA
through an ``httpx`` client given an SSL context.
"""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

import httpx
import openai
import pytest
import trio
import trustme

from edge.harness import BIG, FAST, Edge, EdgeLayout, eventually, mock_provider, node_config, real_node, running_edge
from edge.tls_certs import CertFiles, PrivateCA
from iop_config import client_ssl_context
from iop_edge.listener.server import ConnectionCounter, HttpLimits, serve_http

pytestmark = pytest.mark.req("tls")

API_KEY = "tls-client-key-sentinel"


def _layout(server: CertFiles) -> EdgeLayout:
    return EdgeLayout(
        api_keys=(API_KEY,), extra=(f"tls: {{cert_file: '{server.cert_file}', key_file: '{server.key_file}'}}",)
    )


def _stream_chat(base_url: str, context: ssl.SSLContext) -> list[str]:
    with (
        httpx.Client(verify=context) as http,
        openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, http_client=http) as client,
    ):
        stream = client.chat.completions.create(
            model=FAST, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
        )
        with stream:
            return [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]


async def test_openai_client_over_https(tmp_path: Path) -> None:
    """[tls] with tls: {cert_file, key_file} the HTTP API speaks https: the openai client (trusting the
    private CA) lists models, chats and streams; a plain-http request to the same port gets no answer."""
    ca = PrivateCA(tmp_path, "api")
    server = ca.issue("api", "127.0.0.1")
    context = client_ssl_context(str(ca.ca_file))
    with trio.fail_after(30):
        async with running_edge(tmp_path, _layout(server)) as edge:
            base_url = f"https://127.0.0.1:{edge.http_port}/v1"
            async with real_node(edge, node_config(edge, "node-a", [mock_provider("gpu0")])):
                async with (
                    httpx.AsyncClient(verify=context) as http,
                    openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, http_client=http) as client,
                ):
                    assert [m.id for m in (await client.models.list()).data] == [BIG, FAST]
                    chat = await client.chat.completions.create(
                        model=BIG, messages=[{"role": "user", "content": "hi"}], max_tokens=5
                    )
                    assert chat.choices[0].message.content
                chunks = await trio.to_thread.run_sync(_stream_chat, base_url, context)
                assert "".join(chunks)
            with pytest.raises(httpx.TransportError):
                await edge.http.get("/healthz")  # the harness's client speaks plain http
            await edge.assert_drained()


async def _healthz(edge: Edge, http: httpx.AsyncClient) -> int:
    return (await http.get(f"https://127.0.0.1:{edge.http_port}/healthz")).status_code


async def test_reload_serves_new_certificates_and_keeps_open_connections(tmp_path: Path) -> None:
    """[tls] new certificate files, then a reload: a keep-alive connection opened before (its client
    trusts only the old CA) keeps working; new connections get the new certificate."""
    old_ca, new_ca = PrivateCA(tmp_path, "old"), PrivateCA(tmp_path, "new")
    server = old_ca.issue("api", "127.0.0.1")
    with trio.fail_after(30):
        async with running_edge(tmp_path, _layout(server)) as edge:
            # The old client keeps its idle connection however long the reload takes (httpx drops it after 5 s).
            keep = httpx.Limits(keepalive_expiry=60)
            async with (
                httpx.AsyncClient(verify=client_ssl_context(str(old_ca.ca_file)), limits=keep) as old_client,
                httpx.AsyncClient(verify=client_ssl_context(str(new_ca.ca_file))) as new_client,
            ):
                assert await _healthz(edge, old_client) == 200
                renewed = new_ca.issue("renewed", "127.0.0.1")
                server.cert_file.write_bytes(renewed.cert_file.read_bytes())
                server.key_file.write_bytes(renewed.key_file.read_bytes())
                assert await edge.service.reload() == []
                assert await _healthz(edge, old_client) == 200  # the same connection, still open
                assert await _healthz(edge, new_client) == 200
                async with httpx.AsyncClient(verify=client_ssl_context(str(old_ca.ca_file))) as fresh_old:
                    with pytest.raises(httpx.ConnectError):
                        await _healthz(edge, fresh_old)


async def test_reload_refuses_bad_certificate_files_and_turning_tls_off(tmp_path: Path) -> None:
    """[tls] a reload whose key does not match its certificate is rejected with the file and field named,
    and one that drops tls is rejected (turning TLS on or off takes a restart); the old certificate
    stays in use."""
    ca = PrivateCA(tmp_path, "api")
    server, other = ca.issue("api", "127.0.0.1"), ca.issue("other", "127.0.0.1")
    with trio.fail_after(30):
        async with running_edge(tmp_path, _layout(server)) as edge:
            edge.rewrite(_layout(CertFiles(server.cert_file, other.key_file)))
            (error,) = await edge.service.reload()
            assert error.endswith(f"tls.key_file: '{other.key_file}' does not match the certificate in cert_file")
            edge.rewrite(EdgeLayout(api_keys=(API_KEY,)))
            assert await edge.service.reload() == [f"{edge.config_path}: tls: turning TLS on or off takes a restart"]
            async with httpx.AsyncClient(verify=client_ssl_context(str(ca.ca_file))) as http:
                assert await _healthz(edge, http) == 200


def _fill_send_buffer(stream: trio.SocketStream) -> None:
    """Write to ``stream``'s socket until the kernel takes no more (its peer reads nothing)."""
    with socket.socket(fileno=socket.dup(stream.socket.fileno())) as sock:
        sock.setblocking(False)
        try:
            while True:
                sock.send(bytes(65536))
        except BlockingIOError:
            pass


async def test_a_tls_client_that_never_reads_is_still_closed_within_the_close_timeout() -> None:
    """[tls] a TLS connection (a stream that sends ``close_notify`` on close) whose client reads
    nothing, so the socket's buffers are full: at the keep-alive timeout the listener's graceful close
    would wait forever for room; it gives up after ``close_timeout``, drops the connection and
    releases its slot."""
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    server_context.maximum_version = ssl.TLSVersion.TLSv1_2  # no TLS 1.3 tickets after the handshake
    server_context.options |= ssl.OP_NO_TICKET  # (whose sending would break the stream, so no close_notify)
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)

    async def secure(stream: trio.SocketStream) -> trio.abc.Stream:
        tls = trio.SSLStream(stream, server_context, server_side=True)  # not https_compatible: close_notify
        await tls.do_handshake()
        _fill_send_buffer(stream)  # what the client was sent before and never read
        return tls

    async def app(scope: object, receive: object, send: object) -> None:
        raise AssertionError("the client sends no request")

    counter = ConnectionCounter(limit=4)
    limits = HttpLimits(header_timeout=5, keep_alive_timeout=0.2, close_timeout=0.2)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(
                lambda task_status: serve_http(
                    app, "127.0.0.1", 0, limits=limits, counter=counter, wrap_stream=secure, task_status=task_status
                )
            )
            tcp = await trio.open_tcp_stream("127.0.0.1", port)
            client = trio.SSLStream(tcp, client_context, server_hostname="127.0.0.1")
            await client.do_handshake()
            await eventually(lambda: counter.open == 1)
            await eventually(lambda: counter.open == 0)  # closed and released though the client never read
            try:
                while await tcp.receive_some():  # what the server sent, then its end
                    pass
            except trio.BrokenResourceError:
                pass  # dropped with bytes unsent: a reset
            await tcp.aclose()
            nursery.cancel_scope.cancel()
