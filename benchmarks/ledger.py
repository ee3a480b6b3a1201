"""The context-token ledger against what it replaces: ``python -m benchmarks.ledger [--full] [--seed N]``.

A replay in virtual time (issue 40). One mixed trace -- mostly short chats, some
16k-28k-token prompts, ``max_tokens`` varied, each request stopping at its own end of
sequence at or before ``max_tokens`` -- arrives (Poisson) at 1.5x the fleet's saturation
(its cache over the cache-seconds a request holds, prefill included, at the 20 ms step)
at two engines of the mock's KV model (:class:`iop_mock.kv.KvEngine`) in each of its
modes: ``preempt`` as vLLM, ``fail`` as llama.cpp's server (a full cache fails every
sequence in progress) and ``fail-newest`` (an engine that fails only the newest). Each
engine holds 65,536 tokens of cache, ``n_ctx`` 32,768, and prefills in chunks of 2,048
tokens a step; a step costs 20 ms, plus 0.1 ms a prompt token prefilled in it, plus 80 ns
a cache entry read (each engine steps on its own clock). Three admissions
decide what each engine gets:

- ``ledger``: the admission core (:class:`~iop_admission.core.AdmissionState`) with
  ``admit_by="tokens"``, budget 65,536 per provider; each request reserves its prompt
  (counted exactly: the backend's ``/tokenize``) plus ``max_tokens``;
- ``slots``: the same core with fixed long slots (``admit_by="slots"``): a request is long
  when ``prompt + max_tokens`` is above 8,192; every ``capacity`` of 1-32 x
  ``long_context_capacity`` of 1-3 is run, and the best goodput is reported (tuned as well
  as it can be);
- ``reactive``: a detector in the manner of the Gateway API Inference Extension's
  defaults: an engine takes a request while its scraped waiting queue is under 5 and its
  scraped KV use under 0.8, metrics scraped every 50 ms (counted generously: a request
  sent since the last scrape counts as waiting), the least used engine first.

Beside them, for information, ``both``: the ledger with one long slot per engine
(``admit_by="both"``, capacity 64). Every arm queues at most 64 requests (the Edge's default)
for at most the objective (``--queue-timeout``, 5 s: a request that waited longer cannot be
good); a request is *good* when it finished (no error) with a time to first token within the
objective (5 s). ``--long-share`` and ``--chats history`` change the trace's shape (the
chats then carry their history and hold a larger share of the cache).

Reported per arm: preemptions, context errors, good requests per second (goodput), requests
finished and refused, long requests good and finished, tokens served a second (prompt and
output of the requests finished), TTFT p50/p99, the cache's peak use; per run the ceiling,
the ratio the ledger would reach if every request of the trace were good. Then (unless
``--no-cost``) the decision cost: the trio lease cycle with a token budget against the same
cycle without one, interleaved CPU-time rounds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from iop_admission import Admission, AdmissionError, ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy
from iop_admission.core import AdmissionState, Failed, Granted, Lease, Waiter
from iop_mock.kv import MODES, KvEngine, Step

from .harness import percentile

STEP = 0.02  # seconds a decode step costs at least (the weights read): 50 tokens/s per sequence
PREFILL_SECONDS = 1e-4  # a prompt token's prefill: 10,000 tokens/s (a 30-35B model on one GPU)
READ_SECONDS = 8e-8  # a cache entry read in a step: a full 65,536-token cache adds about 5 ms
ENGINE_COST = (STEP, PREFILL_SECONDS, READ_SECONDS)
TICK = 0.01  # arrivals and the arms' clocks (queue deadlines, scrapes) advance by this
KV_TOTAL = 65_536
N_CTX = 32_768
PREFILL_PER_STEP = 2_048  # chunked prefill: a step's token budget (vLLM's max_num_batched_tokens)
MAX_QUEUE = 64
TTFT_OBJECTIVE = 5.0
QUEUE_TIMEOUT = TTFT_OBJECTIVE  # a request that waited past the objective cannot be good
LONG_ABOVE = 8_192
OVERLOAD = 1.5
SCRAPE = 0.05
CHATS = ("short", "history")
KEYS = (ProviderKey("node-a", "gpu0"), ProviderKey("node-b", "gpu1"))
MODEL = "m"


@dataclass(eq=False)
class Request:
    id: int
    arrival: float
    prompt: int
    max_tokens: int
    output: int
    ttft: float | None = None
    done: bool = False
    error: bool = False  # a context error
    refused: bool = False  # queue full, timed out, unavailable
    lease: Lease | None = None
    engine: int = -1

    @property
    def reserve(self) -> int:
        return self.prompt + self.max_tokens


def trace(count: int, seed: int, long_share: float = 0.15, chats: str = "short") -> list[Request]:
    """The mixed trace at 1.5x saturation (see the module docstring).

    ``long_share``: the share of long requests. ``chats``: ``"short"`` (prompts of 100-2,000
    tokens, ``max_tokens`` 128-1,024) or ``"history"`` (chats carrying their history: prompts
    log-normal around 1,000 tokens within 50-7,000, ``max_tokens`` 256-2,048), where the chats
    hold a larger share of the cache.
    """
    if chats not in CHATS:
        raise ValueError(f"chats must be one of {sorted(CHATS)}, got {chats!r}")
    rng = random.Random(seed)
    shapes = []
    for _ in range(count):
        if rng.random() < long_share:
            prompt = rng.randint(16_000, 28_000)
            max_tokens = min(rng.choice((256, 1024, 2048, 4096)), N_CTX - prompt)
        elif chats == "short":
            prompt = rng.randint(100, 2_000)
            max_tokens = rng.choice((128, 256, 512, 1024))
        else:
            prompt = min(7_000, max(50, round(rng.lognormvariate(math.log(1_000), 0.8))))
            max_tokens = rng.choice((256, 512, 1024, 2048))
        shapes.append((prompt, max_tokens, max(1, round(max_tokens * rng.uniform(0.2, 1.0)))))
    # Saturation: the fleet's cache divided by the cache-seconds a request holds on average
    # (its prompt while prefilled, then prompt and output while it decodes at the nominal step).
    held = statistics.fmean(p * p * PREFILL_SECONDS + out * STEP * (p + out / 2) for p, _, out in shapes)
    rate = OVERLOAD * len(KEYS) * KV_TOTAL / held
    now, out_trace = 0.0, []
    for i, (prompt, max_tokens, output) in enumerate(shapes):
        now += rng.expovariate(rate)
        out_trace.append(Request(i, now, prompt, max_tokens, output))
    return out_trace


class CoreArm:
    """The admission core decides: a grant goes to its provider's engine at once."""

    def __init__(self, specs: dict[ProviderKey, ProviderSpec], tokens: bool, queue_timeout: float) -> None:
        policy = QueuePolicy(max_queue=MAX_QUEUE, queue_timeout=queue_timeout)
        self.state = AdmissionState(PoolConfig(policy, specs, {MODEL: ModelGroup(KEYS)}))
        for key in KEYS:
            self.state.connect(key.node_id)
        self.tokens = tokens
        self.waiting: dict[int, Request] = {}  # waiter seq -> request
        self.send: Callable[[Request, int], None] = lambda request, engine: None

    def arrive(self, request: Request, now: float) -> None:
        long = request.reserve > LONG_ABOVE
        try:
            got = self.state.request(MODEL, long, now, tokens=request.reserve if self.tokens else None)
        except AdmissionError:
            request.refused = True
            return
        if isinstance(got, Waiter):
            self.waiting[got.seq] = request
        else:
            self._start(request, got)

    def tick(self, now: float) -> None:
        for waiter in self.state.expire(now):
            self.waiting.pop(waiter.seq).refused = True

    def ended(self, request: Request) -> None:
        assert request.lease is not None
        for decision in self.state.release(request.lease):
            if isinstance(decision, Granted):
                self._start(self.waiting.pop(decision.waiter.seq), decision.lease)
            elif isinstance(decision, Failed):
                self.waiting.pop(decision.waiter.seq).refused = True

    def _start(self, request: Request, lease: Lease) -> None:
        request.lease = lease
        self.send(request, KEYS.index(lease.provider))


class ReactiveArm:
    """Queue at the gateway; send while an engine's scraped queue < 5 and KV use < 0.8."""

    def __init__(self, engines: list[KvEngine], queue_timeout: float) -> None:
        self.engines, self.queue_timeout = engines, queue_timeout
        self.queue: list[Request] = []
        self.scraped: list[tuple[int, float]] = [(0, 0.0)] * len(engines)
        self.sent_since: list[int] = [0] * len(engines)
        self.next_scrape = 0.0
        self.send: Callable[[Request, int], None] = lambda request, engine: None

    def arrive(self, request: Request, now: float) -> None:
        if len(self.queue) >= MAX_QUEUE:
            request.refused = True
            return
        self.queue.append(request)
        self._dispatch()

    def tick(self, now: float) -> None:
        if now >= self.next_scrape:
            self.scraped = [(e.waiting, e.usage) for e in self.engines]
            self.sent_since = [0] * len(self.engines)
            self.next_scrape = now + SCRAPE
        while self.queue and self.queue[0].arrival + self.queue_timeout <= now:
            self.queue.pop(0).refused = True
        self._dispatch()

    def ended(self, request: Request) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        while self.queue:
            open_ = [
                (usage, i)
                for i, (waiting, usage) in enumerate(self.scraped)
                if waiting + self.sent_since[i] < 5 and usage < 0.8
            ]
            if not open_:
                return
            _, i = min(open_)
            self.sent_since[i] += 1
            self.send(self.queue.pop(0), i)


Arm = CoreArm | ReactiveArm


ArmOf = Callable[[list[KvEngine], float], Arm]
"""An arm for the engines and a queue timeout."""


def simulate(arm_of: ArmOf, requests: list[Request], mode: str, queue_timeout: float = QUEUE_TIMEOUT) -> dict[str, Any]:
    """Replay ``requests`` (copied) through one arm against fresh engines; the figures of the run."""
    requests = [Request(r.id, r.arrival, r.prompt, r.max_tokens, r.output) for r in requests]
    engines = [KvEngine(KV_TOTAL, N_CTX, mode=mode, prefill_per_step=PREFILL_PER_STEP, cost=ENGINE_COST) for _ in KEYS]
    arm = arm_of(engines, queue_timeout)
    by_id = {r.id: r for r in requests}
    active: set[int] = set()

    def send(request: Request, engine: int) -> None:
        request.engine = engine
        if engines[engine].submit(request.id, request.prompt, request.max_tokens, request.output):
            active.add(request.id)
        else:
            request.error = True
            arm.ended(request)

    def ended(out: Step, at: float) -> None:
        """A step's results, at its end."""
        for sid in out.first:
            by_id[sid].ttft = at - by_id[sid].arrival
        for sid in out.finished + out.failed:
            request = by_id[sid]
            request.done, request.error = sid in out.finished, sid in out.failed
            active.discard(sid)
            arm.ended(request)

    arm.send = send
    pending = iter(requests)
    upcoming = next(pending, None)
    steps: list[Step | None] = [None] * len(engines)  # each engine's step under way
    ends = [0.0] * len(engines)  # when it ends (each engine steps on its own clock)
    for tick in itertools.count():
        now = tick * TICK
        while upcoming is not None and upcoming.arrival <= now:
            arm.arrive(upcoming, now)
            upcoming = next(pending, None)
        arm.tick(now)
        while (at := min(ends)) < now + TICK:
            i = ends.index(at)
            done = steps[i]
            if done is not None:
                ended(done, at)
            steps[i] = out = engines[i].step()
            ends[i] = at + out.seconds
        if upcoming is None and not active and not _queued(arm):
            break
    duration = requests[-1].arrival
    ttfts = sorted(r.ttft for r in requests if r.ttft is not None and r.done)
    good = sum(1 for r in requests if _good(r))
    return {
        "preemptions": sum(e.preemptions for e in engines),
        "context_errors": sum(e.context_errors for e in engines),
        "goodput": good / duration,
        "good": good,
        "finished": sum(1 for r in requests if r.done),
        "good_long": sum(1 for r in requests if r.reserve > LONG_ABOVE and _good(r)),
        "finished_long": sum(1 for r in requests if r.reserve > LONG_ABOVE and r.done),
        "tokens_per_s": sum(r.prompt + r.output for r in requests if r.done) / duration,
        "refused": sum(1 for r in requests if r.refused),
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p99": percentile(ttfts, 0.99),
        "kv_peak": max(e.peak for e in engines) / KV_TOTAL,
    }


def _good(request: Request) -> bool:
    """Finished with its first token within the objective."""
    return request.done and request.ttft is not None and request.ttft <= TTFT_OBJECTIVE


def _queued(arm: Arm) -> bool:
    return bool(arm.waiting if isinstance(arm, CoreArm) else arm.queue)


def ledger_arm(engines: list[KvEngine], queue_timeout: float) -> Arm:
    spec = ProviderSpec(capacity=256, context_window_tokens=N_CTX, total_context_tokens=KV_TOTAL, admit_by="tokens")
    return CoreArm(dict.fromkeys(KEYS, spec), True, queue_timeout)


def slots_arm(capacity: int, long_slots: int) -> ArmOf:
    def make(engines: list[KvEngine], queue_timeout: float) -> Arm:
        spec = ProviderSpec(capacity=capacity, long_context_capacity=long_slots, context_window_tokens=N_CTX)
        return CoreArm(dict.fromkeys(KEYS, spec), False, queue_timeout)

    return make


def both_arm(engines: list[KvEngine], queue_timeout: float) -> Arm:
    spec = ProviderSpec(
        capacity=64,
        long_context_capacity=1,
        context_window_tokens=N_CTX,
        total_context_tokens=KV_TOTAL,
        admit_by="both",
    )
    return CoreArm(dict.fromkeys(KEYS, spec), True, queue_timeout)


SLOT_GRID = [(c, long) for c in (*range(1, 33), 40, 48, 64) for long in (1, 2, 3) if long <= c]


def replay(
    count: int,
    seed: int,
    mode: str,
    long_share: float = 0.15,
    chats: str = "short",
    queue_timeout: float = QUEUE_TIMEOUT,
) -> dict[str, Any]:
    """The three arms on one trace in one engine mode; slots tuned over :data:`SLOT_GRID`.

    ``slots_harmless``: the best slots among those with no preemption and no context error.
    ``ceiling``: the ledger's goodput over the best other's if every request of the trace were
    good -- the most any admission could reach against them on this trace.
    """
    requests = trace(count, seed, long_share, chats)
    ledger = simulate(ledger_arm, requests, mode, queue_timeout)
    grid = {f"{c}x{long}": simulate(slots_arm(c, long), requests, mode, queue_timeout) for c, long in SLOT_GRID}
    best = max(grid, key=lambda name: grid[name]["goodput"])
    harmless = [name for name, r in grid.items() if not r["preemptions"] and not r["context_errors"]]
    safe = max(harmless, key=lambda name: grid[name]["goodput"], default=None)
    reactive = simulate(ReactiveArm, requests, mode, queue_timeout)
    return {
        "mode": mode,
        "requests": count,
        "trace": {"long_share": long_share, "chats": chats, "queue_timeout": queue_timeout},
        "ceiling": count / max(grid[best]["good"], reactive["good"], 1),
        "ledger": ledger,
        "slots": {"best": best, **grid[best]},
        "slots_harmless": None if safe is None else {"best": safe, **grid[safe]},
        "reactive": reactive,
        "both": simulate(both_arm, requests, mode, queue_timeout),
        "slots_grid": {name: round(r["goodput"], 3) for name, r in grid.items()},
    }


# ------------------------------------------------------------------ decision cost


def _lease_cycles(spec: ProviderSpec, tokens: int | None) -> Callable[[int], float]:
    """``n`` uncontended trio lease cycles on one provider of ``spec``, asking for ``tokens``."""
    key = KEYS[0]
    config = PoolConfig(QueuePolicy(max_queue=1_000, queue_timeout=3600.0), {key: spec}, {MODEL: ModelGroup((key,))})

    def run(n: int) -> float:
        async def main() -> float:
            admission = Admission(config)
            admission.connect(key.node_id)
            t0 = time.process_time()
            for _ in range(n):
                async with admission.lease(MODEL, tokens=tokens):
                    pass
            return time.process_time() - t0

        return trio.run(main)

    return run


COST_PAIRS = {
    # The ledger's own cost: the same slots, with and without a token budget beside them.
    "both / slots": (
        ProviderSpec(
            capacity=4,
            long_context_capacity=1,
            context_window_tokens=N_CTX,
            total_context_tokens=KV_TOTAL,
            admit_by="both",
        ),
        ProviderSpec(capacity=4, long_context_capacity=1, context_window_tokens=N_CTX, total_context_tokens=N_CTX),
    ),
    # Tokens alone against capacity alone: the budgeted provider runs long requests too, so the
    # choice index keeps its long heap as well.
    "tokens / capacity": (
        ProviderSpec(capacity=4, context_window_tokens=N_CTX, total_context_tokens=KV_TOTAL, admit_by="tokens"),
        ProviderSpec(capacity=4),
    ),
}


def decision_cost(rounds: int = 15, cycles: int = 20_000) -> dict[str, float]:
    """Each pair's trio lease cycle with a token budget over the one without: the median of
    interleaved rounds of CPU time, the order shuffled in each round."""
    rng = random.Random(0)
    out = {}
    for name, (budgeted, plain) in COST_PAIRS.items():
        contestants = {True: _lease_cycles(budgeted, 1_000), False: _lease_cycles(plain, None)}
        ratios = []
        for _ in range(rounds):
            order = [True, False]
            rng.shuffle(order)
            times = {flag: contestants[flag](cycles) for flag in order}
            ratios.append(times[True] / times[False])
        out[name] = statistics.median(ratios)
    return out


def _row(name: str, r: dict[str, Any]) -> str:
    return (
        f"| {name} | {r['preemptions']} | {r['context_errors']} | {r['goodput']:.3f} | {r['finished']} "
        f"| {r['refused']} | {r['good_long']} / {r['finished_long']} | {r['tokens_per_s']:,.0f} "
        f"| {r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | {r['kv_peak']:.2f} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ledger", description=__doc__)
    parser.add_argument("--full", action="store_true", help="5,000 requests (default 1,500)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--no-cost", action="store_true", help="the replay only, not the decision cost")
    parser.add_argument("--long-share", type=float, default=0.15, help="the share of long requests (0.15)")
    parser.add_argument(
        "--modes",
        type=lambda v: v.split(","),
        default=list(MODES),
        help=f"the engines' modes, comma-separated ({','.join(MODES)})",
    )
    parser.add_argument("--chats", choices=CHATS, default="short", help="the chats' shape (short)")
    parser.add_argument(
        "--queue-timeout", type=float, default=QUEUE_TIMEOUT, help="every arm's queue timeout, s (the TTFT objective)"
    )
    args = parser.parse_args(argv)
    count = 5_000 if args.full else 1_500
    results: dict[str, Any] = {
        "runs": [replay(count, args.seed, mode, args.long_share, args.chats, args.queue_timeout) for mode in args.modes]
    }
    results["decision_cost"] = {} if args.no_cost else decision_cost()
    header = (
        "| arm | preemptions | context errors | goodput (good/s) | finished | refused | long good / finished "
        "| tokens served/s | TTFT p50 s | TTFT p99 s | KV peak |"
    )
    for run in results["runs"]:
        shape = f"long share {args.long_share}, chats {args.chats}, queue timeout {args.queue_timeout:g} s"
        print(f"\nmode {run['mode']}, {run['requests']} requests ({shape}), slots tuned: {run['slots']['best']}")
        print(header)
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        print(_row("ledger", run["ledger"]))
        print(_row(f"slots {run['slots']['best']}", run["slots"]))
        if (harmless := run["slots_harmless"]) is not None and harmless["best"] != run["slots"]["best"]:
            print(_row(f"slots {harmless['best']} (best with no preemption, no context error)", harmless))
        print(_row("reactive", run["reactive"]))
        print(_row("both (ledger + 1 long slot)", run["both"]))
        best_other = max(run["slots"]["goodput"], run["reactive"]["goodput"])
        print(f"ledger goodput / best other: {run['ledger']['goodput'] / best_other:.2f}")
        print(f"ceiling (every request good) / best other: {run['ceiling']:.2f}")
        print(f"both goodput / best other: {run['both']['goodput'] / best_other:.2f}")
    for name, ratio in results["decision_cost"].items():
        print(f"decision cost, trio lease cycle {name}: {ratio:.3f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
