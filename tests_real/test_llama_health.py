"""llama.cpp's server behind real Edge and Node processes with the Node's health on ([health-probe]):
killed and restarted, stopped with SIGSTOP (hung), and not loaded yet.

``ornith:35b`` lists ``node-a/gpu0`` (a llama.cpp server of the test's own, Gemma 3 270M) then
``node-a/gpu1`` (the mock backend: the healthy second candidate), gpu0 with the higher priority so
that a request goes there whenever it admits. gpu0's readiness probe is the
``openai`` one, ``GET /v1/models``: llama-cpp-python's server has no ``/health`` (llama.cpp's own
``llama-server`` has, which the ``llama_cpp`` probe asks), and it binds its port only once the
model is loaded, so "loading" is seen as a refused connection, never as a 503. The stall watchdog
is on. The Edge ejects for five failures in a row only, so every ejection here comes from the
node's reports (``not_ready``, ``stalled``), not from passive failures.

Each wait is for a condition, bounded generously; the elapsed times are printed (``-s``) for the
record, never asserted.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from llama_server import free_port, llama_answers, llama_ready, start_llama

from e2e.harness import (
    BIG,
    POLL_INTERVAL,
    Daemon,
    Requests,
    Stack,
    drained,
    edge_config,
    node_config,
    open_stack,
    provider,
    sse_error_code,
)

pytestmark = [pytest.mark.req("health-probe"), pytest.mark.timeout(900)]

TEST_TIMEOUT = 840.0
"""Seconds per test (each starts llama.cpp's server up to four times on a loaded 2-core box)."""
WAIT = 120.0
"""Seconds any one condition has to come true."""
HEALTH: dict[str, Any] = {
    "interval_ms": 200,
    "no_traffic_interval_ms": 200,
    "timeout_ms": 3000,
    "unhealthy_threshold": 2,
    "stall_ms": 4000,
}
"""gpu0's health. The probe's ``timeout_ms`` is long because llama-cpp-python answers
``/v1/models`` only between two completions (one lock for both)."""
FAILURES_TO_EJECT = 5
LONG = {"max_tokens": 1500, "logit_bias": {"1": -100, "106": -100}}
"""A stream that outlives the test's fault: Gemma's ``<eos>`` and ``<end_of_turn>`` are banned."""


@asynccontextmanager
async def llama_and_mock(tmp_path: Path, port: int, *, capacity: int = 1) -> AsyncIterator[Stack]:
    """A mock backend, an Edge and a Node: gpu0 -> llama.cpp on ``port`` (not started here), gpu1 -> the mock."""
    async with open_stack(tmp_path) as stack:
        await stack.http.aclose()
        stack.http = httpx.AsyncClient(timeout=WAIT)
        await stack.start_backend(latency_ms=0)
        config = edge_config(providers={"gpu0": capacity, "gpu1": 1}, models={BIG: ["gpu0", "gpu1"]})
        config["provider_pool"]["outlier"] = {"consecutive_failures": FAILURES_TO_EJECT, "base_ejection_ms": 2000}
        config["nodes"][0]["providers"][0]["priority"] = 1  # gpu0 first while it admits, however loaded
        await stack.start_edge(config)
        node: dict[str, Any] = node_config(providers={"gpu0": capacity, "gpu1": 1})
        node["providers"][0] |= {"base_url": f"http://127.0.0.1:{port}/v1", "health": HEALTH}
        await stack.start_node(node)
        yield stack


async def until(
    stack: Stack, what: str, predicate: Callable[[dict[str, Any]], bool], *, since: float | None = None
) -> dict[str, Any]:
    """Wait for ``predicate`` on ``/status``; print how long it took (from ``since``, a
    ``trio.current_time()``, when given: the fault)."""
    start = trio.current_time() if since is None else since
    status = await stack.wait_status(predicate, timeout=WAIT)
    print(f"{what}: {trio.current_time() - start:.2f} s")
    return status


def gpu0_out(status: dict[str, Any]) -> bool:
    return provider(status, "gpu0")["health"] == "ejected"


def gpu0_back(status: dict[str, Any]) -> bool:
    """gpu0 online, its node's last report ``ready`` (none yet: the Edge assumes ready)."""
    gpu0 = provider(status, "gpu0")
    return gpu0["health"] == "online" and gpu0["reported"] in ("", "ready")


def not_ready(status: dict[str, Any]) -> bool:
    return gpu0_out(status) and provider(status, "gpu0")["reported"] == "not_ready"


async def served_by(stack: Stack, *, stream: bool = False) -> tuple[str, str]:
    """One short request for ``ornith:35b``: (provider, attempts) of its 200."""
    answer = await stack.chat(BIG, stream=stream, max_tokens=4)
    assert answer.status_code == 200, answer.text
    if stream:
        assert sse_error_code(answer) is None
    return answer.headers["x-iop-provider"], answer.headers["x-iop-attempts"]


def unreachable(status: dict[str, Any]) -> bool:
    gpu0 = provider(status, "gpu0")
    return bool(gpu0["report_reason"].startswith("unreachable"))


async def test_a_killed_backend_is_ejected_and_back_once_restarted(tmp_path: Path, llama_model: Path) -> None:
    """SIGKILL mid-stream: the stream ends with a typed error; gpu0 is ejected by the probe's
    ``not_ready`` (connection refused) and requests go to gpu1; restarted on the same port: probe
    ready, gpu0 online and serving, nothing held. The same with a non-stream request in flight (it
    is retried on gpu1: no byte had gone out) and with the server killed between runs."""
    port = free_port()
    with trio.fail_after(TEST_TIMEOUT):
        async with llama_and_mock(tmp_path, port) as stack:
            llama = await start_llama(stack, llama_model, port)
            await until(stack, "gpu0 ready", gpu0_back)
            assert await served_by(stack) == ("node-a/gpu0", "1")

            async with trio.open_nursery() as nursery:
                requests = Requests(stack, nursery)
                await requests.streaming("cut", BIG, **LONG)
                llama.kill()
                killed = trio.current_time()
            cut = requests.answers["cut"]
            assert cut.status_code == 200 and cut.headers["x-iop-provider"] == "node-a/gpu0"
            assert sse_error_code(cut) == "upstream_error"  # after the first byte: no retry
            llama = await ejected_then_back(stack, llama_model, port, "killed mid-stream", killed)

            async with trio.open_nursery() as nursery:
                requests = Requests(stack, nursery)
                await requests.running("retried", BIG, stream=False, **LONG)
                llama.kill()
                killed = trio.current_time()
            retried = requests.answers["retried"]
            assert retried.status_code == 200, retried.text
            assert (retried.headers["x-iop-provider"], retried.headers["x-iop-attempts"]) == ("node-a/gpu1", "2")
            llama = await ejected_then_back(stack, llama_model, port, "killed mid-request", killed)

            llama.kill()  # between runs: nothing in flight
            await ejected_then_back(stack, llama_model, port, "killed idle", trio.current_time())


async def ejected_then_back(stack: Stack, model: Path, port: int, fault: str, since: float) -> Daemon:
    """After llama.cpp's server was killed: gpu0 ejected ``not_ready`` (connection refused), requests
    served by gpu1; the server restarted on ``port`` (returned): gpu0 online, serving, nothing held."""
    status = await until(stack, f"{fault} -> ejected (not_ready)", not_ready, since=since)
    assert unreachable(status) and provider(status, "gpu0")["failures"] < FAILURES_TO_EJECT
    assert await served_by(stack) == ("node-a/gpu1", "1")
    assert await served_by(stack, stream=True) == ("node-a/gpu1", "1")
    llama = await start_llama(stack, model, port)
    await until(stack, f"{fault}, restarted and answering -> online", gpu0_back)
    assert await served_by(stack, stream=True) == ("node-a/gpu0", "1")
    assert await served_by(stack) == ("node-a/gpu0", "1")
    status = await until(stack, "drained", drained)
    assert provider(status, "gpu0")["effective_capacity"] == 1
    return llama


async def test_a_stopped_backend_is_ejected_its_new_runs_served_elsewhere(tmp_path: Path, llama_model: Path) -> None:
    """SIGSTOP with a stream running: the node's watchdog finds the stall (the probe later finds no
    answer); the running stream ends ``stream_stalled``, a stream granted to gpu0 after the stop is
    cut before its first byte and served by gpu1, no client failure; SIGCONT: ready, online, used."""
    port = free_port()
    with trio.fail_after(TEST_TIMEOUT):
        async with llama_and_mock(tmp_path, port, capacity=2) as stack:
            llama = await start_llama(stack, llama_model, port)
            await until(stack, "gpu0 ready", gpu0_back)
            async with trio.open_nursery() as nursery:
                requests = Requests(stack, nursery)
                await requests.streaming("running", BIG, **LONG)
                llama.sigstop()
                stopped = trio.current_time()
                try:
                    await requests.running("after", BIG, stream=True, max_tokens=4)
                    await requests.answered(timeout=WAIT)
                    status = await until(stack, "stopped -> ejected", gpu0_out, since=stopped)
                    assert provider(status, "gpu0")["failures"] < FAILURES_TO_EJECT
                    status = await until(stack, "stopped -> probe not_ready", not_ready, since=stopped)
                    assert provider(status, "gpu0")["report_reason"].startswith("no answer within")
                    assert await served_by(stack, stream=True) == ("node-a/gpu1", "1")
                finally:
                    llama.sigcont()
                    continued = trio.current_time()
            running, after = requests.answers["running"], requests.answers["after"]
            assert running.headers["x-iop-provider"] == "node-a/gpu0"
            assert sse_error_code(running) == "stream_stalled"
            assert (after.status_code, sse_error_code(after)) == (200, None)
            assert (after.headers["x-iop-provider"], after.headers["x-iop-attempts"]) == ("node-a/gpu1", "2")

            await until(stack, "continued -> online", gpu0_back, since=continued)
            assert await served_by(stack, stream=True) == ("node-a/gpu0", "1")
            status = await until(stack, "drained", drained)
            assert provider(status, "gpu0")["effective_capacity"] == 2


async def test_a_backend_still_loading_is_held_out_until_ready(tmp_path: Path, llama_model: Path) -> None:
    """gpu0's server not started, then loading (its port opens only once the model is loaded): gpu0
    stays ejected ``not_ready`` and every request answered meanwhile was served by gpu1; loaded:
    ready, online, served by gpu0."""
    port = free_port()
    with trio.fail_after(TEST_TIMEOUT):
        async with llama_and_mock(tmp_path, port) as stack:
            status = await until(stack, "not started -> not_ready", not_ready)
            assert unreachable(status)
            llama = await start_llama(stack, llama_model, port, wait=False)
            during_load: list[tuple[str, str]] = []
            while not await llama_answers(stack, port):
                assert llama.running, llama.stderr()[-4000:]
                served = await served_by(stack)
                status = await stack.status()
                if not await llama_answers(stack, port):  # not loaded for the whole request and status
                    during_load.append(served)
                    assert not_ready(status)
                await trio.sleep(POLL_INTERVAL)
            await llama_ready(stack, llama, port)
            loaded = trio.current_time()
            assert during_load and set(during_load) == {("node-a/gpu1", "1")}
            print(f"requests served by gpu1 while gpu0 loaded: {len(during_load)}")
            await until(stack, "answering -> online", gpu0_back, since=loaded)
            assert await served_by(stack) == ("node-a/gpu0", "1")
            assert drained(await until(stack, "drained", drained))


async def test_a_stream_is_whole_while_the_probe_waits(tmp_path: Path, llama_model: Path) -> None:
    """A stream of 16 tokens on gpu0 while the node probes it every 200 ms: llama-cpp-python holds
    the probe until the stream ends, and the stream ends whole (``finish_reason: length``), not cut
    short by the waiting probe (its ``--interrupt_requests false``); then gpu0 is ready, nothing held."""
    port = free_port()
    with trio.fail_after(TEST_TIMEOUT):
        async with llama_and_mock(tmp_path, port) as stack:
            await start_llama(stack, llama_model, port)
            await until(stack, "gpu0 ready", gpu0_back)
            answer = await stack.chat(BIG, stream=True, **{**LONG, "max_tokens": 16})
            assert (answer.status_code, answer.headers["x-iop-provider"]) == (200, "node-a/gpu0")
            events = [line for line in answer.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            assert json.loads(events[-2][len("data: ") :])["choices"][0]["finish_reason"] == "length"
            await until(stack, "drained, gpu0 ready", lambda s: drained(s) and gpu0_back(s))
