"""Health from progress [health-probe], by hand: ``python -m benchmarks.health [--providers 1000] [--seconds 20]``.

1. **Probe cost.** The Node's :class:`~iop_node.health.HealthWatcher` probing
   ``--providers`` providers (one mock backend process behind them all) every
   second (``interval_ms`` = ``no_traffic_interval_ms`` = 1000, jitter 10 %), in this
   process (under an ``iop-node`` process's collector policy), against a reference
   measured in the same run: one ``httpx.AsyncClient``
   per provider sending the same ``GET`` every second. This process's CPU over
   ``--seconds`` (after a warm-up in which every connection opens), per probe and
   as a share of one core; medians of ``--runs`` alternated runs.

2. **The Edge's cost of a report** (``--part edge``): ``--providers`` providers of one
   node, every one reported once a second -- the worst case, a fleet that flaps every second;
   a steady fleet sends nothing -- each report a ``provider_health`` frame decoded
   (:func:`iop_wire.decode`) and applied (``Admission.report_health``), alternately ``not_ready``
   and ``ready``; against a reference in the same run: the same number of ``heartbeat`` frames
   decoded. CPU per report and as a share of one core at that rate.
3. **Time to ejection** (``--part ejection [--peers]``; ``python -m benchmarks ejection``). Real
   processes on loopback: mock backends A and B, an Edge with one model on ``gpu0`` (A) and
   ``gpu1`` (B), a Node with the default health settings (probe every second, ``stall_ms`` 6000),
   ``--clients`` clients streaming short completions without pause. ``--trials`` times each:
   *hung engine* -- A's completions hang while its ``/health`` answers 200; *dead process* -- A
   killed (SIGKILL). The time from the fault to ``/status`` showing ``gpu0`` ejected (polled every
   20 ms); the fault is held ``HOLD_S`` more, then A is healed (or restarted), ``gpu0`` is back
   online and ``SETTLE_S`` pass before the next trial. Of the client requests answered meanwhile: failures, those slower
   than ``SLOW_S`` (sent to A first), and when the last failed or slow one was sent. ``--peers``:
   the same with a LiteLLM proxy in front of A and B (:func:`benchmarks.peers.ejection_config`), "ejected"
   being its background health check listing ``gpu0`` unhealthy on ``GET /health``.

Prints a table and writes ``benchmarks/results/health-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import signal
import statistics
import time
from collections import defaultdict
from typing import Any

import httpx
import trio

from benchmarks import peers
from benchmarks.harness import (
    RESULTS,
    BenchmarkFailed,
    Daemon,
    percentile,
    python_command,
    replace_doc_block,
    run_suite,
    start_edge_and_node,
)
from iop_admission import Admission, ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy
from iop_config import tune_collector
from iop_edge.nodes.health_reports import provider_report
from iop_node.__main__ import YOUNG_THRESHOLD
from iop_node.config import HealthConfig, NodeConfig, ProviderConfig
from iop_node.health import HealthWatcher, Progress
from iop_wire import EngineView, Heartbeat, ProviderHealth, decode, encode

WARM_UP_S = 3.0


def _config(port: int, providers: int, probe: str) -> NodeConfig:
    health = HealthConfig(probe=probe, interval_ms=1000, no_traffic_interval_ms=1000, timeout_ms=2000)
    return NodeConfig(
        node_id="bench-node",
        edge_url="ws://127.0.0.1:1",
        token="unused",
        providers=tuple(
            ProviderConfig(id=f"p{i}", adapter="openai", base_url=f"http://127.0.0.1:{port}/v1", health=health)
            for i in range(providers)
        ),
    )


async def _watcher_window(port: int, providers: int, probe: str, seconds: float) -> tuple[float, int]:
    """CPU seconds of this process and probes answered in ``seconds`` of the watcher probing."""
    watcher = HealthWatcher.from_config(_config(port, providers, probe), defaultdict(Progress), rng=random.Random(1))
    watcher.connected(+1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watcher.serve)
        await trio.sleep(WARM_UP_S)
        cpu, before = time.process_time(), watcher.probes
        await trio.sleep(seconds)
        cpu, probes = time.process_time() - cpu, watcher.probes - before
        nursery.cancel_scope.cancel()
    await watcher.aclose()
    if any(report.state != "ready" for report in watcher.reports.values()):
        raise BenchmarkFailed("a provider was not ready: the backend did not keep up")
    return cpu, probes


async def _httpx_window(port: int, providers: int, path: str, seconds: float) -> tuple[float, int]:
    """The reference: one httpx client per provider, the same GET every second (10 % jitter)."""
    answered = 0
    rng = random.Random(1)
    clients = [httpx.AsyncClient(timeout=2.0, limits=httpx.Limits(max_connections=1)) for _ in range(providers)]
    url = f"http://127.0.0.1:{port}{path}"

    async def probe(client: httpx.AsyncClient) -> None:
        nonlocal answered
        await trio.sleep(rng.random())
        while True:
            try:
                answered += (await client.get(url)).status_code == 200
            except httpx.HTTPError:
                pass
            await trio.sleep(1.0 + 0.1 * (2 * rng.random() - 1))

    async with trio.open_nursery() as nursery:
        for client in clients:
            nursery.start_soon(probe, client)
        await trio.sleep(WARM_UP_S)
        cpu, before = time.process_time(), answered
        await trio.sleep(seconds)
        cpu, probes = time.process_time() - cpu, answered - before
        nursery.cancel_scope.cancel()
    for client in clients:
        await client.aclose()
    return cpu, probes


async def probe_cost(args: argparse.Namespace, workdir: Any) -> dict[str, Any]:
    tune_collector(YOUNG_THRESHOLD, freeze=True)  # an iop-node process's collector policy: the watcher stands for it
    backend = Daemon("mock-backend", python_command("-m", "iop_mock", "--port", "0"), workdir)
    try:
        port = int((await backend.wait_for_line(r"listening on http://[^:]+:(\d+)")).group(1))
        ours: list[tuple[float, int]] = []
        reference: list[tuple[float, int]] = []
        path = "/v1/models" if args.probe == "openai" else "/health"
        for _ in range(args.runs):
            ours.append(await _watcher_window(port, args.providers, args.probe, args.seconds))
            reference.append(await _httpx_window(port, args.providers, path, args.seconds))
    finally:
        backend.stop()

    def summary(runs: list[tuple[float, int]]) -> dict[str, float]:
        share = statistics.median(cpu / args.seconds for cpu, _ in runs)
        per_probe = statistics.median(cpu / probes * 1e6 for cpu, probes in runs if probes)
        rate = statistics.median(probes / args.seconds for _, probes in runs)
        return {"core_share": share, "us_per_probe": per_probe, "probes_per_s": rate}

    return {
        "providers": args.providers,
        "probe": args.probe,
        "seconds": args.seconds,
        "runs": args.runs,
        "watcher": summary(ours),
        "httpx_reference": summary(reference),
    }


def _edge_reports(providers: int, rounds: int, engine: bool = False) -> dict[str, float]:
    """CPU per provider_health frame decoded and applied, and per heartbeat frame decoded (reference).

    ``engine``: every provider admits by a token budget and every report is ``ready`` with the
    engine's view, its KV use alternately 0.25 and 0.5 (a busy engine: a report each probe).
    """
    keys = [ProviderKey("bench-node", f"p{i}") for i in range(providers)]
    spec = ProviderSpec(capacity=4)
    if engine:
        spec = ProviderSpec(capacity=64, context_window_tokens=32_768, total_context_tokens=65_536, admit_by="tokens")
    config = PoolConfig(
        policy=QueuePolicy(max_queue=16, queue_timeout=60.0),
        providers=dict.fromkeys(keys, spec),
        models={"m": ModelGroup(tuple(keys))},
    )
    if engine:
        views = [EngineView(kv_use=use, kv_tokens=None, preemptions=7, running=3, waiting=0) for use in (0.25, 0.5)]
        frames = [[encode(ProviderHealth(k.provider_id, "ready", engine=view)) for k in keys] for view in views]
    else:
        frames = [
            [
                encode(ProviderHealth(k.provider_id, state, "loading (Loading model)" if state == "not_ready" else ""))
                for k in keys
            ]
            for state in ("not_ready", "ready")
        ]
    beats = [encode(Heartbeat(i)) for i in range(providers)]

    async def measure() -> dict[str, float]:
        admission = Admission(config)
        generation = admission.connect("bench-node")
        started = time.process_time()
        for round_ in range(rounds):
            for frame in frames[round_ % 2]:
                message = decode(frame)
                assert isinstance(message, ProviderHealth)
                admission.report_health(
                    ProviderKey("bench-node", message.provider), provider_report(message, generation)
                )
        reports = time.process_time() - started
        started = time.process_time()
        for _ in range(rounds):
            for beat in beats:
                decode(beat)
        heartbeats = time.process_time() - started
        count = rounds * providers
        return {"us_per_report": reports / count * 1e6, "us_per_heartbeat": heartbeats / count * 1e6}

    return trio.run(measure)


EDGE_YAML = """\
listen: 127.0.0.1:0
node_listen: 127.0.0.1:0
provider_pool:
  max_queue: 256
  queue_timeout_ms: 60000
  retry: {max_attempts: 2}
  outlier: {consecutive_failures: 3, base_ejection_ms: 2000, max_ejection_ms: 2000}
nodes:
  - id: bench-node
    token: bench-token
    providers:
      - {id: gpu0, capacity: 4}
      - {id: gpu1, capacity: 4}
models:
  - id: m
    candidates:
      - {node: bench-node, provider: gpu0, upstream_model: m}
      - {node: bench-node, provider: gpu1, upstream_model: m}
"""

NODE_YAML = """\
node_id: bench-node
edge_url: ws://127.0.0.1:{node_port}
token: bench-token
runtime: {{concurrency: 8}}
providers:
  - {{id: gpu0, adapter: openai, base_url: "http://127.0.0.1:{port_a}/v1", capacity: 4}}
  - {{id: gpu1, adapter: openai, base_url: "http://127.0.0.1:{port_b}/v1", capacity: 4}}
"""

STREAM = {"model": "m", "max_tokens": 20, "stream": True, "messages": [{"role": "user", "content": "hi"}]}


SLOW_S = 1.0  # a healthy request takes 0.2 s (20 tokens at 100 tokens/s): slower, it went to A first
HOLD_S = 3.0  # A stays faulty this long after it was seen ejected: is anything still sent there?
WINDOW_S = 30.0  # ... or this long after the fault if it never is
SETTLE_S = 6.0  # after gpu0 is back: longer than LiteLLM's cooldown (5 s), so no trial starts with A cooled down
_BEGIN, _END = "<!-- ejection:begin -->", "<!-- ejection:end -->"


def _backend(workdir: pathlib.Path, name: str, port: int) -> Daemon:
    argv = python_command("-m", "iop_mock", "--port", str(port), "--tokens-per-second", "100")
    return Daemon(name, argv, workdir)


class _Fleet:
    """The processes of the ejection part in front of backends A and B, and the clients' tally."""

    name = "Edge + Node"

    def __init__(self, workdir: pathlib.Path) -> None:
        self.workdir = workdir
        workdir.mkdir(exist_ok=True)
        self.port_a, self.port_b = peers.free_port(), peers.free_port()
        self.daemons: dict[str, Daemon] = {}
        self.http_port = 0
        self.requests: list[tuple[float, float, bool]] = []  # (sent, answered, ok) of every client request
        self.pending: dict[object, float] = {}  # when each request still unanswered was sent
        self.failures: dict[str, int] = {}  # what the client saw of each failed request (status, body's tail)

    async def start(self) -> None:
        for name, port in (("backend-a", self.port_a), ("backend-b", self.port_b)):
            self.daemons[name] = _backend(self.workdir, name, port)
            await self.daemons[name].wait_for_line(r"listening on http://")
        started: list[Daemon] = []
        try:
            await self.start_front(started)
        except BaseException:
            for daemon in started:
                daemon.stop()
            raise
        self.daemons |= {daemon.name: daemon for daemon in started}
        await self.wait_gpu0("online")

    async def start_front(self, started: list[Daemon]) -> None:
        _, _, self.http_port, _ = await start_edge_and_node(
            self.workdir, started, edge_yaml=EDGE_YAML, node_yaml=NODE_YAML, port_a=self.port_a, port_b=self.port_b
        )

    async def gpu0(self, http: httpx.AsyncClient) -> str:
        status = (await http.get(f"http://127.0.0.1:{self.http_port}/status")).json()
        row = next((p for p in status["providers"] if p["provider_id"] == "gpu0"), None)
        return "offline" if row is None or not row["connected"] else str(row["health"])

    async def wait_gpu0(self, health: str, bound: float = 60.0) -> float | None:
        """Poll every 20 ms until ``gpu0``'s health is ``health``; return when it was seen (``None``: not in ``bound``)."""
        async with httpx.AsyncClient() as http:
            with trio.move_on_after(bound):
                while await self.gpu0(http) != health:
                    for name, daemon in self.daemons.items():
                        if not name.startswith("backend-"):
                            daemon.check_alive()
                    await trio.sleep(0.02)
                return trio.current_time()
        return None

    async def client(self) -> None:
        url = f"http://127.0.0.1:{self.http_port}/v1/chat/completions"
        async with httpx.AsyncClient(timeout=120.0) as http:
            while True:
                sent, key = trio.current_time(), object()
                self.pending[key] = sent
                try:
                    async with http.stream("POST", url, json=STREAM) as answer:
                        body = b"".join([piece async for piece in answer.aiter_bytes()])
                    ok = answer.status_code == 200 and body.rstrip().endswith(b"data: [DONE]")
                    why = f"{answer.status_code} {body[-200:].decode(errors='replace')}"
                except httpx.HTTPError as exc:
                    ok, why = False, repr(exc)
                if not ok:
                    self.failures[why[:120]] = self.failures.get(why[:120], 0) + 1
                self.requests.append((sent, trio.current_time(), ok))
                del self.pending[key]

    def stop(self) -> None:
        for daemon in self.daemons.values():
            daemon.stop()


class _LiteLLMFleet(_Fleet):
    """The same backends behind a LiteLLM proxy: one model, two deployments, as its docs advise."""

    name = f"LiteLLM {peers.version()}"

    async def start_front(self, started: list[Daemon]) -> None:
        self.http_port = await peers.start_litellm(
            0, self.workdir, started, peers.ejection_config(self.port_a, self.port_b)
        )

    async def gpu0(self, http: httpx.AsyncClient) -> str:
        """``ejected`` once its background health check has ``gpu0`` unhealthy (health-check routing
        then leaves it out of every pick); ``online`` once healthy."""
        answer = (await http.get(f"http://127.0.0.1:{self.http_port}/health", timeout=10.0)).json()
        return peers.health_verdict(answer, "gpu0")


async def _trial(fleet: _Fleet, fault: str) -> dict[str, float]:
    """One fault of backend A, held until ``HOLD_S`` after gpu0 was seen ejected; A healed after.

    Returns the seconds from the fault to gpu0 ejected (``nan``: not within ``WINDOW_S``), to the
    sending of the last client request that failed or took over ``SLOW_S`` (0: none), the client
    failures and the slow requests meanwhile."""
    started = trio.current_time()
    if fault == "hung":
        async with httpx.AsyncClient() as http:
            await http.post(f"http://127.0.0.1:{fleet.port_a}/fault", json={"hang": "no_answer"})
    else:
        fleet.daemons["backend-a"].proc.send_signal(signal.SIGKILL)
        fleet.daemons["backend-a"].proc.wait()
    ejected = await fleet.wait_gpu0("ejected", bound=WINDOW_S)
    await trio.sleep_until((ejected or started + WINDOW_S - HOLD_S) + HOLD_S)
    healed = trio.current_time()
    if fault == "hung":
        async with httpx.AsyncClient() as http:
            await http.post(f"http://127.0.0.1:{fleet.port_a}/fault", json={})
    else:
        fleet.daemons["backend-a"].stop()
        fleet.daemons["backend-a"] = _backend(fleet.workdir, "backend-a", fleet.port_a)
        await fleet.daemons["backend-a"].wait_for_line(r"listening on http://")
    if await fleet.wait_gpu0("online") is None:
        raise BenchmarkFailed(f"{fleet.name}: gpu0 was not online again within 60 s")
    await trio.sleep(SETTLE_S)
    with trio.move_on_after(SLOW_S + 10.0):  # the requests sent before the heal have their answers
        while any(sent < healed for sent in fleet.pending.values()):
            await trio.sleep(0.05)
    during = [(sent, answered, ok) for sent, answered, ok in fleet.requests if started <= answered and sent < healed]
    bad = [sent for sent, answered, ok in during if sent >= started and (not ok or answered - sent > SLOW_S)]
    return {
        "seconds": float("nan") if ejected is None else ejected - started,
        "last_bad_s": max(bad, default=started) - started,
        "client_failures": sum(not ok for _, _, ok in during),
        "slow": sum(ok and answered - sent > SLOW_S for sent, answered, ok in during),
        "requests": len(during),
    }


async def _ejections(fleet: _Fleet, trials: int, clients: int) -> dict[str, Any]:
    rows: dict[str, list[dict[str, float]]] = {"hung": [], "dead": []}
    try:
        await fleet.start()
        async with trio.open_nursery() as nursery:
            for _ in range(clients):
                nursery.start_soon(fleet.client)
            for _ in range(trials):
                for fault, trial_rows in rows.items():
                    trial_rows.append(await _trial(fleet, fault))
            nursery.cancel_scope.cancel()
    finally:
        fleet.stop()
    result: dict[str, Any] = {"served": sum(ok for _, _, ok in fleet.requests), "failures": fleet.failures}
    for fault, trial_rows in rows.items():
        seconds = sorted(row["seconds"] for row in trial_rows if row["seconds"] == row["seconds"])
        last_bad = sorted(row["last_bad_s"] for row in trial_rows)
        result[fault] = {
            "p50_s": percentile(seconds, 0.5) if seconds else float("nan"),
            "p99_s": percentile(seconds, 0.99) if seconds else float("nan"),
            "max_s": seconds[-1] if seconds else float("nan"),
            "not_ejected": len(trial_rows) - len(seconds),
            "last_bad_p99_s": percentile(last_bad, 0.99),
            "client_failures": sum(int(row["client_failures"]) for row in trial_rows),
            "slow": sum(int(row["slow"]) for row in trial_rows),
            "requests": sum(int(row["requests"]) for row in trial_rows),
            "seconds": seconds,
            "trials": trial_rows,
        }
    return result


async def time_to_ejection(args: argparse.Namespace, workdir: pathlib.Path) -> dict[str, Any]:
    result: dict[str, Any] = {"trials": args.trials, "clients": args.clients}
    result["ours"] = await _ejections(_Fleet(workdir / "ours"), args.trials, args.clients)
    if args.peers:
        try:
            result["litellm"] = await _ejections(_LiteLLMFleet(workdir / "litellm"), args.trials, args.clients)
        except (peers.PeerUnavailable, BenchmarkFailed) as exc:
            result["litellm_note"] = f"LiteLLM unavailable here: {exc}".splitlines()[0]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.health", description=__doc__)
    parser.add_argument("--part", choices=("probes", "edge", "ejection", "all"), default="all")
    parser.add_argument("--providers", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--probe", default="openai", choices=("openai", "llama_cpp"))
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--peers", action="store_true", help="ejection: also measure a LiteLLM proxy")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"command": "python -m benchmarks.health " + " ".join(argv or [])}
    if args.part in ("probes", "all"):
        result["probes"] = run_suite("health-", probe_cost, args, with_peers=False)
        _print_probes(args, result["probes"])
    if args.part in ("edge", "all"):
        runs = [
            (_edge_reports(args.providers, 10), _edge_reports(args.providers, 10, engine=True))
            for _ in range(args.runs)
        ]
        result["edge"] = {
            name: statistics.median(run[name] for run, _ in runs) for name in ("us_per_report", "us_per_heartbeat")
        }
        result["edge"]["us_per_engine_report"] = statistics.median(run["us_per_report"] for _, run in runs)
        per_report, engine = result["edge"]["us_per_report"], result["edge"]["us_per_engine_report"]
        beat = result["edge"]["us_per_heartbeat"]
        print(
            f"the Edge: {per_report:.1f} us of CPU per report decoded and applied (a heartbeat decoded: {beat:.1f} us)"
        )
        print(
            f"  all {args.providers} providers reported every second: {per_report * args.providers / 1e6:.2%} of a core"
        )
        print(
            f"  a ready report with the engine's view to a token budget: {engine:.1f} us; every provider every second: "
            f"{engine * args.providers / 1e6:.2%} of a core"
        )
    if args.part in ("ejection", "all"):
        result["ejection"] = run_suite("health-", time_to_ejection, args, with_peers=args.peers)
        print(table(result["ejection"]))
    out = RESULTS / f"health-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=2))
    return 0


def _print_probes(args: argparse.Namespace, result: dict[str, Any]) -> None:
    watcher, reference = result["watcher"], result["httpx_reference"]
    print(f"probes of {args.providers} providers every 1 s ({args.probe}), median of {args.runs} runs:")
    print(f"{'':24} {'probes/s':>10} {'µs/probe':>10} {'core share':>11}")
    for name, row in (("health watcher", watcher), ("httpx reference", reference)):
        print(f"{name:24} {row['probes_per_s']:10.0f} {row['us_per_probe']:10.1f} {row['core_share']:10.1%}")
    print(f"watcher / reference CPU per probe: {watcher['us_per_probe'] / reference['us_per_probe']:.2f}x")


def table(result: dict[str, Any]) -> str:
    """The ejection part as a markdown table, ours and (``--peers``) LiteLLM's rows side by side."""
    lines = [
        f"{result['trials']} trials of each fault, {result['clients']} clients streaming 20-token completions.",
        "",
        "| fault | gateway | ejected p50 | p99 | max | last failed or slow request sent, p99 | client failures"
        " | slow (> 1 s) | requests |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    systems = [("ours", _Fleet.name), ("litellm", _LiteLLMFleet.name)]
    for fault, label in (("hung", "hung engine"), ("dead", "dead process")):
        for key, name in systems:
            if key not in result:
                continue
            row = result[key][fault]
            missed = f" ({row['not_ejected']} not in {WINDOW_S:g} s)" if row["not_ejected"] else ""
            lines.append(
                f"| {label} | {name} | {row['p50_s']:.2f} s | {row['p99_s']:.2f} s | {row['max_s']:.2f} s{missed}"
                f" | {row['last_bad_p99_s']:.2f} s | {row['client_failures']} | {row['slow']} | {row['requests']} |"
            )
    if "litellm_note" in result:
        lines += ["", result["litellm_note"]]
    lines += ["", f"Measured {result['when']}, load average {result['load_average']} ({result['command']})."]
    return "\n".join(lines)


def run(trials: int = 5, with_peers: bool = False) -> dict[str, Any]:
    """The ejection part for ``python -m benchmarks ejection`` (``make bench-peers``); updates its docs block."""
    args = argparse.Namespace(trials=trials, clients=4, peers=with_peers)
    result = run_suite("health-", time_to_ejection, args, with_peers=with_peers)
    replace_doc_block(_BEGIN, _END, f"{_BEGIN}\n{table(result)}\n{_END}")
    return result


if __name__ == "__main__":
    raise SystemExit(main())
