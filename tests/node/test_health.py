"""[health-probe] The Node's health watcher: readiness probes, the stall watchdog, the reports to the Edge.

Pure parts (thresholds, verdicts, the counters) are driven directly; the probes and the
watchdog run against the mock backend's fault modes on 127.0.0.1 (``POST /fault``:
a loading model, a hung engine whose ``/health`` still answers, "200 and then nothing",
tokens that stop mid-stream), with a fake Edge on a real WebSocket.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import pytest
import trio
from trio_websocket import open_websocket_url

from iop_http import AnswerError, StatusAnswers
from iop_mock import MockBackend, serve_mock_backend
from iop_mock.faults import SLOT_CONTEXT
from iop_node import EdgeSession, NodeRuntime
from iop_node.config import HealthConfig, NodeConfig
from iop_node.health.probe import ProbeClient, probe_urls
from iop_node.health.prober import TICK, ProbeLoop, Target, grid_time, round_of
from iop_node.health.progress import Progress
from iop_node.health.readiness import ProbeResult, Readiness, judge
from iop_wire import PROTOCOL_VERSION, PROTOCOL_VERSIONS, EngineView, ProviderHealth, Run, RunEnd
from node.harness import TOKEN, EdgeConn, FakeEdge, node_config, openai_provider

pytestmark = pytest.mark.req("health-probe")

FAST = HealthConfig(interval_ms=50, timeout_ms=500, no_traffic_interval_ms=50, stall_ms=300, jitter=0.0)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def test_readiness_needs_the_thresholds_in_a_row() -> None:
    """unhealthy_threshold failures in a row make it not ready, healthy_threshold passes ready again;
    a pass between failures starts the count again."""
    readiness = Readiness(unhealthy_threshold=2, healthy_threshold=3)
    down = ProbeResult(False, "HTTP 503")
    assert readiness.observe(down) is False
    assert readiness.observe(ProbeResult(True)) is False
    assert readiness.observe(down) is False
    assert readiness.ready
    assert readiness.observe(down) is True
    assert (readiness.ready, readiness.reason) == (False, "HTTP 503")
    assert readiness.observe(ProbeResult(False, "unreachable")) is True  # a new reason is news
    assert [readiness.observe(ProbeResult(True, capacity=2)) for _ in range(3)] == [False, False, True]
    assert (readiness.ready, readiness.reason, readiness.capacity) == (True, "", 2)
    assert readiness.observe(ProbeResult(True, "running 3", 2)) is False  # load while ready: kept, no report
    assert readiness.reason == "running 3"


def test_readiness_while_ready_reports_only_a_new_capacity_or_engine_view() -> None:
    """A pass on a ready provider is news only when the backend's own capacity or the engine's
    view changed; a failure that makes it not ready drops the view."""
    readiness = Readiness(unhealthy_threshold=1, healthy_threshold=1)
    assert readiness.observe(ProbeResult(True)) is False
    assert readiness.observe(ProbeResult(True, capacity=3)) is True
    assert readiness.observe(ProbeResult(True, "running 1", 3)) is False
    assert readiness.observe(ProbeResult(True)) is True
    assert (readiness.ready, readiness.capacity, readiness.reason) == (True, None, "")
    view = EngineView(kv_use=0.5, preemptions=1)
    assert readiness.observe(ProbeResult(True, engine=view)) is True
    assert readiness.observe(ProbeResult(True, engine=EngineView(kv_use=0.5, preemptions=1))) is False
    assert readiness.observe(ProbeResult(True, engine=EngineView(kv_use=0.6, preemptions=1))) is True
    assert readiness.observe(ProbeResult(False, "HTTP 503")) is True
    assert readiness.engine is None
    assert readiness.observe(ProbeResult(True, engine=view)) is True
    assert readiness.engine == view


@pytest.mark.req("token-ledger")
def test_judge_reads_the_engines_view() -> None:
    """llama.cpp's slots: n_ctx summed, the processing ones' prompt and decoded tokens (next_token an
    object on older servers, an array on newer), their ratio; a server without n_prompt_tokens
    gives no tokens. vLLM's metrics: KV use (either name), preemptions (the counter), queue. A
    figure out of bounds is no figure."""
    slots = (
        b'[{"id":0,"n_ctx":1000,"is_processing":true,"n_prompt_tokens":300,"next_token":[{"n_decoded":50}]},'
        b'{"id":1,"n_ctx":1000,"is_processing":true,"n_prompt_tokens":100,"next_token":{"n_decoded":50}},'
        b'{"id":2,"n_ctx":1000,"is_processing":false}]'
    )
    assert judge("llama_cpp", ((200, b"{}"), (200, slots))) == ProbeResult(
        True, capacity=3, engine=EngineView(500 / 3000, 500, 3000, running=2)
    )
    old = b'[{"id":0,"n_ctx":512,"is_processing":true,"next_token":{"n_decoded":9}},{"id":1,"n_ctx":512,"is_processing":false}]'
    assert judge("llama_cpp", ((200, b"{}"), (200, old))).engine == EngineView(None, None, 1024, running=1)
    over = b'[{"id":0,"n_ctx":10,"is_processing":true,"n_prompt_tokens":11,"next_token":[{"n_decoded":0}]}]'
    assert judge("llama_cpp", ((200, b"{}"), (200, over))).engine == EngineView(None, None, 10, running=1)
    assert judge("llama_cpp", ((200, b"{}"), (200, b'[{"id":0,"n_ctx":-1}]'))).engine is None
    metrics = (
        b"# TYPE vllm:num_preemptions_total counter\n"
        b'vllm:num_preemptions_total{m="x"} 7\nvllm:num_preemptions_created{m="x"} 1.7e9\n'
        b'vllm:gpu_cache_usage_perc{m="x"} 0.25\nvllm:num_requests_running{m="x"} 2\n'
    )
    assert judge("vllm", ((200, b""), (200, metrics))).engine == EngineView(0.25, preemptions=7, running=2)
    bad = b'vllm:kv_cache_usage_perc{m="x"} 1.5\nvllm:num_requests_waiting{m="x"} -1\nvllm:num_requests_running 2.5\n'
    result = judge("vllm", ((200, b""), (200, bad)))
    assert result.ready and result.engine is None
    assert judge("vllm", ((200, b""), (200, b"vllm:kv_cache_usage_perc NaN\n"))).engine is None


OK_ANSWER = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 12\r\n\r\n{"data": []}'


def _answer(answers: StatusAnswers, *pieces: bytes) -> tuple[int, bytes, bool]:
    answers.expect()
    for piece in pieces:
        answers.feed(piece)
    assert answers.complete
    return answers.status, b"".join(answers.body), answers.reusable


@pytest.mark.parametrize("cut", range(1, len(OK_ANSWER)))
def test_probe_answers_parse_an_answer_cut_anywhere_and_keep_the_connection(cut: int) -> None:
    """One parser for the connection: an answer in two reads cut at any byte, then the next answer."""
    answers = StatusAnswers()
    assert _answer(answers, OK_ANSWER[:cut], OK_ANSWER[cut:]) == (200, b'{"data": []}', True)
    assert _answer(answers, OK_ANSWER) == (200, b'{"data": []}', True)


def test_probe_answers_skip_informational_answers_and_read_to_the_close() -> None:
    """A 1xx answer is skipped; a body without framing ends at the close, and the connection with it."""
    answers = StatusAnswers()
    answers.expect()
    answers.feed(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 503 Service Unavailable\r\nconnection: close\r\n\r\nload")
    assert (answers.complete, answers.head_done) == (False, True)
    answers.feed(b"ing")
    assert answers.closed()
    assert (answers.status, b"".join(answers.body), answers.reusable) == (503, b"loading", False)


def test_probe_answers_refuse_unasked_bytes_bad_http_and_a_close_before_the_head() -> None:
    """Bytes after the answer make the connection unusable; bad HTTP raises; a close before the
    answer's head is no answer."""
    answers = StatusAnswers()
    assert _answer(answers, OK_ANSWER + OK_ANSWER) == (200, b'{"data": []}', False)
    answers = StatusAnswers()
    answers.expect()
    with pytest.raises(AnswerError):
        answers.feed(b"HTTP/1.1 2x0 OK\r\n\r\n")
    answers = StatusAnswers()
    answers.expect()
    answers.feed(b"HTTP/1.1 200 OK\r\ncontent-le")
    assert answers.closed() is False


def test_probe_answers_bound_the_head_and_the_informational_answers() -> None:
    """A head that does not end within ``head_bytes`` (read by read, 1xx answers before it
    included) and more than ``informational_answers`` 1xx answers are refused, as a run's answer
    would be: a probe's backend gets no more room than a run's."""
    answers = StatusAnswers(head_bytes=1024, informational_answers=2)
    answers.expect()
    answers.feed(b"HTTP/1.1 200 OK\r\n")
    with pytest.raises(AnswerError) as too_long:
        for _ in range(40):
            answers.feed(b"x-filler: " + b"y" * 40 + b"\r\n")
    assert too_long.value.kind == "too_large"
    answers = StatusAnswers(head_bytes=1024, informational_answers=2)
    answers.expect()
    with pytest.raises(AnswerError) as storm:
        answers.feed(b"HTTP/1.1 100 Continue\r\n\r\n" * 3)
    assert storm.value.kind == "over_bound"
    answers = StatusAnswers(head_bytes=1024, informational_answers=2)
    assert _answer(answers, b"HTTP/1.1 102 Processing\r\n\r\n" * 2, OK_ANSWER) == (200, b'{"data": []}', True)


def test_a_success_the_close_cut_gives_its_status_and_no_body() -> None:
    """A 200 whose body the close ended (cut inside a figure of ``/metrics``, or never framed) is
    ready, and nothing is read from its body: a cut ``num_requests_running 12`` would read 1."""
    answers = StatusAnswers()
    answers.expect()
    answers.feed(b"HTTP/1.1 200 OK\r\ncontent-length: 40\r\n\r\nvllm:num_requests_running 1")
    assert answers.closed()
    assert (answers.status, answers.body, answers.size, answers.reusable) == (200, [], 0, False)


def test_judge_reads_each_backend_kind() -> None:
    """llama.cpp's 503 is "loading", its slots are its capacity; vLLM's metrics its load; other
    statuses name the backend's message."""
    loading = b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'
    assert judge("llama_cpp", ((503, loading),)) == ProbeResult(False, "loading (Loading model)")
    assert judge("llama_cpp", ((200, b"{}"), (200, b'[{"id":0},{"id":1}]'))) == ProbeResult(True, capacity=2)
    assert judge("llama_cpp", ((200, b"{}"), (501, b"slots disabled"))) == ProbeResult(True)
    metrics = b'vllm:num_requests_running{m="x"} 3\nvllm:num_requests_waiting{m="x"} 1\nother 7\n'
    assert judge("vllm", ((200, b""), (200, metrics))) == ProbeResult(
        True, "running 3, waiting 1", engine=EngineView(running=3, waiting=1)
    )
    assert judge("openai", ((500, b'{"error":{"message":"boom"}}'),)) == ProbeResult(False, "HTTP 500: boom")
    assert judge("ollama", ((404, b"not json"),)) == ProbeResult(False, "HTTP 404")


async def test_progress_stalls_only_with_runs_and_no_byte() -> None:
    """Stalled after ``stall`` seconds of runs in flight without a chunk, every run cut; a chunk or no
    run ends it; a new run does not restart the clock; runs that come in during a stall are cut
    once they too went ``stall`` without a byte."""
    progress = Progress()
    assert progress.idle  # the watchdog skips it
    assert progress.check(0.0, 1.0) is None  # no run: nothing to watch
    first = progress.begin()
    assert not progress.idle
    assert progress.check(0.0, 1.0) is None
    assert progress.check(0.9, 1.0) is None
    second = progress.begin()  # a new run on a hung engine hangs too
    assert progress.check(1.0, 1.0) is True
    assert progress.stalled and progress.silence == 1.0
    assert progress.cut_runs == 2 and first.cancel_called and second.cancel_called
    progress.end(first)
    third = progress.begin()  # came in during the stall
    assert progress.check(1.5, 1.0) is None  # still stalled: no news, nothing cut yet
    assert progress.cut_runs == 0 and not third.cancel_called
    assert progress.check(2.0, 1.0) is None
    assert progress.cut_runs == 2 and third.cancel_called  # its own stall's time passed
    progress.chunks += 1
    assert progress.check(2.1, 1.0) is False
    progress.end(second)
    progress.end(third)
    assert not progress.idle  # no run left, but only a check sees that
    assert progress.check(2.2, 1.0) is None
    assert progress.runs == 0 and progress.idle
    assert progress.check(9.0, 0.0) is None  # stall 0: no watchdog


@attrs.define(eq=False)
class _Served:
    backend: MockBackend
    port: int
    http: httpx.AsyncClient

    async def fault(self, **faults: Any) -> None:
        answer = await self.http.post(f"http://127.0.0.1:{self.port}/fault", json=faults)
        assert answer.status_code == 200, answer.text


@pytest.fixture
async def served(nursery: trio.Nursery) -> AsyncIterator[_Served]:
    mock = MockBackend(tokens_per_second=200.0, slots=4)
    port = await nursery.start(serve_mock_backend, mock)
    async with httpx.AsyncClient() as http:
        yield _Served(mock, port, http)


def _urls(kind: str, port: int) -> tuple[httpx.URL, ...]:
    provider = openai_provider(port, health=HealthConfig(probe=kind))
    return probe_urls(provider)[1]


async def _probe_twice(loop: bool, kind: str, urls: tuple[httpx.URL, ...], limit: float) -> list[ProbeResult]:
    """Two probes in a row (the second on the kept connection): with the one-task :class:`ProbeLoop`,
    or with a :class:`ProbeClient` (``https://`` backends, platforms without epoll)."""
    if not loop:
        probe = ProbeClient(kind, urls, limit)
        try:
            return [await probe.check(limit), await probe.check(limit)]
        finally:
            await probe.aclose()
    results: list[ProbeResult] = []
    done = trio.Event()
    target = Target(kind, urls, limit)

    def record(result: ProbeResult, now: float) -> float:
        results.append(result)
        if len(results) == 2:
            done.set()
        return 0.0

    target.done = record
    probes = await _loop_until(target, 0.0, done)
    assert probes.probes >= 2
    return results


async def _loop_until(target: Target, delay: float, done: trio.Event) -> ProbeLoop:
    """A :class:`ProbeLoop` probing ``target`` from ``delay`` seconds on, online, until ``done``."""
    probes, online = ProbeLoop(), trio.Event()
    online.set()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(probes.serve, lambda: online)
        probes.schedule(target, delay)
        await done.wait()
        nursery.cancel_scope.cancel()
    return probes


@pytest.mark.parametrize("loop", [True, False], ids=["probe-loop", "probe-client"])
@pytest.mark.parametrize(
    ("kind", "faults", "expected"),
    [
        ("openai", {}, ProbeResult(True)),
        ("ollama", {}, ProbeResult(True)),
        ("llama_cpp", {}, ProbeResult(True, capacity=4, engine=EngineView(0.0, 0, 4 * SLOT_CONTEXT, running=0))),
        ("llama_cpp", {"loading": True}, ProbeResult(False, "loading (Loading model)")),
        (
            "vllm",
            {"kv_use": 0.5, "preemptions": 2},
            ProbeResult(True, "running 0, waiting 0, kv_cache 0.5", engine=EngineView(0.5, None, None, 2, 0, 0)),
        ),
        ("openai", {"hang": "no_answer"}, ProbeResult(True)),  # the hung engine still answers its probe
    ],
)
async def test_probe_kinds_against_the_mock(
    served: _Served, loop: bool, kind: str, faults: dict[str, Any], expected: ProbeResult
) -> None:
    await served.fault(**faults)
    with trio.fail_after(10):
        assert await _probe_twice(loop, kind, _urls(kind, served.port), 5.0) == [expected, expected]


async def test_the_probe_loop_sends_a_probe_at_its_time_never_before_and_without_drift(served: _Served) -> None:
    """Rounds on the grid of :data:`TICK`: a probe goes in the first round at or after it is due,
    never before; the next is due an interval after this one was due (no drift from the rounds)."""
    assert grid_time(3 * TICK) == 3 * TICK and round_of(grid_time(0.31)) == round_of(0.31) + 1
    seen: list[tuple[float, float]] = []
    done = trio.Event()
    target = Target("openai", _urls("openai", served.port), 5.0)

    def record(result: ProbeResult, now: float) -> float:
        assert result.ready
        sent = target.deadline - target.limit  # the time of the round that sent it
        assert sent >= target.due - 1e-9  # never before its time
        seen.append((target.due, now))
        if len(seen) == 5:
            done.set()
        return 0.25

    target.done = record
    with trio.fail_after(20):
        await _loop_until(target, 0.03, done)
    for (due, answered), (next_due, _) in itertools.pairwise(seen):
        assert next_due == max(due + 0.25, answered + 0.25 - 2 * TICK)


@pytest.mark.parametrize("loop", [True, False], ids=["probe-loop", "probe-client"])
async def test_probe_of_a_dead_or_silent_backend_fails_with_its_reason(loop: bool) -> None:
    """A closed port is unreachable; a server that accepts and never answers is "no answer"."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    urls = (httpx.URL(f"http://127.0.0.1:{port}/health"),)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            accepted: list[trio.SocketStream] = []

            async def accept_and_ignore() -> None:
                while True:
                    accepted.append(await listeners[0].accept())

            nursery.start_soon(accept_and_ignore)
            silent = await _probe_twice(loop, "llama_cpp", urls, 0.2)
            assert silent == [ProbeResult(False, "no answer within 0.2 s")] * 2
            nursery.cancel_scope.cancel()
        for stream in accepted:
            await stream.aclose()
        for listener in listeners:
            await listener.aclose()
        dead = await _probe_twice(loop, "llama_cpp", urls, 2.0)
    assert all(not result.ready and result.reason.startswith("unreachable: ") for result in dead), dead


@asynccontextmanager
async def _session(
    edge: FakeEdge, config: NodeConfig, protocol: int = PROTOCOL_VERSION
) -> AsyncIterator[tuple[EdgeConn, NodeRuntime]]:
    """A node session of ``protocol`` (the current one) with the fake Edge, the watcher serving."""
    async with NodeRuntime.from_config(config) as runtime, trio.open_nursery() as nursery:
        assert runtime.health is not None
        nursery.start_soon(runtime.health.serve)

        async def serve() -> None:
            async with open_websocket_url(edge.url) as ws:
                await EdgeSession(ws, config, runtime, TOKEN, protocol).serve()

        nursery.start_soon(serve)
        yield await edge.next_connection(), runtime
        nursery.cancel_scope.cancel()


async def _next_health(conn: EdgeConn) -> ProviderHealth:
    while not isinstance(message := await conn.receive(), ProviderHealth):
        pass
    return message


async def _until_end(conn: EdgeConn, run_id: str) -> tuple[RunEnd, list[ProviderHealth]]:
    """The run's end, and the health reports that came before it."""
    reports = []
    while True:
        message = await conn.receive()
        if isinstance(message, ProviderHealth):
            reports.append(message)
        elif isinstance(message, RunEnd) and message.run_id == run_id:
            return message, reports


@pytest.mark.parametrize(
    ("hang", "stream", "code"),
    [
        ("no_answer", True, "upstream_unreachable"),
        ("head_only", True, "upstream_unreachable"),
        ("mid_stream", True, "stream_stalled"),
    ],
)
async def test_a_hung_backend_is_stalled_its_runs_cut_and_reported(
    edge: FakeEdge, served: _Served, hang: str, stream: bool, code: str
) -> None:
    """[health-probe] /health-ok-but-hung, 200-then-nothing, tokens stopping: the watchdog finds the
    provider stalled, the run ends upstream_unreachable before any byte of its answer went out
    (failover material; stream_stalled after some did), the backend's request
    is aborted, and the Edge hears ``stalled``, then ``ready`` once no run is left."""
    await served.fault(hang=hang, hang_after_tokens=2)
    config = node_config(edge.url, openai_provider(served.port, capacity=2, health=FAST))
    with trio.fail_after(20):
        async with _session(edge, config) as (conn, runtime):
            await conn.send(Run("r1", "gpu0", "chat/completions", {**CHAT, "stream": stream}, stream))
            end, reports = await _until_end(conn, "r1")
            assert end.status == "error" and end.code == code
            assert end.message is not None and end.message.startswith("stalled: the backend sent no byte")
            stalled = reports[0] if reports else await _next_health(conn)
            assert (stalled.provider, stalled.state) == ("gpu0", "stalled")
            assert stalled.reason.startswith("no byte from the backend for 0.3")
            assert (await _next_health(conn)).state == "ready"
            while served.backend.stats()["in_flight"]:  # the backend let go of the request
                await trio.sleep(0.01)
            assert runtime.progress["gpu0"].runs == 0


@pytest.mark.req("health-probe")
async def test_a_non_stream_run_longer_than_stall_ms_is_served_whole(edge: FakeEdge, served: _Served) -> None:
    """[health-probe] A non-stream answer comes whole at its end: a run that takes 1 s (200 tokens at
    200 a second) on a provider whose stall_ms is 0.3 s is served, not cut, and no stall is reported."""
    config = node_config(edge.url, openai_provider(served.port, capacity=2, health=FAST))
    with trio.fail_after(20):
        async with _session(edge, config) as (conn, runtime):
            await conn.send(Run("r1", "gpu0", "chat/completions", {**CHAT, "max_tokens": 200}, False))
            end, reports = await _until_end(conn, "r1")
            assert end.status == "ok", end
            assert all(report.state != "stalled" for report in reports)
            assert not runtime.progress["gpu0"].stalled


async def test_a_loading_backend_is_not_ready_until_it_loaded(edge: FakeEdge, served: _Served) -> None:
    """llama.cpp's 503 while loading: ``not_ready`` after unhealthy_threshold probes, ``ready``
    (with its slots as capacity, below the configured 8) once loaded."""
    await served.fault(loading=True)
    health = attrs.evolve(FAST, probe="llama_cpp")
    config = node_config(edge.url, openai_provider(served.port, capacity=8, health=health))
    with trio.fail_after(20):
        async with _session(edge, config) as (conn, _):
            assert await _next_health(conn) == ProviderHealth("gpu0", "not_ready", "loading (Loading model)")
            await served.fault()
            engine = EngineView(0.0, 0, 4 * SLOT_CONTEXT, running=0)
            assert await _next_health(conn) == ProviderHealth("gpu0", "ready", "", 4, engine)


@pytest.mark.req("token-ledger")
@pytest.mark.parametrize("protocol", PROTOCOL_VERSIONS)
async def test_the_engines_view_goes_to_an_edge_of_v7_only(edge: FakeEdge, served: _Served, protocol: int) -> None:
    """A vLLM backend's KV use and preemptions, read from its /metrics, ride the ready report to a v7
    Edge; a v6 Edge is neither told them (``iop_wire.health_for``) nor sent a ready report for
    them: the first report it gets is the next change of state (the backend loading)."""
    await served.fault(kv_use=0.75, preemptions=3)
    health = attrs.evolve(FAST, probe="vllm")
    config = node_config(edge.url, openai_provider(served.port, capacity=8, health=health))
    engine = EngineView(0.75, None, None, 3, 0, 0)
    with trio.fail_after(20):
        async with _session(edge, config, protocol) as (conn, runtime):
            assert runtime.health is not None
            while runtime.health.reports["gpu0"].engine != engine:
                await runtime.health.changed()
            if protocol == PROTOCOL_VERSION:
                assert await _next_health(conn) == ProviderHealth("gpu0", "ready", "", None, engine)
            await served.fault(loading=True, kv_use=0.75, preemptions=3)  # the same view, then not ready
            report = await _next_health(conn)
    assert (report.state, report.engine) == ("not_ready", None)
