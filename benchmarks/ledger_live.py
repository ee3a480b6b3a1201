"""The ledger's trace through real processes: ``python -m benchmarks.ledger_live [--requests N] [--seed S] [--mode M]``.

:mod:`benchmarks.ledger` replays its trace in virtual time against the mock's KV model. Here the
first ``--requests`` of the same trace (``ledger.trace``) run in real time through an Edge, a Node
with two providers and two ``iop-mock-backend --kv-tokens`` processes: the same engine, stepped on
the clock at the virtual replay's costs (a step every 20 ms, ``--tokens-per-second 50``; 0.1 ms a
prompt token prefilled, ``--prefill-tokens-per-second 10000``, at most 2,048 a step,
``--prefill-chunk-tokens``; 80 ns a cache entry in use, ``--kv-read-ns``), 65,536 tokens of cache
each, ``n_ctx`` 32,768, in the mode asked, reporting 256 slots (``--parallel``: the Node's
``llama_cpp`` probe, in the modes ``fail*``, caps a provider at the slots llama.cpp reports). Each request is a streamed chat whose message is its
prompt's tokens as the text ``"tok " * prompt`` (the mock counts 4 characters a token), with
``max_tokens`` and the mock's end-of-sequence hint ``mock_output_tokens`` (its output in the
trace). The Edge counts the prompt with a word-level ``tokenizer.json`` written for the run
(``models[].tokenizer``: one token a ``tok``, and the chat template's 10), so a reservation is the
prompt as the mock counts it and ``max_tokens``, plus the template's 10 the mock's count leaves out:
exact but for those, as the virtual replay's.

One client task per request, started at its arrival; its time to first token is taken at the
first content chunk, and the rest of the stream is drained, counting its tokens by a byte search
(no parsing). Two arms, each on a fresh stack: the **ledger** (``admit_by: tokens``,
``total_context_tokens`` 65,536, capacity 256) and the **slots** (``capacity`` x
``long_context_capacity`` from ``--slots``, long above 8,192 tokens; by default the count the
virtual replay tunes best on the same requests). Both queue at most 64 requests for at most 5 s
(the TTFT objective). Reported per arm, live beside the virtual replay of the same requests
(``ledger.simulate``): the mocks' preemptions and context errors (their ``/stats``), good requests
(finished, first token within 5 s), finished, refused by status and error code, TTFT p50/p99 and
goodput (good per second of the trace's arrivals); and, live only, the errors that ended streams,
the most the Edge had reserved on each provider (its ``/status``, looked at every 50 ms), the
streams that carried the tokens their request asked, and a stream's pace after its first token
(the engine's real step, against the 20 ms it is meant to cost). Every wait is bounded: a request
that is not over within :data:`REQUEST_BOUND` seconds of its arrival is cut and counted as such.

``--spread DRAWS`` starts no process: it runs the virtual replay of both arms on ``DRAWS`` copies of
the requests, each arrival delayed by a uniform 0-20 ms, and prints the range of each figure -- how
far the replay itself moves when arrivals move by less than a step, as they do live.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs
import trio

from iop_mock.kv import MODES

from . import ledger
from .harness import Daemon, HttpConnection, get_json, percentile, python_command, start_edge_and_node

MODEL = "m"
PROVIDERS = ("gpu0", "gpu1")
TOKENS_PER_SECOND = round(1 / ledger.STEP)
PREFILL_TOKENS_PER_SECOND = round(1 / ledger.PREFILL_SECONDS)
TEMPLATE_TOKENS = 10
"""What the Edge adds to a one-message chat's prompt: the message's role (one token here) and 4, the prompt's 5."""
REQUEST_BOUND = 900.0
"""Seconds a request may take from its arrival to its answer's end before it is cut."""
STATUS_EVERY = 0.05
"""Seconds between two looks at the Edge's ``/status`` (the reservations)."""
PARALLEL = 256
"""The slots a mock's ``/slots`` reports (llama.cpp's ``-np``): the Node's ``llama_cpp`` probe caps a
provider at it, so it is the most either arm runs on one."""
HEAD = 4096
"""Bytes of an answer's body kept (a refusal's error object)."""
STARTED = 1.0
"""Seconds between the stack's readiness and the trace's first instant (the bodies are built before)."""


@attrs.frozen
class Engine:
    """The two mocks' engine."""

    mode: str
    kv_tokens: int = ledger.KV_TOTAL
    n_ctx: int = ledger.N_CTX
    tokens_per_second: float = TOKENS_PER_SECOND
    prefill_tokens_per_second: float = PREFILL_TOKENS_PER_SECOND
    prefill_chunk: int = ledger.PREFILL_PER_STEP
    read_ns: float = ledger.READ_SECONDS * 1e9

    def argv(self) -> list[str]:
        return [
            *("--latency-ms", "0", "--model", MODEL, "--kv-mode", self.mode),
            *("--kv-tokens", str(self.kv_tokens), "--n-ctx", str(self.n_ctx)),
            *("--tokens-per-second", str(self.tokens_per_second)),
            *("--prefill-tokens-per-second", str(self.prefill_tokens_per_second)),
            *("--prefill-chunk-tokens", str(self.prefill_chunk), "--kv-read-ns", str(self.read_ns)),
            *("--parallel", str(PARALLEL)),
        ]


@attrs.frozen
class Arm:
    """An admission at the Edge: the ledger (``slots`` None) or fixed slots ``(capacity, long)``."""

    slots: tuple[int, int] | None = None
    queue_timeout: float = ledger.QUEUE_TIMEOUT

    @property
    def name(self) -> str:
        return "ledger" if self.slots is None else f"slots {self.slots[0]}x{self.slots[1]}"

    def provider(self, pid: str, engine: Engine) -> dict[str, Any]:
        if self.slots is None:
            budget = {"admit_by": "tokens", "total_context_tokens": engine.kv_tokens}
            return {"id": pid, "capacity": 256, "context_window_tokens": engine.n_ctx, **budget}
        capacity, long = self.slots
        return {"id": pid, "capacity": capacity, "long_context_capacity": long, "context_window_tokens": engine.n_ctx}

    def edge_yaml(self, engine: Engine, tokenizer: pathlib.Path) -> str:
        model: dict[str, Any] = {"id": MODEL, "tokenizer": str(tokenizer)}
        model["candidates"] = [{"node": "bench-node", "provider": pid} for pid in PROVIDERS]
        if self.slots is not None:
            model["long_context_threshold_tokens"] = ledger.LONG_ABOVE
        config = {
            "listen": "127.0.0.1:0",
            "node_listen": "127.0.0.1:0",
            "provider_pool": {"max_queue": ledger.MAX_QUEUE, "queue_timeout_ms": round(self.queue_timeout * 1000)},
            "nodes": [
                {
                    "id": "bench-node",
                    "token": "bench-token",
                    "providers": [self.provider(pid, engine) for pid in PROVIDERS],
                }
            ],
            "models": [model],
        }
        return json.dumps(config)  # JSON is YAML


NODE_YAML = """\
node_id: bench-node
edge_url: ws://127.0.0.1:{node_port}
token: bench-token
runtime:
  concurrency: 1024
providers:
"""
NODE_PROVIDER = """\
  - id: {pid}
    adapter: openai
    base_url: http://127.0.0.1:{{{pid}}}/v1
    capacity: 512
    timeout_ms: 900000
    health:
      probe: {probe}
      timeout_ms: 5000
"""


def node_yaml(engine: Engine) -> str:
    """The Node's config (ports left to fill): two providers, each probed as its engine is (vLLM's
    ``/metrics`` in mode ``preempt``, llama.cpp's ``/slots`` otherwise)."""
    probe = "vllm" if engine.mode == "preempt" else "llama_cpp"
    return NODE_YAML + "".join(NODE_PROVIDER.format(pid=pid, probe=probe) for pid in PROVIDERS)


def write_tokenizer(path: pathlib.Path) -> pathlib.Path:
    """A ``tokenizer.json`` for the run's texts: a word-level vocabulary where ``tok`` is one token
    (and any other word one unknown token), split at whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "tok": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # type: ignore[assignment]
    tokenizer.save(str(path))
    return path


def request_bytes(request: ledger.Request) -> bytes:
    body = {
        "model": MODEL,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": request.max_tokens,
        "mock_output_tokens": request.output,
        "messages": [{"role": "user", "content": "tok " * request.prompt}],
    }
    return HttpConnection.build("POST", "/v1/chat/completions", json.dumps(body).encode())


@attrs.define
class Outcome:
    """What one request got."""

    status: int = 0  # 0: no answer (the connection failed, or the request was cut)
    ttft: float | None = None
    tokens: int = 0
    error: bool = False  # an error in the answer: its body, or a stream's last event
    cut: bool = False
    end: float | None = None  # when its last byte came (since its arrival)
    head: bytes = b""  # the body's first bytes (a refusal's error object)

    @property
    def done(self) -> bool:
        return self.status == 200 and not self.error and not self.cut

    @property
    def refusal(self) -> str | None:
        """``"STATUS code"`` of an answer that is not a stream (``"0 no answer"``: none came, the
        connection failed); None for a stream or a request cut."""
        if self.status == 200 or self.cut:
            return None
        try:
            code = json.loads(self.head)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = "?"
        return f"{self.status} {code}" if self.status else "0 no answer"

    @property
    def seconds_a_token(self) -> float | None:
        """The stream's pace after its first token: seconds per further token."""
        if self.ttft is None or self.end is None or self.tokens < 2:
            return None
        return (self.end - self.ttft) / (self.tokens - 1)


class _Sink:
    """A stream's body pieces: the first content chunk's time, then a count of its tokens."""

    TOKEN = b'"content":"tok "'
    ERROR = b'"error"'

    def __init__(self, outcome: Outcome, arrival: float) -> None:
        self.outcome, self.arrival, self.carry = outcome, arrival, b""

    def __call__(self, piece: bytes) -> None:
        data = self.carry + piece
        found = data.count(self.TOKEN)
        if found and self.outcome.ttft is None:
            self.outcome.ttft = trio.current_time() - self.arrival
        self.outcome.tokens += found
        self.outcome.error = self.outcome.error or self.ERROR in data
        self.outcome.end = trio.current_time() - self.arrival
        if len(self.outcome.head) < HEAD:
            self.outcome.head += piece[: HEAD - len(self.outcome.head)]
        self.carry = data[-(len(self.TOKEN) - 1) :]


async def one(port: int, raw: bytes, arrival: float, outcome: Outcome) -> None:
    """Send one request at ``arrival`` (trio's clock) and drain its answer, within the bound."""
    await trio.sleep_until(arrival)
    connection = HttpConnection("127.0.0.1", port)
    with trio.move_on_after(REQUEST_BOUND) as bound:
        try:
            outcome.status, _ = await connection.request(raw, _Sink(outcome, arrival))
        except OSError:
            outcome.status = 0
    outcome.cut = bound.cancelled_caught
    with trio.CancelScope(shield=True):
        await connection.aclose()


async def watch_reservations(port: int, peaks: dict[str, int]) -> None:
    """The most each provider ever had reserved, as the Edge's ``/status`` shows it (until cancelled)."""
    poller = HttpConnection("127.0.0.1", port)
    try:
        while True:
            with trio.move_on_after(5):
                for provider in (await get_json(poller, "/status"))["providers"]:
                    reserved, pid = provider.get("reserved_tokens") or 0, provider["provider_id"]
                    peaks[pid] = max(peaks.get(pid, 0), reserved)
            await trio.sleep(STATUS_EVERY)
    finally:
        with trio.CancelScope(shield=True):
            await poller.aclose()


def live(
    workdir: pathlib.Path, arm: Arm, engine: Engine, requests: list[ledger.Request], objective: float
) -> dict[str, Any]:
    """``requests`` through a fresh stack (its logs in ``workdir``) admitting as ``arm``; its figures
    (see the module docstring)."""
    workdir.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(workdir / "tokenizer.json")
    return trio.run(run_arm, workdir, tokenizer, arm, engine, requests, objective)


async def run_arm(
    workdir: pathlib.Path,
    tokenizer: pathlib.Path,
    arm: Arm,
    engine: Engine,
    requests: list[ledger.Request],
    objective: float,
) -> dict[str, Any]:
    """:func:`live`, in trio."""
    daemons: list[Daemon] = []
    try:
        ports = {}
        for pid in PROVIDERS:
            mock = Daemon(f"mock-{pid}", python_command("-m", "iop_mock", "--port", "0", *engine.argv()), workdir)
            daemons.append(mock)
            ports[pid] = int((await mock.wait_for_line(r"listening on http://[^:]+:(\d+)")).group(1))
        _, _, http_port, _ = await start_edge_and_node(
            workdir, daemons, edge_yaml=arm.edge_yaml(engine, tokenizer), node_yaml=node_yaml(engine), **ports
        )
        raws = [request_bytes(r) for r in requests]
        outcomes = [Outcome() for _ in requests]
        peaks: dict[str, int] = {}
        start = trio.current_time() + STARTED
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_reservations, http_port, peaks)
            async with trio.open_nursery() as clients:
                for request, raw, outcome in zip(requests, raws, outcomes, strict=True):
                    clients.start_soon(one, http_port, raw, start + request.arrival, outcome)
            nursery.cancel_scope.cancel()
        stats = [await mock_stats(port) for port in ports.values()]
    finally:
        for daemon in reversed(daemons):
            daemon.stop()
    return figures(requests, outcomes, stats, objective) | {"reserved_peak": peaks}


async def mock_stats(port: int) -> dict[str, Any]:
    connection = HttpConnection("127.0.0.1", port)
    with trio.fail_after(30):
        stats: dict[str, Any] = await get_json(connection, "/stats")
        await connection.aclose()
    return stats


def figures(
    requests: list[ledger.Request], outcomes: list[Outcome], stats: list[dict[str, Any]], objective: float
) -> dict[str, Any]:
    """An arm's figures from its requests' outcomes and the mocks' ``/stats``."""
    done = [o for o in outcomes if o.done]
    good = sum(1 for o in done if o.ttft is not None and o.ttft <= objective)
    ttfts = sorted(o.ttft for o in done if o.ttft is not None)
    refused = Counter(o.refusal for o in outcomes if o.refusal is not None)
    paces = sorted(pace for o in done if (pace := o.seconds_a_token) is not None)
    return {
        "preemptions": sum(s["preemptions"] for s in stats),
        "context_errors": sum(s["context_errors"] for s in stats),
        "good": good,
        "goodput": good / requests[-1].arrival,
        "finished": len(done),
        "refused": dict(sorted(refused.items())),
        "errors": sum(1 for o in outcomes if o.status == 200 and o.error),
        "cut": sum(1 for o in outcomes if o.cut),
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p99": percentile(ttfts, 0.99),
        "kv_peak": max(s["kv_peak"] for s in stats) / stats[0]["kv_total"],
        "ms_a_token": {"p50": 1000 * percentile(paces, 0.5), "p99": 1000 * percentile(paces, 0.99)},
        "tokens_as_asked": sum(1 for o, r in zip(outcomes, requests, strict=True) if o.done and o.tokens == r.output),
    }


def tuned_slots(requests: list[ledger.Request], mode: str) -> tuple[int, int]:
    """The slots the virtual replay tunes best on ``requests`` (:data:`ledger.SLOT_GRID`)."""
    grid = {slots: ledger.simulate(ledger.slots_arm(*slots), requests, mode)["goodput"] for slots in ledger.SLOT_GRID}
    return max(grid, key=lambda slots: grid[slots])


def virtual(arm: Arm, requests: list[ledger.Request], mode: str) -> dict[str, Any]:
    """The virtual replay's figures for ``arm`` on the same requests."""
    of: ledger.ArmOf = ledger.ledger_arm if arm.slots is None else ledger.slots_arm(*arm.slots)
    return ledger.simulate(of, requests, mode, arm.queue_timeout)


def spread(arm: Arm, requests: list[ledger.Request], mode: str, draws: int) -> list[dict[str, Any]]:
    """The virtual replay of ``arm`` on ``draws`` copies of ``requests``, each arrival delayed by a
    uniform 0-20 ms (less than a step; seeded 1..draws): how much the replay itself moves when the
    arrivals move as little as they do live."""
    out = []
    for draw in range(1, draws + 1):
        rng = random.Random(draw)
        run = virtual(arm, delayed(requests, rng), mode)
        out.append({k: run[k] for k in ("good", "finished", "preemptions", "context_errors", "ttft_p50")})
    return out


def delayed(requests: list[ledger.Request], rng: random.Random) -> list[ledger.Request]:
    moved = [
        ledger.Request(r.id, r.arrival + rng.uniform(0, ledger.STEP), r.prompt, r.max_tokens, r.output)
        for r in requests
    ]
    return sorted(moved, key=lambda r: r.arrival)


def _row(name: str, r: dict[str, Any]) -> str:
    refused = r["refused"]
    by_status = ", ".join(f"{n} x {why}" for why, n in refused.items()) if isinstance(refused, dict) else refused
    return (
        f"| {name} | {r['preemptions']} | {r['context_errors']} | {r['good']} | {r['finished']} | {by_status or 0} "
        f"| {r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | {r['goodput']:.3f} |"
    )


HEADER = (
    "| arm | preemptions | context errors | good | finished | refused | TTFT p50 s | TTFT p99 s | goodput (good/s) |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def report(results: dict[str, Any], out: Callable[[str], object] = print) -> None:
    out(f"\nmode {results['mode']}, {results['requests']} requests ({results['trace']}), live and virtual")
    out(HEADER)
    for arm in results["arms"]:
        out(_row(f"{arm['name']}, live", arm["live"]))
        out(_row(f"{arm['name']}, virtual", arm["virtual"]))
    for arm in results["arms"]:
        live = arm["live"]
        pace = live["ms_a_token"]
        extra = f"errors in streams {live['errors']}, cut {live['cut']}, cache peak {live['kv_peak']:.2f}"
        out(f"{arm['name']}: {extra}, reserved peak {live['reserved_peak']}, tokens as asked {live['tokens_as_asked']}")
        out(f"{arm['name']}: a stream's ms a token after its first, p50 {pace['p50']:.1f}, p99 {pace['p99']:.1f}")


def parse_slots(text: str) -> tuple[int, int]:
    capacity, long = (int(part) for part in text.lower().split("x"))
    return capacity, long


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ledger_live", description=__doc__)
    parser.add_argument("--requests", type=int, default=300, help="the trace's first N requests (300)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--mode", choices=MODES, default="preempt")
    parser.add_argument("--chats", choices=ledger.CHATS, default="short", help="the chats' shape (short)")
    parser.add_argument("--long-share", type=float, default=0.15, help="the share of long requests (0.15)")
    parser.add_argument("--slots", type=parse_slots, help="CxL: the slots arm (default: the virtual replay's best)")
    parser.add_argument(
        "--spread",
        type=int,
        default=0,
        metavar="DRAWS",
        help="instead of the live run: the virtual replay of both arms with the arrivals delayed 0-20 ms, DRAWS times",
    )
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    requests = ledger.trace(args.requests, args.seed, args.long_share, args.chats)
    slots = args.slots or tuned_slots(requests, args.mode)
    if args.spread:
        for arm in (Arm(), Arm(slots)):
            runs = spread(arm, requests, args.mode, args.spread)
            ranges = {k: (min(r[k] for r in runs), max(r[k] for r in runs)) for k in runs[0]}
            text = ", ".join(f"{k} {round(lo, 2):g}-{round(hi, 2):g}" for k, (lo, hi) in ranges.items())
            print(f"mode {args.mode}, {arm.name}, {args.spread} draws: {text}")
        return 0
    engine = Engine(args.mode)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="ledger-live-"))
    arms = []
    for arm in (Arm(), Arm(slots)):
        print(f"{arm.name}: {args.requests} requests, mode {args.mode} ...", file=sys.stderr, flush=True)
        figures_live = live(workdir / arm.name.replace(" ", "-"), arm, engine, requests, ledger.TTFT_OBJECTIVE)
        arms.append({"name": arm.name, "live": figures_live, "virtual": virtual(arm, requests, args.mode)})
    shape = f"seed {args.seed}, chats {args.chats}, long share {args.long_share}"
    results = {"mode": args.mode, "requests": args.requests, "trace": shape, "arms": arms}
    report(results)
    print(f"(logs in {workdir})", file=sys.stderr)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
