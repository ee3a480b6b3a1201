"""A closed-loop HTTP/1.1 load generator on trio sockets (:class:`benchmarks.harness.HttpConnection`), run as its own process.

``python -m benchmarks.loadgen`` reads one JSON command per line on stdin and answers
each with one JSON result line on stdout, so the end-to-end benchmark starts it once
and keeps its CPU out of the server processes. A command::

    {"port": 8080, "path": "/v1/chat/completions", "body": {...},
     "concurrency": 8, "duration": 2.0, "warmup": 0.5, "stream": false}

Each of ``concurrency`` workers owns ONE keep-alive connection and sends the next
request as soon as the previous answer is complete (closed loop). Why a client of our own:
on this 2-core machine the generator shares the CPU with the servers it measures;
a minimal client (send the prebuilt request bytes encoded by :mod:`iop_http`, parse
the answer once with iop_http.AnswerParser (llhttp), count SSE ``data:`` events) costs a few
microseconds per request, where a full HTTP client costs tens. One pool shared by
all workers is also what collapsed an httpx measurement from ~2,200 to ~230
requests/s at 64 concurrency; here no connection is ever shared.

Only answers completed inside the measurement window (after ``warmup``, for
``duration`` seconds) count; latency is from the first byte sent to the last byte
received. A non-200 answer counts as an error, not as a request, and so does a stream that
does not end with ``data: [DONE]`` (status ``0`` in ``error_statuses``).
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from typing import Any

import trio

from .harness import HttpConnection, ProtocolViolation, percentile

__all__ = ["fleet", "measure"]


async def measure(
    *,
    port: int,
    path: str,
    body: dict[str, Any] | None,
    concurrency: int,
    duration: float,
    warmup: float,
    stream: bool = False,
    host: str = "127.0.0.1",
    headers: dict[str, str] | None = None,
    method: str = "POST",
) -> dict[str, Any]:
    """Run one closed-loop measurement and return its figures.

    Checkpoints; takes ``warmup + duration`` seconds plus the last answers in flight.

    Returns:
        ``requests``, ``errors``, ``rps``, ``p50_ms``, ``p99_ms`` (answers completed in
        the measurement window), ``chunks`` (SSE events without ``[DONE]``; each stream's
        events are taken as spread evenly over its duration and counted by their share
        inside the window) and ``chunks_per_s``.
    """
    payload = None if body is None else json.dumps(body).encode()
    raw = HttpConnection.build(method, path, payload, host, headers)
    clock = time.perf_counter
    latencies: list[float] = []
    counts: dict[str, float] = {"errors": 0, "chunks": 0.0, "stream_events": 0}
    statuses: dict[int, int] = {}
    begin = clock() + warmup
    end = begin + duration

    async def worker() -> None:
        connection = HttpConnection(host, port)
        try:
            while True:
                t0 = clock()
                if t0 >= end:
                    return
                status, data = await connection.request(raw)
                t1 = clock()
                if stream and status == 200 and not data.rstrip().endswith(b"data: [DONE]"):
                    status = 0  # a stream that ended with an error event, or cut short
                if stream and status == 200:
                    # A stream's chunks are spread over [t0, t1]; count the share that
                    # fell inside the window, so a stream longer than the window counts.
                    overlap = min(t1, end) - max(t0, begin)
                    if overlap > 0:
                        events = data.count(b"\ndata: ") + data.startswith(b"data: ")
                        events -= data.count(b"data: [DONE]")
                        counts["chunks"] += events * overlap / (t1 - t0)
                if not begin <= t1 < end:
                    continue
                if status != 200:
                    counts["errors"] += 1
                    statuses[status] = statuses.get(status, 0) + 1
                    continue
                latencies.append(t1 - t0)
                if stream:
                    counts["stream_events"] += data.count(b"\ndata: ") + data.startswith(b"data: ")
                    counts["stream_events"] -= data.count(b"data: [DONE]")
        finally:
            await connection.aclose()

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    latencies.sort()
    return {
        "concurrency": concurrency,
        "duration": duration,
        "requests": len(latencies),
        "errors": int(counts["errors"]),
        "error_statuses": {str(k): v for k, v in statuses.items()},
        "rps": len(latencies) / duration,
        "p50_ms": percentile(latencies, 0.50) * 1000,
        "p99_ms": percentile(latencies, 0.99) * 1000,
        "chunks": round(counts["chunks"]),
        "chunks_per_s": counts["chunks"] / duration,
        "events_per_stream": counts["stream_events"] / len(latencies) if stream and latencies else 0.0,
    }


async def fleet(
    *,
    port: int,
    path: str,
    body: dict[str, Any],
    streams: int,
    ramp: float,
    duration: float,
    tail: float = 10.0,
    host: str = "127.0.0.1",
) -> dict[str, Any]:
    """Hold ``streams`` concurrent streams, each on its own keep-alive socket, and time every event.

    Checkpoints; takes ``ramp + duration`` seconds plus the streams still running at the
    end, each read to its end but for at most ``tail`` more seconds (then cut). Worker
    ``i`` starts ``i / streams * ramp`` seconds in and sends the next request as soon as
    its stream ended. Every read is timestamped; the SSE events it completes (``data:``
    lines, ``[DONE]`` excluded) take that time.

    Returns:
        ``tokens`` (all events), ``window_tokens`` (events in ``[ramp, ramp + duration]``),
        ``streams_done``, ``streams_cut``, ``errors``, ``error_statuses`` (what a failed
        answer said) and, over every completed stream, the lists ``ttft`` (seconds from
        send to first event), ``span`` (first to last event) and ``gaps`` (seconds between
        consecutive event arrivals of a stream).
    """
    raw = HttpConnection.build("POST", path, json.dumps(body).encode(), host)
    clock = trio.current_time
    start = clock()
    begin, end = start + ramp, start + ramp + duration
    out: dict[str, Any] = {"streams_done": 0, "streams_cut": 0, "errors": 0}
    every: list[list[float]] = []
    ttft: list[float] = []
    span: list[float] = []
    gaps: list[float] = []
    statuses: dict[str, int] = {}

    async def worker(index: int) -> None:
        await trio.sleep_until(start + index / streams * ramp)
        connection = HttpConnection(host, port)
        try:
            await connection.connect()
            while clock() < end:
                arrivals: list[float] = []
                every.append(arrivals)
                sent = clock()
                try:
                    problem = await _one_stream(connection, raw, arrivals)
                except trio.Cancelled:
                    out["streams_cut"] += 1
                    raise
                if problem is not None:
                    out["errors"] += 1
                    statuses[problem] = statuses.get(problem, 0) + 1
                    return
                out["streams_done"] += 1
                if arrivals:
                    ttft.append(arrivals[0] - sent)
                    span.append(arrivals[-1] - arrivals[0])
                    gaps.extend(b - a for a, b in itertools.pairwise(arrivals))
        finally:
            await connection.aclose()

    with trio.move_on_at(end + tail):
        async with trio.open_nursery() as nursery:
            for index in range(streams):
                nursery.start_soon(worker, index)
    return {
        **out,
        "tokens": sum(len(a) for a in every),
        "window_tokens": sum(1 for a in every for t in a if begin <= t < end),
        "ttft": ttft,
        "span": span,
        "gaps": gaps,
        "window": duration,
        "error_statuses": statuses,
    }


async def _one_stream(connection: HttpConnection, raw: bytes, arrivals: list[float]) -> str | None:
    """Send one stream request and read its answer to its end, timing each event into ``arrivals``.

    Returns None, or what went wrong. The body comes as the reads bring it (iop_http.AnswerParser
    removes the chunk framing); an event counts, at the time of its read, once its
    ``data:`` line is whole.
    """
    clock = trio.current_time
    sent = clock()
    line = bytearray()  # the start of a line not yet whole
    first = bytearray()  # the start of the body, for an error's report
    done = False

    def on_body(data: bytes) -> None:
        nonlocal done
        now = clock()
        if len(first) < 200:
            first.extend(data[: 200 - len(first)])
        line.extend(data)
        last = line.rfind(b"\n")
        if last < 0:
            return
        lines = bytes(line[: last + 1])
        del line[: last + 1]
        finished = b"data: [DONE]" in lines
        arrivals.extend([now] * (lines.count(b"data: ") - finished))
        done = done or finished

    try:
        status, _ = await connection.request(raw, on_body)
    except (ProtocolViolation, OSError, trio.BrokenResourceError):
        return f"connection closed after {len(arrivals)} events, {clock() - sent:.0f} s"
    if status != 200:
        return f"HTTP {status} {bytes(first).decode(errors='replace')}"
    return None if done else f"stream ended without [DONE] after {len(arrivals)} events"


async def _serve_commands() -> None:
    stdin = trio.wrap_file(sys.stdin)
    async for line in stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        kind = command.pop("kind", "closed_loop")
        try:
            result = await (fleet(**command) if kind == "fleet" else measure(**command))
        except Exception as exc:  # report it to the driver instead of dying silently
            result = {"failed": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(result), flush=True)


def main() -> None:
    """Serve measurement commands from stdin until it closes."""
    trio.run(_serve_commands)


if __name__ == "__main__":
    main()
