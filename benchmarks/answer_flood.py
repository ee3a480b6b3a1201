"""``/healthz`` and memory while a backend floods the Node with 96 MiB answers: ``python -m benchmarks.answer_flood``.

Starts an ``iop-edge`` and an ``iop-node`` process on loopback (one ``openai`` provider of capacity
``--clients``) in front of a backend run in this process that answers every chat completion with
a well-formed non-stream answer of ``--answer-mib`` MiB (default 96). ``--clients`` connections each
post requests back to back while a probe sends ``GET /healthz`` to the Edge every ``--interval`` ms
on its own connection; the Edge's and the Node's resident memory is sampled every 100 ms.

Phases, each with fresh processes: ``idle`` (no flood); ``bounded``, the defaults (the Node's
``limits.answer_bytes`` and the Edge's ``max_answer_bytes``, 16 MiB each: every answer is refused 502
``upstream_too_large``); ``budget``, both raised to 128 MiB with the Edge's default
``answer_budget_bytes`` (256 MiB: answers that do not fit beside the others held are refused 503
``overloaded``); ``relayed``, the budget raised to 512 MiB too, so every answer goes to its client
whole (held by the Edge, as its pieces, until its run ends). Prints per phase the probe's p50, p99 and max, the answers per
second and each process's resident memory before the flood and at its peak. Bounded: ``--seconds``
per phase, loopback only. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import tempfile
import time

import h11
import trio

from benchmarks.body_flood import probe, sample
from benchmarks.harness import HttpConnection, percentile, rss_mb

MiB = 1024 * 1024
PIECE = b"x" * (64 * 1024)
RELAYED = {"max_answer_bytes": 128 * MiB, "answer_budget_bytes": 512 * MiB}
"""The Edge's bounds in the ``relayed`` phase: four 96 MiB answers fit at once."""
EDGE_READY = re.compile(r"listening: http://[^ ]+:(\d+) \(API\), ws://[^ ]+:(\d+) \(nodes\)")
NODE_READY = re.compile(r"registered as node-a")


def edge_yaml(clients: int, limits: dict[str, int]) -> str:
    return (
        "listen: 127.0.0.1:0\nnode_listen: 127.0.0.1:0\n"
        + "".join(f"{key}: {value}\n" for key, value in limits.items())
        + "nodes:\n  - id: node-a\n    token: flood-node-token\n"
        f"    providers:\n      - {{id: gpu0, capacity: {clients}}}\n"
        "models:\n  - id: m\n    candidates: [{node: node-a, provider: gpu0}]\n"
    )


def node_yaml(edge_node_port: int, backend_port: int, clients: int, answer_bytes: int | None) -> str:
    limits = "" if answer_bytes is None else f", limits: {{answer_bytes: {answer_bytes}}}"
    return (
        f"node_id: node-a\ntoken: flood-node-token\nedge_url: ws://127.0.0.1:{edge_node_port}\n"
        f"runtime: {{concurrency: {clients}}}\nproviders:\n"
        f"  - {{id: gpu0, adapter: openai, capacity: {clients}, base_url: 'http://127.0.0.1:{backend_port}/v1'"
        f"{limits}}}\n"
    )


async def serve_answer(stream: trio.SocketStream, size: int) -> None:
    """Answer each request on ``stream`` with a chat completion whose content is ``size`` bytes of ``x``."""
    prefix = b'{"id":"c","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,"message":'
    prefix += b'{"role":"assistant","content":"'
    suffix = b'"},"finish_reason":"stop"}]}'
    pieces = size // len(PIECE)
    length = len(prefix) + pieces * len(PIECE) + len(suffix)
    conn = h11.Connection(h11.SERVER)
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                if not data:
                    return
                conn.receive_data(data)
                continue
            if isinstance(event, h11.EndOfMessage):
                head = h11.Response(
                    status_code=200, headers=[("content-type", "application/json"), ("content-length", str(length))]
                )
                await stream.send_all(conn.send(head))
                await stream.send_all(conn.send(h11.Data(data=prefix)))
                for _ in range(pieces):
                    await stream.send_all(conn.send(h11.Data(data=PIECE)))
                await stream.send_all(conn.send(h11.Data(data=suffix)))
                conn.send(h11.EndOfMessage())
                conn.start_next_cycle()
            elif event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
                return
    except (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError):
        return  # the Node closed the connection (past its bound)
    finally:
        await stream.aclose()


def _text(path: pathlib.Path) -> str:
    return path.read_text(errors="replace")


async def start(argv: list[str], log: pathlib.Path, ready: re.Pattern[str]) -> tuple[trio.Process, re.Match[str]]:
    """Start ``python argv`` with its stderr in ``log``; wait for ``ready`` in it."""
    with log.open("wb") as sink:
        process = await trio.lowlevel.open_process([sys.executable, *argv], stderr=sink)
    with trio.fail_after(30):
        while not (match := ready.search(_text(log))):
            if process.poll() is not None:
                raise RuntimeError(f"{argv} exited:\n{_text(log)}")
            await trio.sleep(0.05)
    return process, match


async def flood(port: int, until: float, counts: dict[int, int]) -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}).encode()
    request = HttpConnection.build("POST", "/v1/chat/completions", body)
    connection = HttpConnection("127.0.0.1", port)
    while time.monotonic() < until:
        status, _ = await connection.request(request, on_body=lambda data: None)
        counts[status] = counts.get(status, 0) + 1


async def phase(
    name: str, args: argparse.Namespace, tmp: pathlib.Path, answer_bytes: int | None, edge_limits: dict[str, int]
) -> str:
    clients = 0 if name == "idle" else args.clients
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, lambda s: serve_answer(s, args.answer_mib * MiB), 0)
        backend_port = listeners[0].socket.getsockname()[1]
        (tmp / "edge.yaml").write_text(edge_yaml(max(args.clients, 1), edge_limits))
        edge, ready = await start(["-m", "iop_edge", "--config", str(tmp / "edge.yaml")], tmp / "edge.log", EDGE_READY)
        port, node_port = int(ready[1]), int(ready[2])
        (tmp / "node.yaml").write_text(node_yaml(node_port, backend_port, max(args.clients, 1), answer_bytes))
        node, _ = await start(["-m", "iop_node", "--config", str(tmp / "node.yaml")], tmp / "node.log", NODE_READY)
        try:
            pids = {"edge": edge.pid, "node": node.pid}
            before = {k: rss_mb(pid) for k, pid in pids.items()}
            latencies: list[float] = []
            counts: dict[int, int] = {}
            peaks: dict[str, float] = {}
            until = time.monotonic() + args.seconds
            async with trio.open_nursery() as load:
                for _ in range(clients):
                    load.start_soon(flood, port, until, counts)
                load.start_soon(probe, port, args.interval / 1000, until, latencies)
                load.start_soon(sample, pids, until, peaks)
        finally:
            for process in (node, edge):
                process.terminate()
                await process.wait()
        nursery.cancel_scope.cancel()
    ms = sorted(1000 * x for x in latencies)
    answers = ", ".join(f"{status}: {n}" for status, n in sorted(counts.items())) or "-"
    return (
        f"| {name} | {len(ms)} | {percentile(ms, 0.5):.1f} | {percentile(ms, 0.99):.1f} | {ms[-1]:.1f} "
        f"| {answers} | {before['edge']:.0f} -> {peaks['edge']:.0f} | {before['node']:.0f} -> {peaks['node']:.0f} |"
    )


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as folder:
        tmp = pathlib.Path(folder)
        rows = [
            await phase("idle", args, tmp, None, {}),
            await phase("bounded", args, tmp, None, {}),
            await phase("budget", args, tmp, 128 * MiB, {"max_answer_bytes": 128 * MiB}),
            await phase("relayed", args, tmp, 128 * MiB, RELAYED),
        ]
    print(
        f"{args.clients} clients, {args.answer_mib} MiB non-stream answers, {args.seconds:.0f} s per phase, "
        f"probe every {args.interval:.0f} ms"
    )
    print(
        "| phase | probes | /healthz p50 ms | p99 ms | max ms | answers (status: count) | Edge RSS MiB | Node RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.answer_flood", description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--answer-mib", type=int, default=96)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=10.0, help="ms between probes")
    trio.run(main_async, parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
