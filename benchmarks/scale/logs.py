"""Reading the scale benchmark's process logs: the Edge's loop and GC lines (:mod:`benchmarks.scale_edge`),
its reload lines, and node-0's send times (:mod:`benchmarks.scale_fleet`)."""

from __future__ import annotations

import itertools
import pathlib
import re
from typing import Any

from benchmarks.harness import Daemon

_LOOP_LINE = re.compile(r"^bench-loop: ([0-9.]+) ([0-9.]+) (\d+) ([0-9.]+) (\S+) ([0-9.]+)", re.M)
_LOOPSUM_LINE = re.compile(r"^bench-loopsum: ([0-9.]+) ([0-9.]+) ([0-9.]+) ([0-9.]+) (\d+) ([0-9.]+) ([0-9.]+)", re.M)
RELOAD_LINE = re.compile(r"config reloaded from \S+ \((.*)\)$", re.M)
_SENT_LINE = re.compile(r"^bench-sent: (.*)$", re.M)


def loop_holds(log: str, since: float, until: float) -> tuple[float, str, int, float]:
    """The Edge loop's longest batch between ``since`` and ``until`` (ms, its longest step's task,
    its steps, the loop thread's CPU ms in it), from :class:`LoopTracer`'s lines."""
    holds = [
        (float(m[2]), m[5], int(m[3]), float(m[6])) for m in _LOOP_LINE.finditer(log) if since <= float(m[1]) <= until
    ]
    return max(holds, default=(0.0, "", 0, 0.0))


def loop_time(log: str, since: float, until: float) -> dict[str, float]:
    """The Edge loop's time between ``since`` and ``until`` (:class:`LoopTracer`'s 0.1 s sums), ms: in
    batches, the loop thread's CPU time, the batches' time it did not run (``waited``: for the GIL or
    for a CPU) and its time runnable but waiting for a CPU (in batches or not)."""
    sums = [m for m in _LOOPSUM_LINE.finditer(log) if since <= float(m[1]) <= until]
    busy, cpu, runq = (sum(float(m[k]) for m in sums) for k in (3, 6, 7))
    return {"busy_ms": busy, "cpu_ms": cpu, "waited_ms": max(0.0, busy - cpu), "runq_ms": runq}


def sent_times(node0_log: pathlib.Path | None) -> list[list[float]]:
    """node-0's send times of each stream it answered so far (its ``bench-sent:`` lines)."""
    text = node0_log.read_text(errors="replace") if node0_log else ""
    return [[float(t) for t in line.split()] for line in _SENT_LINE.findall(text)]


def largest_gap(mark: float, until: float, arrivals: list[float], sent: list[float], log: str) -> dict[str, Any]:
    """The stream's largest gap between ``mark`` and ``until``, taken apart: where the time went.

    ``sent``: node-0's send time of each event (``time.monotonic()``, the same
    clock in every process). ``at_ms`` is when the gap ended, from ``mark``;
    ``sent_ms`` is node-0's own gap between the two events, ``transit_ms`` the
    later event's time from node-0's send to the client's read (the earlier
    one's in brackets: their difference is what the path after node-0 added to
    the gap), ``loop_ms`` the Edge loop's longest batch or late I/O wait that
    ended inside the gap. ``sent_max_ms`` is node-0's own largest gap between
    two events in the window, wherever it fell: how long the fake fleet's
    process itself was held up.
    """
    pairs = [
        (b - a, i) for i, (a, b) in enumerate(itertools.pairwise(arrivals), start=1) if mark and mark <= b <= until
    ]
    gap, i = max(pairs, default=(0.0, 0))
    out: dict[str, Any] = {
        "max_gap_ms": gap * 1000,
        "at_ms": (arrivals[i] - mark) * 1000 if i else None,
        "sent_ms": None,
        "transit_ms": None,
        "transit_before_ms": None,
        "sent_max_ms": None,
    }
    if i and len(sent) == len(arrivals):
        out["sent_max_ms"] = max((sent[j] - sent[j - 1]) * 1000 for _, j in pairs)
        out["sent_ms"] = (sent[i] - sent[i - 1]) * 1000
        out["transit_ms"] = (arrivals[i] - sent[i]) * 1000
        out["transit_before_ms"] = (arrivals[i - 1] - sent[i - 1]) * 1000
    start, end = (arrivals[i - 1], arrivals[i]) if i else (mark, mark)
    out["loop_ms"], out["loop_task"], out["loop_steps"], out["loop_cpu_ms"] = loop_holds(log, start, end + 0.001)
    return out


def reload_seconds(steps: str) -> float:
    """A reload's length from its log line's steps (``read 5425.6 ms, rebuild ...``; the CPU
    figures at the end are not steps)."""
    return sum(float(m[2]) for m in re.finditer(r"(^|, )(?!reader|worker)[a-z +]+ ([0-9.]+) ms", steps)) / 1000


_GC_LINE = re.compile(r"^bench-gc2: (\d+) ([0-9.]+) ([0-9.]+)$", re.M)


def edge_gc(edge: Daemon) -> tuple[int, float, float]:
    """The Edge's full collections so far: count, seconds, longest (from its log)."""
    found = _GC_LINE.findall(edge.log.read_text(errors="replace"))
    if not found:
        return 0, 0.0, 0.0
    count, seconds, longest = found[-1]
    return int(count), float(seconds), float(longest)
