"""websocket_connector on real loopback sockets: the handshake against an Edge that closes at once.

An Edge at its cap of pending node connections closes a new one right after
accepting it. trio-websocket's client alone would wait out the whole connect
timeout for a handshake answer; the connector must fail at once, so the node
backs off (tenths of a second) and retries [reconnect-storm].
"""

from __future__ import annotations

import functools

import pytest
import trio
from trio_websocket import HandshakeError, serve_websocket

from iop_node import websocket_connector

CONNECT_TIMEOUT = 600.0
"""Far beyond each test's bound: a connector that waited it out fails the test."""


async def _close_at_accept(stream: trio.SocketStream) -> None:
    await trio.aclose_forcefully(stream)


async def _read_then_close(stream: trio.SocketStream) -> None:
    await stream.receive_some()  # the handshake request arrived; never answer it
    await stream.aclose()


@pytest.mark.req("reconnect-storm")
@pytest.mark.parametrize("handler", [_close_at_accept, _read_then_close])
async def test_connection_closed_before_the_handshake_fails_at_once(handler: object) -> None:
    """[reconnect-storm] the Edge closes the connection before answering: HandshakeError, not a wait."""
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            connect = websocket_connector(f"ws://127.0.0.1:{port}/", connect_timeout=CONNECT_TIMEOUT)
            with pytest.raises(HandshakeError, match="closed the connection before"):
                async with connect(nursery):
                    pass
            nursery.cancel_scope.cancel()


async def test_local_address_binds_the_source_address() -> None:
    """local_address: the Edge sees the connection come from that address."""
    peers: list[str] = []

    async def handler(request: object) -> None:
        ws = await request.accept()  # type: ignore[attr-defined]
        peers.append(str(ws.remote.address))
        await ws.send_message("hello")

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve_websocket, handler, "127.0.0.1", 0, None)
            connect = websocket_connector(
                f"ws://127.0.0.1:{server.port}/", connect_timeout=CONNECT_TIMEOUT, local_address="127.0.0.7"
            )
            async with connect(nursery) as ws:
                assert await ws.get_message() == "hello"
            nursery.cancel_scope.cancel()
    assert peers == ["127.0.0.7"]
