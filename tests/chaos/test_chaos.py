"""Chaos with real processes: faults under steady streaming load from the ``openai`` client.

Mock backend, Edge and Node run as separate processes (``e2e.harness``) on loopback.
Four worker threads call ``ornith:35b`` and ``ornith-fast`` (both on the
capacity-2 provider ``node-a/gpu0``) with the official sync ``openai`` client,
mostly streaming, without pause, while one fault is applied and heals:

- ``node_sigkill``: SIGKILL the node, start a new one;
- ``node_sigstop``: SIGSTOP the node past the heartbeat timeout (800 ms), then SIGCONT;
- ``edge_restart``: SIGKILL the Edge and start it again on the same ports while the
  node keeps reconnecting;
- ``client_aborts``: half of the streams are abandoned at a random chunk.

Every request is bounded by the client's read timeout. After the fault heals and
the load stops: no request hung, every request ended with a success or an
explicit error (an HTTP status, an SSE error event, or a refused/broken
connection while the Edge was down), no stream ended silently short, fresh
requests succeed, ``/status`` drains to 0 and the backend's peak concurrency
never exceeded the provider capacity. Each test prints its per-fault counts and
the RNG seed (``IOP_CHAOS_SEED`` replays one). [capacity-smoke]
[disconnect-exclusion] [disconnect-queue-resolution] [lease-lifecycle]
"""

from __future__ import annotations

import collections
import os
import random
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import openai
import pytest
import trio

from e2e.harness import BIG, FAST, NODE_REGISTERED, Stack, drained, edge_config, node_config, open_stack, provider

CAPACITY = 2
WORKERS = 4
REQUEST_TIMEOUT = 8.0
"""Seconds without a byte before a request counts as hung (the client's read timeout)."""
HEARTBEAT_TIMEOUT_MS = 800
LOAD_BEFORE = 1.0
"""Seconds of load before the fault."""
LOAD_AFTER = 1.5
"""Seconds of load after the fault healed."""
DRAIN_TIMEOUT = 10.0
ERROR_PAUSE = 0.05
"""Seconds a worker pauses after an error (a client would back off; keeps the counts readable)."""

SEED = int(os.environ.get("IOP_CHAOS_SEED", random.SystemRandom().randrange(2**32)))

Outcome = str
"""``ok``, ``aborted``, ``http <status>``, ``sse_error``, ``connection``, ``truncated`` or ``hang``."""
EXPLICIT_PREFIXES = ("http ", "sse_error", "connection")


def free_port() -> int:
    """A port that was free a moment ago (bound to port 0 and closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def one_request(client: openai.OpenAI, rng: random.Random, abort_probability: float) -> Outcome:
    """One chat completion; returns how it ended (never raises for a request failure)."""
    model = rng.choice((BIG, FAST))
    messages = [{"role": "user", "content": "hello"}]
    try:
        if rng.random() < 0.2:
            client.chat.completions.create(model=model, messages=messages, max_tokens=6)  # type: ignore[arg-type]
            return "ok"
        abort_at = rng.randrange(0, 8) if rng.random() < abort_probability else None
        finished = False
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=6, stream=True)  # type: ignore[arg-type]
        with stream:
            for index, chunk in enumerate(stream):
                if abort_at is not None and index >= abort_at:
                    return "aborted"  # leaving the block closes the response mid-stream
                finished = finished or any(choice.finish_reason for choice in chunk.choices)
        return "ok" if finished else "truncated"
    except (openai.APITimeoutError, httpx.TimeoutException):
        return "hang"
    except openai.APIStatusError as exc:
        return f"http {exc.status_code}"
    except (openai.APIConnectionError, httpx.TransportError):
        return "connection"
    except openai.APIError:  # an SSE error event mid-stream
        return "sse_error"


class Load:
    """Worker threads sending requests back to back until :meth:`stop`."""

    def __init__(self, base_url: str, seed: int, abort_probability: float) -> None:
        self.base_url = base_url
        self.seed = seed
        self.abort_probability = abort_probability
        self.outcomes: collections.Counter[Outcome] = collections.Counter()
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def worker(self, index: int) -> None:
        rng = random.Random(self.seed * 100 + index)
        with openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key="chaos", max_retries=0, timeout=REQUEST_TIMEOUT
        ) as client:
            while not self._stop.is_set():
                outcome = one_request(client, rng, self.abort_probability)
                with self._lock:
                    self.outcomes[outcome] += 1
                if outcome.startswith(EXPLICIT_PREFIXES):
                    time.sleep(ERROR_PAUSE)

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        """Run the workers until :meth:`stop` (each finishes its request first)."""
        async with trio.open_nursery() as nursery:
            for index in range(WORKERS):
                nursery.start_soon(trio.to_thread.run_sync, self.worker, index)


async def start_stack(stack: Stack, http_port: int, node_port: int) -> None:
    await stack.start_backend(latency_ms=20, tokens_per_second=100)
    await stack.start_edge(chaos_edge_config(http_port, node_port))
    await stack.start_node(node_config(providers={"gpu0": CAPACITY}, heartbeat_interval_ms=200))


def chaos_edge_config(http_port: int, node_port: int) -> dict[str, object]:
    return edge_config(
        providers={"gpu0": CAPACITY},
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
        max_queue=16,
        queue_timeout_ms=3_000,
        listen=f"127.0.0.1:{http_port}",
        node_listen=f"127.0.0.1:{node_port}",
    )


# ------------------------------------------------------------------ faults


async def node_sigkill(stack: Stack, ports: tuple[int, int]) -> None:
    """SIGKILL: the kernel closes the node's sockets without a WebSocket close; then a new node."""
    assert stack.node is not None
    stack.node.kill()
    await stack.node.wait()
    await stack.wait_status(lambda s: not provider(s, "gpu0")["connected"])
    await stack.start_node(node_config(providers={"gpu0": CAPACITY}, heartbeat_interval_ms=200))


async def node_sigstop(stack: Stack, ports: tuple[int, int]) -> None:
    """SIGSTOP past the heartbeat timeout (the node vanishes with its sockets open), then SIGCONT."""
    assert stack.node is not None
    stack.node.sigstop()
    try:
        await stack.wait_status(lambda s: not provider(s, "gpu0")["connected"], timeout=5 * HEARTBEAT_TIMEOUT_MS / 1000)
        await trio.sleep(HEARTBEAT_TIMEOUT_MS / 1000)  # requests meet an offline provider meanwhile
    finally:
        stack.node.sigcont()
    await stack.node.wait_for_line(NODE_REGISTERED, count=2)


async def edge_restart(stack: Stack, ports: tuple[int, int]) -> None:
    """SIGKILL the Edge; start it again on the same ports while the node keeps reconnecting."""
    assert stack.edge is not None and stack.node is not None
    stack.edge.kill()
    await stack.edge.wait()
    await trio.sleep(0.3)  # clients meet a refused connection, the node backs off
    await stack.start_edge(chaos_edge_config(*ports))
    await stack.node.wait_for_line(NODE_REGISTERED, count=2)


async def client_aborts(stack: Stack, ports: tuple[int, int]) -> None:
    """No process fault: the load itself abandons half of its streams at a random chunk."""
    await trio.sleep(LOAD_AFTER)


FAULTS: dict[str, tuple[Callable[[Stack, tuple[int, int]], Awaitable[None]], float]] = {
    "node_sigkill": (node_sigkill, 0.1),
    "node_sigstop": (node_sigstop, 0.1),
    "edge_restart": (edge_restart, 0.1),
    "client_aborts": (client_aborts, 0.5),
}
"""fault name -> (the fault, the probability that a stream is abandoned at a random chunk)."""


@pytest.mark.req("capacity-smoke", "disconnect-exclusion", "disconnect-queue-resolution", "lease-lifecycle")
@pytest.mark.parametrize("fault", list(FAULTS))
async def test_fault_heals_without_hangs_or_leaks(tmp_path: Path, fault: str) -> None:
    """Under load, ``fault`` happens and heals: hangs == 0, every request ended explicitly,
    fresh requests succeed, /status drains to 0, backend peak <= capacity."""
    apply, abort_probability = FAULTS[fault]
    seed = SEED + list(FAULTS).index(fault)
    print(f"\nchaos {fault}: seed {seed} (IOP_CHAOS_SEED={SEED} replays this run)")
    ports = (free_port(), free_port())
    with trio.fail_after(60):
        async with open_stack(tmp_path) as stack:
            await start_stack(stack, *ports)
            (await stack.http.post(f"http://127.0.0.1:{stack.backend_port}/stats/reset")).raise_for_status()
            load = Load(stack.base_url, seed, abort_probability)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(load.run)
                await trio.sleep(LOAD_BEFORE)
                await apply(stack, ports)
                await trio.sleep(LOAD_AFTER)
                load.stop()
            outcomes = load.outcomes

            # healed: fresh requests (stream and not) succeed
            rng = random.Random(seed)
            with openai.OpenAI(
                base_url=f"{stack.base_url}/v1", api_key="chaos", max_retries=0, timeout=REQUEST_TIMEOUT
            ) as client:
                fresh = [await trio.to_thread.run_sync(one_request, client, rng, 0.0) for _ in range(4)]
            status = await stack.wait_status(drained, timeout=DRAIN_TIMEOUT)
            stats = await stack.backend_stats()

    explicit = {k: v for k, v in outcomes.items() if k.startswith(EXPLICIT_PREFIXES)}
    print(
        f"chaos {fault}: requests {sum(outcomes.values())}: ok {outcomes['ok']}, "
        f"aborted {outcomes['aborted']}, explicit errors {sum(explicit.values())} {dict(sorted(explicit.items()))}, "
        f"truncated {outcomes['truncated']}, hangs {outcomes['hang']}; "
        f"backend peak_in_flight {stats['peak_in_flight']} (capacity {CAPACITY}), total {stats['total']}"
    )
    assert outcomes["hang"] == 0, outcomes
    assert outcomes["truncated"] == 0, outcomes
    assert set(outcomes) <= {"ok", "aborted", *explicit}, outcomes
    assert outcomes["ok"] > 0
    assert fresh == ["ok"] * 4, fresh
    assert provider(status, "gpu0")["connected"]
    assert stats["peak_in_flight"] <= CAPACITY, stats
