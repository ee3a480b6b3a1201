"""The Node's cost of reading an engine's view [token-ledger]: ``python -m benchmarks.engine_view [--runs 5]``.

A provider with traffic is probed every second (``interval_ms`` 1000), and with the
``vllm`` or ``llama_cpp`` probe each probe reads the engine's view from the answer: vLLM's
``/metrics`` page (Prometheus text) or llama.cpp's ``/slots`` (JSON). This measures the
CPU of :func:`iop_node.health.readiness.judge` on such answers, in this process:

- **vLLM**: a page shaped like vLLM's own (built with ``prometheus_client``): the four
  families the view reads among the counters and histograms vLLM exports (latencies, token
  counts, request parameters, cache hits: 25-30 buckets each) and the process and
  garbage-collector families, with the labels vLLM sets; against a reference in the same
  run: the library parsing the whole page, as the probe did before it kept only the
  lines it reads.
- **llama.cpp**: ``/slots`` with 4 and 16 slots, half of them processing.

CPU time (``time.process_time``) of ``--probes`` calls, median of ``--runs`` interleaved
rounds; per probe, and as a share of one core for a Node whose 8 providers are each
probed every second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from iop_node.health.readiness import VLLM_NAMES, judge

PROVIDERS = 8  # a Node's providers, each probed every second
LABELS = {"model_name": "Qwen/Qwen3-32B", "engine": "0"}
HISTOGRAMS = (
    "vllm:iteration_tokens_total",
    "vllm:time_to_first_token_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_max_num_generation_tokens",
    "vllm:request_params_n",
    "vllm:request_params_max_tokens",
)
COUNTERS = (
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
)


def vllm_page() -> bytes:
    """A ``/metrics`` page shaped like vLLM's (see the module docstring)."""
    registry = CollectorRegistry()
    names = list(LABELS)
    for name, value in (("vllm:num_requests_running", 12), ("vllm:num_requests_waiting", 3)):
        Gauge(name, "Number of requests.", names, registry=registry).labels(**LABELS).set(value)
    Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", names, registry=registry).labels(
        **LABELS
    ).set(0.41)
    for name in COUNTERS:
        Counter(name, "Number of tokens or events.", names, registry=registry).labels(**LABELS).inc(1234)
    success = Counter("vllm:request_success", "Count of successfully processed requests.", [*names, "finished_reason"])
    registry.register(success)
    for reason in ("stop", "length", "abort"):
        success.labels(**LABELS, finished_reason=reason).inc(10)
    buckets = [0.001 * 1.6**k for k in range(28)]
    for name in HISTOGRAMS:
        histogram = Histogram(name, "Histogram of a request's figure.", names, buckets=buckets, registry=registry)
        for value in (0.02, 0.3, 1.5, 9.0):
            histogram.labels(**LABELS).observe(value)
    for collector in (ProcessCollector, PlatformCollector, GCCollector):
        collector(registry=registry)
    return generate_latest(registry)


def slots_answer(slots: int) -> bytes:
    """llama.cpp's ``/slots`` with ``slots`` slots, every other one processing."""
    return json.dumps(
        [
            {
                "id": i,
                "n_ctx": 8192,
                "is_processing": i % 2 == 0,
                "n_prompt_tokens": 1500,
                "next_token": [{"has_next_token": True, "n_remain": 300, "n_decoded": 212}],
                "params": {"n_predict": 512, "temperature": 0.8, "top_p": 0.95, "stream": True},
            }
            for i in range(slots)
        ]
    ).encode()


def _whole_page(page: bytes) -> float:
    """The reference: the library parses the whole page; the same families read."""
    total = 0.0
    for family in text_string_to_metric_families(page.decode("utf-8", "replace")):
        if family.name in VLLM_NAMES:
            total += sum(s.value for s in family.samples if not s.name.endswith("_created"))
    return total


def _us_per_call(call: Callable[[], object], probes: int) -> float:
    started = time.process_time()
    for _ in range(probes):
        call()
    return (time.process_time() - started) / probes * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine_view", description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--probes", type=int, default=300)
    args = parser.parse_args(argv)
    page = vllm_page()
    vllm = judge("vllm", ((200, b""), (200, page)))
    assert vllm.engine is not None and vllm.engine.kv_use == 0.41 and vllm.engine.preemptions == 1234, vllm
    cases: dict[str, Callable[[], object]] = {
        "vllm /metrics, the lines read": lambda: judge("vllm", ((200, b""), (200, page))),
        "vllm /metrics, the whole page parsed (reference)": lambda: _whole_page(page),
    }
    for slots in (4, 16):
        answer = slots_answer(slots)
        cases[f"llama.cpp /slots, {slots} slots"] = lambda answer=answer: judge(
            "llama_cpp", ((200, b""), (200, answer))
        )
    rounds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.runs):
        for name, call in cases.items():
            rounds[name].append(_us_per_call(call, args.probes))
    lines_in_page = page.count(b"\n")
    print(f"vllm page: {len(page):,} bytes, {lines_in_page:,} lines; median of {args.runs} rounds")
    for name, values in rounds.items():
        us = statistics.median(values)
        print(
            f"  {name}: {us:,.1f} us a probe; {PROVIDERS} providers each second: {us * PROVIDERS / 1e6:.3%} of a core"
        )
    lines, whole = (statistics.median(rounds[name]) for name in list(cases)[:2])
    print(f"  the lines read / the whole page: {lines / whole:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
