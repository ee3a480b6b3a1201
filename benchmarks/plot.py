"""The end-to-end plot: throughput and p50 latency vs concurrency, one line per path."""

from __future__ import annotations

import pathlib
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display; set before pyplot is imported

import matplotlib.pyplot as plt


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
    """Write a two-panel PNG of ``result["chat"]`` (see :func:`benchmarks.e2e.run`) to ``path``."""
    chat: dict[str, dict[str, dict[str, float]]] = result["chat"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=110)
    for name, by_c in chat.items():
        levels = sorted(by_c, key=int)
        xs = [int(c) for c in levels]
        left.plot(xs, [by_c[c]["rps"] for c in levels], marker="o", label=name)
        right.plot(xs, [by_c[c]["p50_ms"] for c in levels], marker="o", label=name)
    ticks = sorted({int(c) for by_c in chat.values() for c in by_c})
    for axis, label in ((left, "requests/s"), (right, "p50 latency (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(ticks, [str(t) for t in ticks])
        axis.set_xlabel("concurrency (closed-loop workers)")
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    right.set_yscale("log")
    left.set_title("throughput")
    right.set_title("p50 latency")
    fig.suptitle(
        f"non-stream chat completion, loopback, {result.get('cpus', '?')} CPUs shared by load generator and servers"
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
