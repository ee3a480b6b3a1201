"""A request's deadline held across queueing and two failovers, and backend requests let go of ([deadline],
[cancel-upstream]).

An Edge and a Node run as processes; three mock backends run in this process, on loopback, so
their clock is the client's:

- ``gpu0``: nothing listens on its port (every attempt fails ``upstream_unreachable`` at once);
- ``gpu1``: answers 500 (``upstream_5xx``);
- ``gpu2``: never answers (a hung engine), capacity 1.

Model ``deadline`` lists them in that order with ``retry.max_attempts: 3`` and ejection off, so a
request is tried on gpu0, fails over to gpu1, fails over again to gpu2, where it waits in the
queue behind the others (gpu2 holds one at a time) and then hangs until its deadline.

- ``overrun``: ``CLIENTS`` clients in a closed loop send ``REQUESTS`` requests with
  ``X-Request-Timeout`` of ``DEADLINE_S``; the overrun of one is when its answer (a
  ``504 deadline_exceeded``) arrived minus when it was sent minus the deadline. Reported p50, p99
  and max, and p99 as a share of the deadline (the reference). How many passed while queued and
  how many in their third attempt is reported too.
- ``abort``: for the requests that passed in their third attempt, when gpu2 was let go of (the
  Node closed its backend request) minus when their deadline passed; and, one request at a time,
  stream and non-stream, when gpu2 was let go of minus when the client closed its connection.

- ``--peers`` (``make bench-peers``): in the same run, a LiteLLM proxy (:mod:`benchmarks.peers`) in
  front of the same three backends, one model group each (``d0``, ``d1``, ``d2``) with fallbacks
  ``d0 -> d1 -> d2`` and ``timeout`` / ``stream_timeout`` of ``DEADLINE_S`` (the router's and each
  deployment's), no retries within a group, no cooldowns (ejection is off for ours too); the same
  clients send the same requests to ``d0`` with ``"timeout": DEADLINE_S`` in the body (LiteLLM's
  per-request timeout). The same overrun figures; LiteLLM has no queue, so gpu2 takes them all.
"""

from __future__ import annotations

import json
import pathlib
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import trio

from iop_mock import MockBackend, serve_mock_backend

from . import peers
from .harness import (
    BenchmarkFailed,
    Daemon,
    HttpConnection,
    load_average,
    percentile,
    replace_doc_block,
    start_edge_and_node,
)

DEADLINE_S = 0.5
CLIENTS = 4
REQUESTS = 200
DISCONNECTS = 40
MODEL = "deadline"
CHAT_PATH = "/v1/chat/completions"
_BEGIN, _END = "<!-- deadline:begin -->", "<!-- deadline:end -->"

EDGE_YAML = """\
listen: 127.0.0.1:0
node_listen: 127.0.0.1:0
provider_pool: {{max_queue: 1024, queue_timeout_ms: 60000, retry: {{max_attempts: 3}}, outlier: {{consecutive_failures: 0}}}}
nodes:
  - id: bench-node
    token: bench-token
    providers:
      - {{id: gpu0, capacity: 1}}
      - {{id: gpu1, capacity: 1}}
      - {{id: gpu2, capacity: 1}}
models:
  - id: {model}
    min_attempt_ms: 0
    candidates:
      - {{node: bench-node, provider: gpu0, upstream_model: mock}}
      - {{node: bench-node, provider: gpu1, upstream_model: mock}}
      - {{node: bench-node, provider: gpu2, upstream_model: mock}}
"""

NODE_YAML = """\
node_id: bench-node
edge_url: ws://127.0.0.1:{node_port}
token: bench-token
runtime: {{concurrency: 16}}
providers:
  - {{id: gpu0, adapter: openai, base_url: "http://127.0.0.1:{dead_port}/v1", capacity: 1}}
  - {{id: gpu1, adapter: openai, base_url: "http://127.0.0.1:{failing_port}/v1", capacity: 1}}
  - {{id: gpu2, adapter: openai, base_url: "http://127.0.0.1:{hung_port}/v1", capacity: 1}}
"""


def _body(stream: bool) -> bytes:
    return json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "stream": stream}
    ).encode()


def _ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50_ms": round(percentile(ordered, 0.5) * 1000, 1),
        "p99_ms": round(percentile(ordered, 0.99) * 1000, 1),
        "max_ms": round(ordered[-1] * 1000, 1) if ordered else float("nan"),
    }


async def _free_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port: int = listeners[0].socket.getsockname()[1]
    for listener in listeners:
        await listener.aclose()
    return port


async def _closed_loop(port: int, request: bytes, answered: Callable[[float, int, bytes], None]) -> None:
    """``CLIENTS`` clients send ``request`` until ``REQUESTS`` were sent; ``answered(sent, status, body)`` each."""
    remaining = REQUESTS

    async def client() -> None:
        nonlocal remaining
        connection = HttpConnection("127.0.0.1", port)
        while remaining > 0:
            remaining -= 1
            sent = trio.current_time()
            status, body = await connection.request(request)
            answered(sent, status, body)
        await connection.aclose()

    async with trio.open_nursery() as nursery:
        for _ in range(CLIENTS):
            nursery.start_soon(client)


async def _overrun(http_port: int, hung: MockBackend) -> dict[str, Any]:
    request = HttpConnection.build("POST", CHAT_PATH, _body(False), headers={"X-Request-Timeout": f"{DEADLINE_S:g}"})
    overruns: list[float] = []
    by_phase: dict[str, list[float]] = {}
    third_attempt_deadlines: list[float] = []
    where: dict[str, int] = {}
    statuses: dict[int, int] = {}
    aborts_before = len(hung.aborts)

    def answered(sent: float, status: int, body: bytes) -> None:
        overruns.append(trio.current_time() - sent - DEADLINE_S)
        statuses[status] = statuses.get(status, 0) + 1
        message = json.loads(body)["error"]["message"] if status == 504 else body[:80].decode(errors="replace")
        phase = message.rsplit("passed ", 1)[-1]
        where[phase] = where.get(phase, 0) + 1
        by_phase.setdefault(phase, []).append(overruns[-1])
        if phase == "before the first byte":
            third_attempt_deadlines.append(sent + DEADLINE_S)

    await _closed_loop(http_port, request, answered)
    with trio.move_on_after(5):
        while len(hung.aborts) - aborts_before < len(third_attempt_deadlines):
            await trio.sleep(0.01)
    # gpu2 holds one request at a time, let go of at (or after) its deadline: an abort belongs to
    # the latest deadline before it (a run whose deadline passed before its backend request was
    # read has no abort at the backend).
    dues = sorted(third_attempt_deadlines)
    lags = [abort - max(d for d in dues if d <= abort) for abort in hung.aborts[aborts_before:] if dues[0] <= abort]
    figures = _ms(overruns)
    return {
        "requests": REQUESTS,
        "clients": CLIENTS,
        "deadline_ms": DEADLINE_S * 1000,
        "overrun": figures,
        "p99_share_of_deadline": round(figures["p99_ms"] / (DEADLINE_S * 1000), 3),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "passed": where,
        "overrun_by_phase": {phase: _ms(values) for phase, values in by_phase.items()},
        "abort_after_deadline": _ms(lags) | {"samples": len(lags)},
    }


async def _litellm_overrun(port: int, hung: MockBackend) -> dict[str, Any]:
    """The overrun figures of ``_overrun`` through LiteLLM: the deadline as the body's ``timeout``."""
    body = json.loads(_body(False)) | {"model": "d0", "timeout": DEADLINE_S}
    request = HttpConnection.build("POST", CHAT_PATH, json.dumps(body).encode())
    overruns: list[float] = []
    statuses: dict[int, int] = {}
    errors: dict[str, int] = {}
    reached = hung.stats()["total"]

    def answered(sent: float, status: int, answer: bytes) -> None:
        overruns.append(trio.current_time() - sent - DEADLINE_S)
        statuses[status] = statuses.get(status, 0) + 1
        message = str(json.loads(answer).get("error", {}).get("message", "")) if status != 200 else ""
        kind = "ok" if status == 200 else "timeout" if "timeout" in message.lower() else "other"
        errors[kind] = errors.get(kind, 0) + 1

    await _closed_loop(port, request, answered)
    figures = _ms(overruns)
    return {
        "overrun": figures,
        "p99_share_of_deadline": round(figures["p99_ms"] / (DEADLINE_S * 1000), 3),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "error_types": errors,
        "gpu2_reached": hung.stats()["total"] - reached,
    }


async def _disconnects(http_port: int, hung: MockBackend, stream: bool) -> dict[str, Any]:
    """One request at a time, no deadline: the client closes its connection once gpu2 has it."""
    request = HttpConnection.build("POST", CHAT_PATH, _body(stream))
    lags: list[float] = []
    for _ in range(DISCONNECTS):
        aborted = len(hung.aborts)
        started = hung.stats()["total"]
        async with await trio.open_tcp_stream("127.0.0.1", http_port) as client:
            await client.send_all(request)
            while hung.stats()["total"] == started:
                await trio.sleep(0.001)
            closed = trio.current_time()
        while len(hung.aborts) == aborted:
            await trio.sleep(0.001)
        lags.append(hung.aborts[-1] - closed)
    return _ms(lags) | {"samples": len(lags)}


async def _main(workdir: pathlib.Path, with_peers: bool) -> dict[str, Any]:
    failing, hung = MockBackend(fail_status=500), MockBackend(latency=3600.0)  # hung: gpu2, capacity 1
    daemons: list[Daemon] = []
    try:
        async with trio.open_nursery() as nursery:
            failing_port = await nursery.start(serve_mock_backend, failing)
            hung_port = await nursery.start(serve_mock_backend, hung)
            dead_port = await _free_port()
            _, _, http_port, _ = await start_edge_and_node(
                workdir,
                daemons,
                edge_yaml=EDGE_YAML.format(model=MODEL),
                node_yaml=NODE_YAML,
                dead_port=dead_port,
                failing_port=failing_port,
                hung_port=hung_port,
            )
            overrun = await _overrun(http_port, hung)
            disconnect = {
                "non_stream": await _disconnects(http_port, hung, False),
                "stream": await _disconnects(http_port, hung, True),
            }
            peak = hung.stats()["peak_in_flight"]  # ours only: LiteLLM has no queue and no capacity
            litellm: dict[str, Any] | str = "not measured (run `make bench-peers`)"
            if with_peers:
                litellm = await _litellm(workdir, daemons, dead_port, failing_port, hung, hung_port)
            nursery.cancel_scope.cancel()
    finally:
        for daemon in daemons:
            daemon.stop()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return {
        "overrun": overrun,
        "abort_after_disconnect": disconnect,
        "gpu2_peak_in_flight": peak,
        "litellm": litellm,
        "box": f"{when}, {platform.machine()}, load average {load_average()}",
    }


async def _litellm(
    workdir: pathlib.Path, daemons: list[Daemon], dead_port: int, failing_port: int, hung: MockBackend, hung_port: int
) -> dict[str, Any] | str:
    try:
        config = peers.deadline_config(dead_port, failing_port, hung_port, DEADLINE_S)
        port = await peers.start_litellm(0, workdir, daemons, config)
    except (peers.PeerUnavailable, BenchmarkFailed) as exc:
        return f"unavailable here: {exc}".splitlines()[0]
    return {"version": peers.version()} | await _litellm_overrun(port, hung)


def run(runs: int = 1, with_peers: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="iop-bench-deadline-") as workdir:
        result = trio.run(_main, pathlib.Path(workdir), with_peers)
    replace_doc_block(_BEGIN, _END, f"{_BEGIN}\n{table(result)}\n{_END}")
    return result


def table(result: dict[str, Any]) -> str:
    overrun = result["overrun"]
    o, a = overrun["overrun"], overrun["abort_after_deadline"]
    lines = [
        f"Deadline {overrun['deadline_ms']:g} ms, {overrun['requests']} requests from {overrun['clients']} clients,"
        f" each failing over gpu0 (unreachable) -> gpu1 (500) -> gpu2 (hung, capacity 1, queued);"
        f" answers {overrun['statuses']}, passed {overrun['passed']}.",
        "",
        "| figure | p50 | p99 | max | samples |",
        "|---|---|---|---|---|",
        f"| overrun of the client's deadline (answer - send - deadline) | {o['p50_ms']} ms | {o['p99_ms']} ms"
        f" | {o['max_ms']} ms | {overrun['requests']} |",
        f"| backend let go after the deadline (third attempt) | {a['p50_ms']} ms | {a['p99_ms']} ms"
        f" | {a['max_ms']} ms | {a['samples']} |",
    ]
    litellm = result["litellm"]
    if isinstance(litellm, dict):
        lo = litellm["overrun"]
        lines.append(
            f"| LiteLLM {litellm['version']}, same run: overrun of the client's deadline | {lo['p50_ms']} ms"
            f" | {lo['p99_ms']} ms | {lo['max_ms']} ms | {overrun['requests']} |"
        )
        litellm = (
            f"answers {litellm['statuses']} ({litellm['error_types']}), {litellm['gpu2_reached']} reached gpu2,"
            f" p99 overrun / deadline {litellm['p99_share_of_deadline']}"
        )
    for kind, d in result["abort_after_disconnect"].items():
        lines.append(
            f"| backend let go after the client hung up ({kind.replace('_', '-')}) | {d['p50_ms']} ms"
            f" | {d['p99_ms']} ms | {d['max_ms']} ms | {d['samples']} |"
        )
    lines += [
        "",
        f"p99 overrun / deadline: {overrun['p99_share_of_deadline']}. gpu2 (capacity 1) never held more than"
        f" {result['gpu2_peak_in_flight']} request at once. LiteLLM: {litellm}."
        f" One run, {result['box']}.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    outcome = run(with_peers="--peers" in sys.argv[1:])
    print(table(outcome))
    print(json.dumps(outcome, indent=2))
