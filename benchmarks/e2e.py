"""End-to-end benchmark: real processes on loopback, one closed-loop load generator.

``python -m benchmarks e2e [--runs N] [--peers]`` (``make bench`` / ``make bench-peers``)
starts ``iop-mock-backend`` with zero latency, an Edge and a Node (one provider whose
capacity, 256, never queues), and the load generator (:mod:`benchmarks.loadgen`) as
four separate processes, then measures, each figure the median of ``--runs`` runs
(at least 3) with the paths interleaved inside every run:

1. ``direct``: the load generator straight to the mock backend;
2. ``edge``: through Edge + Node (Edge admission lease, websocket to the Node,
   the Node's ``openai`` adapter to the mock backend);
3. ``litellm`` (``--peers`` only): through a LiteLLM proxy in front of the same
   mock backend (:mod:`benchmarks.peers`).

At concurrency 1, 8 and 64: requests/s, p50 and p99 latency of a small non-stream
chat completion (16 tokens), and the p50 added over ``direct``. Streaming: SSE
chunks/s of a 500-token stream at concurrency 1 and 8. Then graceful close: a
second node (``close-node``, one capacity-1 ``mock`` provider that never answers)
holds one running and one queued request; the time from SIGTERM of that node's
process to ``/status`` showing it offline, and to the queued request's 503
(median of 20).

Writes ``benchmarks/results/e2e.json`` (through ``python -m benchmarks``), the plot
``benchmarks/results/e2e.png`` (copied to ``docs/benchmarks-e2e.png``) and the
generated block of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import trio

from . import peers, plot
from .harness import (
    DURATION,
    RESULTS,
    ROOT,
    WARMUP,
    BenchmarkFailed,
    Daemon,
    HttpConnection,
    LoadGenerator,
    get_json,
    node_connected,
    python_command,
    replace_doc_block,
    run_suite,
    start_relay,
    wait_until,
)

DOC_PLOT = ROOT / "docs" / "benchmarks-e2e.png"

CONCURRENCY = (1, 8, 64)
STREAM_CONCURRENCY = (1, 8)
STREAM_TOKENS = 500
CLOSE_SAMPLES = 20

CHAT = {"model": "mock", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}
STREAM = {**CHAT, "max_tokens": STREAM_TOKENS, "stream": True}
CHAT_PATH = "/v1/chat/completions"

EDGE_YAML = """\
listen: 127.0.0.1:0
node_listen: 127.0.0.1:0
heartbeat_timeout_ms: 15000
provider_pool: {max_queue: 1024, queue_timeout_ms: 60000}
nodes:
  - id: bench-node
    token: bench-token
    providers:
      - {id: mock, capacity: 256}
  - id: close-node
    token: close-token
    providers:
      - {id: slow, capacity: 1}
models:
  - id: mock
    candidates: [{node: bench-node, provider: mock, upstream_model: mock}]
  - id: close-probe
    candidates: [{node: close-node, provider: slow, upstream_model: slow}]
"""

BENCH_NODE_YAML = """\
node_id: bench-node
edge_url: ws://127.0.0.1:{node_port}
token: bench-token
runtime: {{concurrency: 256}}
providers:
  - {{id: mock, adapter: openai, base_url: "http://127.0.0.1:{backend_port}/v1", capacity: 256}}
"""

CLOSE_NODE_YAML = """\
node_id: close-node
edge_url: ws://127.0.0.1:{node_port}
token: close-token
providers:
  - {{id: slow, adapter: mock, latency_ms: 600000, capacity: 1}}
"""


# --------------------------------------------------------------- measurements


def _median_of(samples: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("rps", "p50_ms", "p99_ms", "chunks_per_s", "events_per_stream")
    out: dict[str, Any] = {k: statistics.median(s[k] for s in samples) for k in keys}
    out["cpu_ms_per_request"] = {
        name: statistics.median(s["cpu_ms_per_request"][name] for s in samples)
        for name in samples[0]["cpu_ms_per_request"]
    }
    out["requests"] = sum(s["requests"] for s in samples)
    out["errors"] = sum(s["errors"] for s in samples)
    out["samples"] = [{k: round(s[k], 3) for k in keys} for s in samples]
    return out


async def _measure_with_cpu(loadgen: LoadGenerator, processes: dict[str, Daemon], **command: Any) -> dict[str, Any]:
    """One measurement plus each process's CPU time per answered request (whole run, warm-up too)."""
    before = {name: d.cpu_seconds() for name, d in processes.items()}
    before["loadgen"] = loadgen.cpu_seconds()
    result = await loadgen.measure(**command)
    after = {name: d.cpu_seconds() for name, d in processes.items()}
    after["loadgen"] = loadgen.cpu_seconds()
    # The window holds duration / (warmup + duration) of the answers; scale to the whole run.
    answered = max(1.0, result["requests"] * (DURATION + WARMUP) / DURATION)
    result["cpu_ms_per_request"] = {k: (after[k] - before[k]) * 1000 / answered for k in after}
    return result


async def _throughput(
    loadgen: LoadGenerator, ports: dict[str, int], processes: dict[str, list[Daemon]], runs: int
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    raw: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for run in range(runs):
        print(f"   run {run + 1}/{runs} ...", file=sys.stderr, flush=True)
        for path, port in ports.items():
            serving = {d.name: d for d in processes[path]}
            for c in CONCURRENCY:
                result = await _measure_with_cpu(loadgen, serving, port=port, path=CHAT_PATH, body=CHAT, concurrency=c)
                raw.setdefault(("chat", path, c), []).append(result)
            for c in STREAM_CONCURRENCY:
                result = await _measure_with_cpu(
                    loadgen, serving, port=port, path=CHAT_PATH, body=STREAM, concurrency=c, stream=True
                )
                raw.setdefault(("stream", path, c), []).append(result)
    chat: dict[str, dict[str, Any]] = {}
    stream: dict[str, dict[str, Any]] = {}
    for (kind, path, c), samples in raw.items():
        (chat if kind == "chat" else stream).setdefault(path, {})[str(c)] = _median_of(samples)
    for by_c in chat.values():
        for c, figures in by_c.items():
            figures["added_p50_ms"] = figures["p50_ms"] - chat["direct"][c]["p50_ms"]
    return chat, stream


async def _graceful_close(edge: Daemon, http_port: int, node_port: int, workdir: pathlib.Path) -> dict[str, Any]:
    """SIGTERM ``close-node`` while it holds a running and a queued request, ``CLOSE_SAMPLES`` times."""
    config = workdir / "close-node.yaml"
    config.write_text(CLOSE_NODE_YAML.format(node_port=node_port))
    probe = HttpConnection.build(
        "POST",
        CHAT_PATH,
        json.dumps({"model": "close-probe", "messages": [{"role": "user", "content": "x"}]}).encode(),
    )
    poller = HttpConnection("127.0.0.1", http_port)
    offline_ms: list[float] = []
    answered_ms: list[float] = []
    statuses: list[tuple[int, int]] = []

    async def status() -> dict[str, Any]:
        return await get_json(poller, "/status")  # type: ignore[no-any-return]

    def provider(snapshot: dict[str, Any]) -> dict[str, Any]:
        return next(p for p in snapshot["providers"] if (p["node_id"], p["provider_id"]) == ("close-node", "slow"))

    for i in range(CLOSE_SAMPLES):
        node = Daemon(
            f"close-node-{i}",
            python_command("-m", "iop_node", "--config", str(config), "--log-level", "WARNING"),
            workdir,
        )
        try:
            await wait_until("close-node to register", lambda: _connected(status, "close-node"), node, edge)
            answers: dict[str, tuple[int, float]] = {}

            async def call(name: str) -> None:
                connection = HttpConnection("127.0.0.1", http_port)
                try:
                    code, _ = await connection.request(probe)
                    answers[name] = (code, time.perf_counter())  # noqa: B023 (awaited within this iteration)
                finally:
                    await connection.aclose()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, "running")
                await wait_until("the running request", lambda: _in_flight(status, provider), node, edge)
                nursery.start_soon(call, "queued")
                await wait_until("the queued request", lambda: _queued(status), node, edge)
                t0 = time.perf_counter()
                node.signal(signal.SIGTERM)
                while node_connected(await status(), "close-node"):
                    pass
                offline_ms.append((time.perf_counter() - t0) * 1000)
            answered_ms.append((answers["queued"][1] - t0) * 1000)
            statuses.append((answers["running"][0], answers["queued"][0]))
        finally:
            node.stop()
    await poller.aclose()
    return {
        "samples": CLOSE_SAMPLES,
        "offline_ms": statistics.median(offline_ms),
        "queued_503_ms": statistics.median(answered_ms),
        "offline_ms_max": max(offline_ms),
        "queued_503_ms_max": max(answered_ms),
        "statuses_running_queued": sorted({f"{a}/{b}" for a, b in statuses}),
        "target": "< 100 ms",
    }


async def _connected(status: Callable[[], Any], node_id: str) -> bool:
    return node_connected(await status(), node_id)


async def _in_flight(status: Callable[[], Any], provider: Callable[[dict[str, Any]], dict[str, Any]]) -> bool:
    return bool(provider(await status())["in_flight"] == 1)


async def _queued(status: Callable[[], Any]) -> bool:
    return bool((await status())["queue_depth"] == 1)


async def _main(runs: int, with_peers: bool, workdir: pathlib.Path) -> dict[str, Any]:
    daemons: list[Daemon] = []
    loadgen: LoadGenerator | None = None
    try:
        relay = await start_relay(
            workdir, daemons, mock_args=["--latency-ms", "0"], edge_yaml=EDGE_YAML, node_yaml=BENCH_NODE_YAML
        )
        backend, edge, node = relay.backend, relay.edge, relay.node
        backend_port, http_port, node_port = relay.backend_port, relay.http_port, relay.node_port
        ports = {"direct": backend_port, "edge": http_port}
        litellm_note = "not measured (run `make bench-peers`)"
        if with_peers:
            try:
                litellm_port = await peers.start_litellm(backend_port, workdir, daemons)
                ports["litellm"] = litellm_port
                litellm_note = f"LiteLLM {peers.version()} (proxy, 1 worker)"
            except (peers.PeerUnavailable, BenchmarkFailed) as exc:
                litellm_note = f"LiteLLM unavailable here: {exc}".splitlines()[0]
                print(f"!! {litellm_note}", file=sys.stderr)
        loadgen = LoadGenerator()
        print(f"   paths: {', '.join(f'{k} :{v}' for k, v in ports.items())}", file=sys.stderr, flush=True)
        processes = {
            "direct": [backend],
            "edge": [edge, node, backend],
            "litellm": [d for d in daemons if d.name == "litellm"] + [backend],
        }
        chat, stream = await _throughput(loadgen, ports, processes, runs)
        print("   graceful close ...", file=sys.stderr, flush=True)
        close = await _graceful_close(edge, http_port, node_port, workdir)
        return {
            "runs": runs,
            "duration_s": DURATION,
            "warmup_s": WARMUP,
            "cpus": os.cpu_count(),
            "litellm": litellm_note,
            "chat": chat,
            "stream": stream,
            "stream_tokens": STREAM_TOKENS,
            "graceful_close": close,
        }
    finally:
        if loadgen is not None:
            loadgen.stop()
        for daemon in reversed(daemons):
            daemon.stop()


def run(runs: int = 5, with_peers: bool = False) -> dict[str, Any]:
    """Start the processes, measure every path, write the plot and the doc block."""
    runs = max(3, runs)
    result = run_suite("iop-e2e-", _main, runs, with_peers, with_peers=with_peers)
    png = RESULTS / "e2e.png"
    plot.plot(result, png)
    shutil.copyfile(png, DOC_PLOT)
    _update_doc(table(result), result)
    return result


# ---------------------------------------------------------------------- report


def table(result: dict[str, Any]) -> str:
    """Format :func:`run`'s result as Markdown tables."""
    chat, stream, close = result["chat"], result["stream"], result["graceful_close"]
    lines = [
        "| path | concurrency | requests/s | p50 ms | p99 ms | added p50 ms |",
        "|---|---|---|---|---|---|",
    ]
    for path, by_c in chat.items():
        for c in map(str, CONCURRENCY):
            f = by_c[c]
            added = "—" if path == "direct" else f"{f['added_p50_ms']:+.2f}"
            lines.append(f"| {path} | {c} | {f['rps']:,.0f} | {f['p50_ms']:.2f} | {f['p99_ms']:.2f} | {added} |")
    lines += [
        "",
        f"| path | {STREAM_TOKENS}-token stream | chunks/s | streams/s | p50 ms per stream | SSE events per stream |",
        "|---|---|---|---|---|---|",
    ]
    for path, by_c in stream.items():
        for c in map(str, STREAM_CONCURRENCY):
            f = by_c[c]
            lines.append(
                f"| {path} | concurrency {c} | {f['chunks_per_s']:,.0f} | {f['rps']:,.1f} | {f['p50_ms']:.1f} "
                f"| {f['events_per_stream']:.0f} |"
            )
    failed = [
        f"{kind} {path} concurrency {c}: {f['errors']}"
        for kind, table_ in (("non-stream", chat), ("stream", stream))
        for path, by_c in table_.items()
        for c, f in by_c.items()
        if f["errors"]
    ]
    if failed:
        lines += [
            "",
            "Answers that were not 200 (or streams without `[DONE]`), not counted above: " + "; ".join(failed) + ".",
        ]
    lines += [
        "",
        "CPU per answered request (ms, user + system, from /proc), non-stream, concurrency 64:",
        "",
        "| path | " + " | ".join(_CPU_COLUMNS) + " |",
        "|---|" + "---|" * len(_CPU_COLUMNS),
    ]
    for path, by_c in chat.items():
        cpu = by_c["64"]["cpu_ms_per_request"]
        cells = [f"{cpu[name]:.2f}" if name in cpu else "—" for name in _CPU_COLUMNS]
        lines.append(f"| {path} | " + " | ".join(cells) + " |")
    edge1 = chat["edge"]["1"]["added_p50_ms"]
    lines += [
        "",
        "| target | measured | met |",
        "|---|---|---|",
        f"| added p50 through Edge+Node at concurrency 1 ≤ 1.0 ms | {edge1:.2f} ms | {'yes' if edge1 <= 1.0 else 'no'} |",
    ]
    share = chat["edge"]["64"]["rps"] / chat["direct"]["64"]["rps"]
    lines.append(
        f"| Edge+Node requests/s at concurrency 64 ≥ 60 % of direct | {share:.0%} | {'yes' if share >= 0.6 else 'no'} |"
    )
    if "litellm" in chat:
        ratio = chat["edge"]["64"]["rps"] / chat["litellm"]["64"]["rps"]
        lines.append(
            f"| throughput at concurrency 64 ≥ 5x LiteLLM's | {ratio:.2f}x | {'yes' if ratio >= 5 else 'no'} |"
        )
    else:
        lines.append(f"| throughput at concurrency 64 ≥ 5x LiteLLM's | {result['litellm']} | — |")
    lines.append(
        f"| graceful close → offline in /status < 100 ms (median of {close['samples']}) "
        f"| {close['offline_ms']:.1f} ms (max {close['offline_ms_max']:.1f}) | {'yes' if close['offline_ms'] < 100 else 'no'} |"
    )
    lines.append(
        f"| graceful close → queued request answered 503 < 100 ms (median of {close['samples']}) "
        f"| {close['queued_503_ms']:.1f} ms (max {close['queued_503_ms_max']:.1f}) | {'yes' if close['queued_503_ms'] < 100 else 'no'} |"
    )
    lines.append(
        "\nAnswers during the graceful close (running request / queued request): "
        + ", ".join(close["statuses_running_queued"])
        + "."
    )
    return "\n".join(lines)


_CPU_COLUMNS = ("edge", "bench-node", "litellm", "mock-backend", "loadgen")

_BEGIN = "<!-- e2e-results:begin (written by `python -m benchmarks e2e`) -->"
_END = "<!-- e2e-results:end -->"


def _update_doc(markdown: str, result: dict[str, Any]) -> None:
    """Replace the generated block of ``docs/benchmarks.md`` (the prose around it stays)."""
    block = (
        f"{_BEGIN}\n"
        f"Produced by `{result['command']}` ({result['when']}, {result['cpus']} CPUs, load average "
        f"{result.get('load_average', 'unknown')} at the end, median of {result['runs']} runs of "
        f"{result['duration_s']:g} s after {result['warmup_s']:g} s warm-up; "
        f"LiteLLM: {result['litellm']}).\n\n{markdown}\n\n![throughput and p50 vs concurrency](benchmarks-e2e.png)\n{_END}"
    )
    replace_doc_block(_BEGIN, _END, block)
