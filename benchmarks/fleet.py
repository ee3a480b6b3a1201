"""Fleet benchmark: many concurrent streams at a realistic token rate, real processes on loopback.

``python -m benchmarks fleet [--quick] [--peers]`` (part of ``make bench``; ``make
bench-peers`` adds LiteLLM) starts ``iop-mock-backend --tokens-per-second 20``, an Edge
and a Node (one ``openai`` provider of capacity 2048, so nothing queues) and the load
generator (:func:`benchmarks.loadgen.fleet`) as separate processes. For K = 64, 256,
512 and 1024 concurrent streams (``--quick``: 64 and 512), and for every path in turn
(``direct`` to the mock, ``edge`` through Edge + Node, ``litellm`` with ``--peers``),
K workers each hold ONE keep-alive socket and run 100-token streams back to back; the
workers start spread over ``RAMP`` seconds; tokens/s is counted in the ``DURATION``
seconds after that, the per-stream figures over every stream that completed. Streams
still running 10 s after the window are cut (and counted as cut).

Per path and K: tokens/s received in the window against the ideal K x 20; stream
stretch ((last event - first event) / the ideal 99 x 50 ms) p50/p99; time to first
token p50/p99; the p99 of the gap between consecutive events of a stream (as read by
the client: events that arrive in one read have a gap of 0); and the CPU time of every
process (the load generator too) per 1,000 tokens received, over the whole measurement.

Writes ``benchmarks/results/fleet.json`` (through ``python -m benchmarks``), the plot
``docs/benchmarks-fleet.png`` and the generated block of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import math
import os
import pathlib
import shutil
import sys
import time
from typing import Any

from . import peers
from .harness import (
    RESULTS,
    ROOT,
    BenchmarkFailed,
    Daemon,
    LoadGenerator,
    percentile,
    replace_doc_block,
    run_suite,
    runqueue_seconds,
    start_relay,
)

DOC_PLOT = ROOT / "docs" / "benchmarks-fleet.png"

STREAMS = (64, 256, 512, 1024)
QUICK_STREAMS = (64, 512)
RATE = 20.0
TOKENS = 100
RAMP = 1.0
DURATION = 8.0
QUICK_DURATION = 6.0
CAPACITY = 2048
CHAT_PATH = "/v1/chat/completions"
STREAM = {"model": "mock", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": TOKENS, "stream": True}

EDGE_YAML = f"""\
listen: 127.0.0.1:0
node_listen: 127.0.0.1:0
heartbeat_timeout_ms: 15000
provider_pool: {{max_queue: 4096, queue_timeout_ms: 60000}}
nodes:
  - id: bench-node
    token: bench-token
    providers:
      - {{id: mock, capacity: {CAPACITY}}}
models:
  - id: mock
    candidates: [{{node: bench-node, provider: mock, upstream_model: mock}}]
"""

NODE_YAML = f"""\
node_id: bench-node
edge_url: ws://127.0.0.1:{{node_port}}
token: bench-token
runtime: {{{{concurrency: {CAPACITY}}}}}
providers:
  - {{{{id: mock, adapter: openai, base_url: "http://127.0.0.1:{{backend_port}}/v1", capacity: {CAPACITY}}}}}
"""


def _figures(raw: dict[str, Any], k: int, cpu: dict[str, float], waited: float, wall: float) -> dict[str, Any]:
    ideal_span = (TOKENS - 1) / RATE
    tokens = max(1, raw["tokens"])
    return {
        "wall_s": wall,
        "cores_used": sum(cpu.values()) / wall,
        "cpu_wait": waited / wall,
        "load_1m": os.getloadavg()[0],
        "streams": k,
        "tokens_per_s": raw["window_tokens"] / raw["window"],
        "ideal_tokens_per_s": k * RATE,
        "stretch_p50": percentile(sorted(raw["span"]), 0.5) / ideal_span,
        "stretch_p99": percentile(sorted(raw["span"]), 0.99) / ideal_span,
        "ttft_p50_ms": percentile(sorted(raw["ttft"]), 0.5) * 1000,
        "ttft_p99_ms": percentile(sorted(raw["ttft"]), 0.99) * 1000,
        "gap_p99_ms": percentile(sorted(raw["gaps"]), 0.99) * 1000,
        "streams_done": raw["streams_done"],
        "streams_cut": raw["streams_cut"],
        "errors": raw["errors"],
        "error_statuses": raw["error_statuses"],
        "tokens": raw["tokens"],
        "cpu_ms_per_1k_tokens": {name: seconds * 1e6 / tokens for name, seconds in cpu.items()},
    }


async def _measure(
    generator: LoadGenerator, port: int, processes: list[Daemon], k: int, duration: float
) -> dict[str, Any]:
    pids = [d.proc.pid for d in processes] + [generator.pid]
    before = {d.name: d.cpu_seconds() for d in processes}
    before["loadgen"] = generator.cpu_seconds()
    waited = -sum(runqueue_seconds(pid) for pid in pids)
    started = time.monotonic()
    raw = await generator.fleet(port=port, path=CHAT_PATH, body=STREAM, streams=k, ramp=RAMP, duration=duration)
    wall = time.monotonic() - started
    waited += sum(runqueue_seconds(pid) for pid in pids)
    after = {d.name: d.cpu_seconds() for d in processes}
    after["loadgen"] = generator.cpu_seconds()
    return _figures(raw, k, {name: after[name] - before[name] for name in after}, waited, wall)


async def _start(workdir: pathlib.Path, daemons: list[Daemon]) -> tuple[dict[str, int], dict[str, list[Daemon]]]:
    relay = await start_relay(
        workdir, daemons, mock_args=["--tokens-per-second", str(RATE)], edge_yaml=EDGE_YAML, node_yaml=NODE_YAML
    )
    ports = {"direct": relay.backend_port, "edge": relay.http_port}
    processes = {"direct": [relay.backend], "edge": [relay.edge, relay.node, relay.backend]}
    return ports, processes


async def _main(quick: bool, with_peers: bool, workdir: pathlib.Path) -> dict[str, Any]:
    daemons: list[Daemon] = []
    generator: LoadGenerator | None = None
    try:
        ports, processes = await _start(workdir, daemons)
        litellm_note = "not measured (run `make bench-peers`)"
        if with_peers:
            try:
                ports["litellm"] = await peers.start_litellm(ports["direct"], workdir, daemons)
                processes["litellm"] = [d for d in daemons if d.name in ("litellm", "mock-backend")]
                litellm_note = f"LiteLLM {peers.version()} (proxy, 1 worker)"
            except (peers.PeerUnavailable, BenchmarkFailed) as exc:
                litellm_note = f"LiteLLM unavailable here: {exc}".splitlines()[0]
                print(f"!! {litellm_note}", file=sys.stderr)
        generator = LoadGenerator()
        duration = QUICK_DURATION if quick else DURATION
        fleet: dict[str, dict[str, Any]] = {}
        for k in QUICK_STREAMS if quick else STREAMS:
            for path, port in ports.items():
                print(f"   {k} streams via {path} ...", file=sys.stderr, flush=True)
                fleet.setdefault(path, {})[str(k)] = await _measure(generator, port, processes[path], k, duration)
        return {
            "cpus": os.cpu_count(),
            "quick": quick,
            "rate": RATE,
            "tokens": TOKENS,
            "ramp_s": RAMP,
            "duration_s": duration,
            "litellm": litellm_note,
            "fleet": fleet,
        }
    finally:
        if generator is not None:
            generator.stop()
        for daemon in reversed(daemons):
            daemon.stop()


def run(quick: bool = False, with_peers: bool = False) -> dict[str, Any]:
    """Start the processes, measure every path at every K, write the plot and the doc block."""
    result = run_suite("iop-fleet-", _main, quick, with_peers, with_peers=with_peers)
    png = RESULTS / "fleet.png"
    plot(result, png)
    if not quick:
        shutil.copyfile(png, DOC_PLOT)
        _update_doc(table(result), result)
    return result


# ---------------------------------------------------------------------- report

_CPU_COLUMNS = ("edge", "bench-node", "litellm", "mock-backend", "loadgen")


def table(result: dict[str, Any]) -> str:
    """Format :func:`run`'s result as Markdown tables."""
    fleet = result["fleet"]
    lines = [
        "| streams | path | tokens/s | of ideal | of direct | stretch p50 / p99 | TTFT p50 / p99 ms | gap p99 ms "
        "| streams done / cut / failed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k in sorted({int(k) for by_k in fleet.values() for k in by_k}):
        direct = fleet["direct"][str(k)]["tokens_per_s"] or math.nan
        for path, by_k in fleet.items():
            f = by_k[str(k)]
            lines.append(
                f"| {k} | {path} | {f['tokens_per_s']:,.0f} | {f['tokens_per_s'] / f['ideal_tokens_per_s']:.0%} "
                f"| {f['tokens_per_s'] / direct:.0%} | {f['stretch_p50']:.2f} / {f['stretch_p99']:.2f} "
                f"| {f['ttft_p50_ms']:.0f} / {f['ttft_p99_ms']:.0f} | {f['gap_p99_ms']:.0f} "
                f"| {f['streams_done']} / {f['streams_cut']} / {f['errors']} |"
            )
    lines += [
        "",
        "CPU per 1,000 tokens received (ms, user + system from /proc, whole measurement); all: every "
        "process of the path, the load generator included; cores: their CPU time over the measurement's "
        "wall time (on a shared box, what the path got), with the box's 1-minute load average at its end; "
        "waiting: the time their main threads were runnable but waited for a CPU (/proc schedstat), over "
        "the wall time:",
        "",
        "| streams | path | " + " | ".join(_CPU_COLUMNS) + " | all | cores (load) | waiting |",
        "|---|---|" + "---|" * (len(_CPU_COLUMNS) + 3),
    ]
    for k in sorted({int(k) for by_k in fleet.values() for k in by_k}):
        for path, by_k in fleet.items():
            f = by_k[str(k)]
            cpu = f["cpu_ms_per_1k_tokens"]
            cells = [f"{cpu[name]:.1f}" if name in cpu else "—" for name in _CPU_COLUMNS]
            cells += [
                f"{sum(cpu.values()):.1f}",
                f"{f.get('cores_used', math.nan):.2f} ({f.get('load_1m', math.nan):.1f})",
                f"{f.get('cpu_wait', math.nan):.2f}",
            ]
            lines.append(f"| {k} | {path} | " + " | ".join(cells) + " |")
    failed = [
        f"{path} at {k}: {f['errors']} ({', '.join(f'{n}x {s!r}' for s, n in f['error_statuses'].items())[:300]})"
        for path, by_k in fleet.items()
        for k, f in by_k.items()
        if f["errors"]
    ]
    if failed:
        lines += ["", "Failed streams (the worker stops): " + "; ".join(failed) + "."]
    if "512" in fleet.get("edge", {}):
        edge, direct = fleet["edge"]["512"], fleet["direct"]["512"]
        ratio = edge["tokens_per_s"] / (direct["tokens_per_s"] or math.nan)
        cpu = edge["cpu_ms_per_1k_tokens"]
        lines += [
            "",
            "| target (512 streams) | measured | met |",
            "|---|---|---|",
            f"| Edge+Node tokens/s ≥ 85 % of direct | {ratio:.0%} | {'yes' if ratio >= 0.85 else 'no'} |",
            f"| Edge CPU per 1,000 tokens ≤ 30 ms | {cpu['edge']:.1f} ms | {'yes' if cpu['edge'] <= 30 else 'no'} |",
            f"| Node CPU per 1,000 tokens ≤ 30 ms | {cpu['bench-node']:.1f} ms "
            f"| {'yes' if cpu['bench-node'] <= 30 else 'no'} |",
        ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
    """Tokens/s against K per path, with the ideal K x R."""
    from .plot import plt

    fleet = result["fleet"]
    fig, axis = plt.subplots(figsize=(6, 4), dpi=110)
    ks = sorted({int(k) for by_k in fleet.values() for k in by_k})
    axis.plot(ks, [k * result["rate"] for k in ks], linestyle="--", color="grey", label="ideal (K x R)")
    for name, by_k in fleet.items():
        axis.plot(ks, [by_k[str(k)]["tokens_per_s"] for k in ks], marker="o", label=name)
    axis.set_xscale("log", base=2)
    axis.set_xticks(ks, [str(k) for k in ks])
    axis.set_xlabel("concurrent streams (K)")
    axis.set_ylabel("tokens/s received")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    axis.set_title(f"{result['tokens']}-token streams at {result['rate']:g} tokens/s, {result['cpus']} CPUs shared")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


_BEGIN = "<!-- fleet-results:begin (written by `python -m benchmarks fleet`) -->"
_END = "<!-- fleet-results:end -->"


def _update_doc(markdown: str, result: dict[str, Any]) -> None:
    """Replace the generated block of ``docs/benchmarks.md`` (the prose around it stays)."""
    block = (
        f"{_BEGIN}\nProduced by `{result['command']}` ({result['when']}, {result['cpus']} CPUs, load average "
        f"{result.get('load_average', 'unknown')} at the end, one run: "
        f"{result['ramp_s']:g} s ramp, {result['duration_s']:g} s window; LiteLLM: {result['litellm']}).\n\n"
        f"{markdown}\n\n![tokens/s vs concurrent streams](benchmarks-fleet.png)\n{_END}"
    )
    replace_doc_block(_BEGIN, _END, block)
