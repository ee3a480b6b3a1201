"""A bounded flood of the Edge's node socket, by hand: ``python -m benchmarks.node_flood``.

Starts an ``iop-edge`` process on loopback (ports chosen by the kernel) with the
node-socket limits given on the command line, then, from this process:

1. opens ``--idle`` TCP connections that never send a byte, at ``--rate`` per
   second, spread over ``--sources`` loopback addresses (127.0.0.2, ...);
2. at the same time sends ``--bad-token`` registrations with a wrong token
   from 127.0.0.250;
3. once the flood is under way, starts a real node (in this process, from
   127.0.0.1, ``adapter: mock``) and sends it one chat request through the Edge.

Every flood connection is watched until the Edge closes it; the script prints
how many were closed at once (refused at accept), how many at the handshake
deadline, how many otherwise, how long the real node took to register, and the
Edge's node-socket metrics at the end. Loopback only; bounded in count
(``--idle``, ``--bad-token``) and time (``--timeout``).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import re
import statistics
import sys
import tempfile
import time
from typing import Any

import httpx
import trio
from trio_websocket import ConnectionClosed, HandshakeError, wrap_client_stream

from iop_node import EdgeClient, NodeConfig, NodeRuntime, ProviderConfig, RuntimeConfig
from iop_wire import PROTOCOL_VERSION, ProviderInfo, Register, decode, encode

EDGE_YAML = """\
listen: 127.0.0.1:0
node_listen: 127.0.0.1:0
node_handshake_timeout_ms: {handshake_ms}
node_max_pending: {max_pending}
node_max_pending_per_address: {per_address}
nodes:
  - id: node-a
    token: flood-node-token
    providers:
      - {{id: gpu0, capacity: 1}}
models:
  - id: m
    candidates: [{{node: node-a, provider: gpu0}}]
"""
LISTENING = re.compile(r"listening: http://[^:]+:(\d+) \(API\), wss?://[^:]+:(\d+) \(nodes\)")


async def _start_edge(config: pathlib.Path) -> tuple[trio.Process, int, int]:
    """Start ``iop-edge`` (its log goes to ``edge.log`` beside the config) and read its ports from the log."""
    log = config.with_name("edge.log")
    with log.open("wb") as sink:
        edge = await trio.lowlevel.open_process(
            [sys.executable, "-m", "iop_edge", "--config", str(config)], stderr=sink
        )
    with trio.fail_after(30):
        while not (match := LISTENING.search(log.read_text())):
            if edge.poll() is not None:
                raise RuntimeError(f"iop-edge exited before listening:\n{log.read_text()}")
            await trio.sleep(0.05)
    return edge, int(match[1]), int(match[2])


async def _watch_idle(port: int, source: str, record: list[tuple[float, float | None]]) -> None:
    """One idle connection: open it, wait for the Edge to close it, note (opened, closed)."""
    opened = time.monotonic()
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port, local_address=source)
    except OSError:
        record.append((opened, None))
        return
    try:
        while await stream.receive_some(4096):
            pass
    except trio.BrokenResourceError:
        pass
    finally:
        closed = time.monotonic()
        await stream.aclose()
    record.append((opened, closed))


async def _bad_token(port: int, answers: list[str]) -> None:
    """One registration with a wrong token; notes ``bad_token`` or ``refused``."""
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", port, local_address="127.0.0.250")
    except OSError:
        answers.append("connect_failed")
        return
    try:
        async with trio.open_nursery() as nursery:
            with trio.move_on_after(10) as scope:
                try:
                    ws = await wrap_client_stream(nursery, stream, "127.0.0.1", "/")
                    await ws.send_message(
                        encode(Register("node-a", "wrong", PROTOCOL_VERSION, (ProviderInfo("gpu0", "mock", 1),)))
                    )
                    answers.append(getattr(decode(await ws.get_message()), "code", "other"))
                except (HandshakeError, ConnectionClosed, trio.BrokenResourceError):
                    answers.append("refused")
            if scope.cancelled_caught:
                answers.append("refused")  # trio-websocket's client waits for a handshake answer that never comes
            nursery.cancel_scope.cancel()
    finally:
        await stream.aclose()


async def _real_node(http_port: int, node_port: int, result: dict[str, Any]) -> None:
    """Register a real node from 127.0.0.1, time it, send one chat request through the Edge."""
    config = NodeConfig(
        node_id="node-a",
        edge_url=f"ws://127.0.0.1:{node_port}",
        token="flood-node-token",
        providers=(ProviderConfig(id="gpu0", adapter="mock", capacity=1),),
        runtime=RuntimeConfig(concurrency=1),
    )
    start = time.monotonic()
    async with NodeRuntime.from_config(config) as runtime:
        client = EdgeClient(config, runtime, rng=random.Random(1))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.run)
            while client.session is None or client.session.registered is None:
                await trio.sleep(0.01)
            result["register_seconds"] = round(time.monotonic() - start, 3)
            result["connection_attempts"] = client.connections
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=30) as http:
                body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                result["chat_status"] = (await http.post("/v1/chat/completions", json=body)).status_code
            client.shutdown()


def _classify(record: list[tuple[float, float | None]], deadline: float) -> dict[str, Any]:
    at_once, at_deadline, other = [], [], []
    for opened, closed in record:
        if closed is None:
            other.append(float("nan"))
            continue
        held = closed - opened
        if held < 0.25 * deadline:
            at_once.append(held)
        elif held < 2.0 * deadline:
            at_deadline.append(held)
        else:
            other.append(held)

    def summary(values: list[float]) -> dict[str, Any]:
        finite = [v for v in values if not math.isnan(v)]
        return {
            "count": len(values),
            "median_s": round(statistics.median(finite), 3) if finite else None,
            "max_s": round(max(finite), 3) if finite else None,
        }

    return {"closed_at_once": summary(at_once), "closed_at_deadline": summary(at_deadline), "other": summary(other)}


async def flood(args: argparse.Namespace) -> dict[str, Any]:
    """Run one flood against a fresh Edge process; return the figures."""
    with tempfile.TemporaryDirectory() as tmp:
        config = pathlib.Path(tmp) / "edge.yaml"
        config.write_text(
            EDGE_YAML.format(handshake_ms=args.handshake_ms, max_pending=args.max_pending, per_address=args.per_address)
        )
        edge, http_port, node_port = await _start_edge(config)
        record: list[tuple[float, float | None]] = []
        answers: list[str] = []
        node: dict[str, Any] = {}
        start = time.monotonic()
        try:
            with trio.fail_after(args.timeout):
                async with trio.open_nursery() as nursery:
                    for i in range(max(args.idle, args.bad_token)):
                        if i < args.idle:
                            source = f"127.0.0.{2 + i % args.sources}"
                            nursery.start_soon(_watch_idle, node_port, source, record)
                        if i < args.bad_token:
                            nursery.start_soon(_bad_token, node_port, answers)
                        if i == args.idle // 3:
                            nursery.start_soon(_real_node, http_port, node_port, node)
                        await trio.sleep(1 / args.rate)
                    flood_seconds = time.monotonic() - start
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}") as http:
                metrics = (await http.get("/metrics")).text
        finally:
            edge.terminate()
            with trio.move_on_after(10):
                await edge.wait()
            if edge.returncode is None:
                edge.kill()
    return {
        "settings": vars(args),
        "flood_seconds": round(flood_seconds, 2),
        "idle_connections": len(record),
        **_classify(record, args.handshake_ms / 1000),
        "bad_token_answers": {code: answers.count(code) for code in sorted(set(answers))},
        "real_node": node,
        "edge_metrics": [
            line for line in metrics.splitlines() if line.startswith("iop_node_") and "_created" not in line
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.node_flood", description=__doc__)
    parser.add_argument("--idle", type=int, default=3000, help="idle connections to open (default 3000)")
    parser.add_argument("--bad-token", type=int, default=300, help="bad-token registrations (default 300)")
    parser.add_argument("--rate", type=float, default=500.0, help="new connections per second (default 500)")
    parser.add_argument("--sources", type=int, default=64, help="loopback source addresses for idle ones (default 64)")
    parser.add_argument("--handshake-ms", type=int, default=1000, help="node_handshake_timeout_ms (default 1000)")
    parser.add_argument("--max-pending", type=int, default=256, help="node_max_pending (default 256)")
    parser.add_argument("--per-address", type=int, default=8, help="node_max_pending_per_address (default 8)")
    parser.add_argument("--timeout", type=float, default=60.0, help="bound of the whole run in seconds (default 60)")
    args = parser.parse_args(argv)
    if not 1 <= args.sources <= 200 or args.idle > 10_000 or args.bad_token > 2_000:
        parser.error("keep it small: --sources 1..200, --idle <= 10000, --bad-token <= 2000")
    print(json.dumps(trio.run(flood, args), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
