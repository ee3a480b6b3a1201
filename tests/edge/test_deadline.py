"""A request's one deadline through the Edge's HTTP API, against fake nodes ([deadline] [error-classes]).

``ornith:35b`` prefers ``node-a/gpu0`` and may fall back to ``node-b/gpu1``; ``ornith-fast`` has
only ``node-a/gpu0``. The deadlines are short (a few hundred milliseconds): each test waits for
the Edge's answer, never for time to pass.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from edge.harness import (
    BIG,
    FAST,
    Edge,
    EdgeLayout,
    FakeNode,
    chat_chunk,
    eventually,
    fake_node,
    running_edge,
    sse_events,
    start_chat,
)
from iop_edge.api.deadline import request_deadline
from iop_edge.config import EdgeCandidate, EdgeModel
from iop_wire import RunEnd

pytestmark = pytest.mark.req("deadline", "error-classes")


async def _failures(http: httpx.AsyncClient, model: str, error_class: str) -> float:
    """``iop_request_failures_total{model, class}`` (0 when the series does not exist yet)."""
    for family in text_string_to_metric_families((await http.get("/metrics")).text):
        for sample in family.samples:
            if sample.name == "iop_request_failures_total" and sample.labels == {"model": model, "class": error_class}:
                return sample.value
    return 0.0


def _timeout(seconds: float) -> dict[str, str]:
    return {"X-Request-Timeout": f"{seconds:g}"}


class Rig(NamedTuple):
    edge: Edge
    a: FakeNode  # node-a/gpu0: the first choice of both model keys
    fallback: FakeNode | None  # node-b/gpu1: ornith:35b's fallback, when registered
    results: dict[str, httpx.Response]  # the answers of start_chat, by name

    @property
    def b(self) -> FakeNode:
        assert self.fallback is not None, "the rig was set up without node-b"
        return self.fallback


@asynccontextmanager
async def _rig(tmp_path: Path, layout: EdgeLayout | None = None, *, fallback: bool = False) -> AsyncIterator[Rig]:
    """The set-up of these tests, bounded at 20 s: an Edge with node-a registered, and with
    ``fallback`` node-b registered before it."""
    with trio.fail_after(20):
        async with running_edge(tmp_path, layout) as edge, AsyncExitStack() as nodes:
            b = await nodes.enter_async_context(fake_node(edge, "node-b", providers=("gpu1",))) if fallback else None
            a = await nodes.enter_async_context(fake_node(edge))
            yield Rig(edge, a, b, {})


async def test_deadline_passes_while_queued(tmp_path: Path) -> None:
    """[deadline] a request whose deadline is shorter than queue_timeout_ms leaves the queue at its
    deadline: 504 deadline_exceeded (class header, metric), said to have passed while queued; the
    request holding the provider is untouched and the queue drains."""
    async with _rig(tmp_path, EdgeLayout(queue_timeout_ms=20_000)) as (edge, a, _, results):
        async with trio.open_nursery() as nursery:
            start_chat(nursery, edge, results, "holder", FAST)
            held = await a.next_run()
            started = trio.current_time()
            response = await edge.chat(BIG, headers=_timeout(0.3))
            waited = trio.current_time() - started
            assert edge.queue_depth == 0
            await a.answer(held)
        assert results["holder"].status_code == 200
        assert response.status_code == 504, response.text
        assert response.headers["x-iop-error-class"] == "deadline_exceeded"
        assert "retry-after" not in response.headers
        error = response.json()["error"]
        assert (error["code"], error["type"]) == ("deadline_exceeded", "timeout_error")
        assert "0.3 s (X-Request-Timeout) passed while queued" in error["message"]
        assert waited >= 0.3  # the queue held it until its deadline, not its queue_timeout_ms
        assert await _failures(edge.http, BIG, "deadline_exceeded") == 1
        await edge.assert_drained()


async def test_deadline_before_first_byte_cancels_the_run(tmp_path: Path) -> None:
    """[deadline] the deadline passes while the node works on the run: the Edge answers 504
    deadline_exceeded before the first byte at once, cancels the run on the node and holds the lease
    until the node lets go, and never retries (nothing is left for another attempt)."""
    async with _rig(tmp_path, fallback=True) as rig:
        edge, a, results = rig.edge, rig.a, rig.results
        async with trio.open_nursery() as nursery:
            start_chat(nursery, edge, results, "r", BIG, headers=_timeout(0.3))
            run = await a.next_run()
            cancel = await a.next_cancel()
            assert cancel.run_id == run.run_id
            await eventually(lambda: "r" in results)  # answered without waiting for the node
            assert edge.provider("node-a", "gpu0")["in_flight"] == 1  # the lease is held until it confirms
            await a.send(RunEnd(run.run_id, "cancelled", "cancelled"))
        response = results["r"]
        assert response.status_code == 504, response.text
        assert response.headers["x-iop-error-class"] == "deadline_exceeded"
        assert response.headers["x-iop-provider"] == "node-a/gpu0"
        assert "passed before the first byte" in response.json()["error"]["message"]
        assert await _failures(edge.http, BIG, "deadline_exceeded") == 1
        assert edge.provider("node-a", "gpu0")["failures"] == 0  # the client's budget, not the provider's fault
        with trio.move_on_after(0):
            await rig.b.next_run()  # node-b was never asked
        await edge.assert_drained()


async def test_deadline_after_first_byte_ends_the_stream_with_its_class(tmp_path: Path) -> None:
    """[deadline] a stream still running at its deadline (X-Request-Timeout: the whole request) gets a
    final SSE error event deadline_exceeded after what it received; the run is cancelled on the node."""
    async with _rig(tmp_path) as (edge, a, _, results):
        async with trio.open_nursery() as nursery:
            start_chat(nursery, edge, results, "r", FAST, stream=True, headers=_timeout(0.4))
            run = await a.next_run()
            await a.send_json(run.run_id, chat_chunk("first"))
            cancel = await a.next_cancel()
            assert cancel.run_id == run.run_id
            await a.send(RunEnd(run.run_id, "cancelled", "cancelled"))
        response = results["r"]
        assert response.status_code == 200
        events = sse_events(response.text)
        assert events[0]["choices"][0]["delta"]["content"] == "first"
        assert events[-1]["error"]["code"] == "deadline_exceeded"
        assert "passed after the first byte" in events[-1]["error"]["message"]
        assert await _failures(edge.http, FAST, "deadline_exceeded") == 1
        await edge.assert_drained()


async def test_no_retry_without_min_attempt_left(tmp_path: Path) -> None:
    """[deadline] a failed attempt is retried on the other candidate only while min_attempt_ms of the
    deadline is left: with less, the first failure is the answer (502 upstream_unreachable, its class
    and a Retry-After); with more, node-b serves it."""
    layout = EdgeLayout(model_keys=("min_attempt_ms: 5000",), outlier="{consecutive_failures: 0}")
    async with _rig(tmp_path, layout, fallback=True) as rig:
        edge, a, b, results = rig.edge, rig.a, rig.b, rig.results
        async with trio.open_nursery() as nursery:
            start_chat(nursery, edge, results, "short", BIG, headers=_timeout(4))
            run = await a.next_run()
            await a.send(RunEnd(run.run_id, "error", "upstream_unreachable", "connection refused"))
        short = results["short"]
        async with trio.open_nursery() as nursery:
            start_chat(nursery, edge, results, "long", BIG, headers=_timeout(60))
            run = await a.next_run()
            await a.send(RunEnd(run.run_id, "error", "upstream_unreachable", "connection refused"))
            await b.answer(await b.next_run(), "from b")
        long = results["long"]
        assert short.status_code == 502, short.text
        assert short.headers["x-iop-attempts"] == "1"
        assert short.headers["x-iop-error-class"] == "upstream_unreachable"
        assert short.headers["retry-after"] == "1"
        assert await _failures(edge.http, BIG, "upstream_unreachable") == 1
        assert long.status_code == 200 and long.headers["x-iop-attempts"] == "2"
        await edge.assert_drained()


async def test_bad_request_timeout_is_refused(tmp_path: Path) -> None:
    """[deadline] an X-Request-Timeout that is not a positive number of seconds is the client's
    mistake: 400 bad_request, nothing queued; a malformed openai read timeout is ignored."""
    async with _rig(tmp_path) as (edge, a, _, results):
        for value in ("soon", "0", "-3", "nan", "inf", ""):
            response = await edge.chat(BIG, headers={"X-Request-Timeout": value})
            assert response.status_code == 400, (value, response.text)
            assert "X-Request-Timeout" in response.json()["error"]["message"]
            assert "x-iop-error-class" not in response.headers
        async with trio.open_nursery() as nursery:
            start_chat(nursery, edge, results, "r", BIG, headers={"X-Stainless-Read-Timeout": "never"})
            await a.answer(await a.next_run())
        assert results["r"].status_code == 200
        await edge.assert_drained()


async def test_client_gone_is_counted_as_cancelled(tmp_path: Path) -> None:
    """[error-classes] a client that hangs up while its run is under way: the run is cancelled on the
    node and the request counted as ``cancelled``."""
    async with _rig(tmp_path) as (edge, a, _, results):
        async with trio.open_nursery() as nursery:
            start_chat(nursery, edge, results, "gone", FAST)
            run = await a.next_run()
            nursery.cancel_scope.cancel()
        cancel = await a.next_cancel()
        assert cancel.run_id == run.run_id
        await a.send(RunEnd(run.run_id, "cancelled", "cancelled"))
        await edge.assert_drained()
        assert await _failures(edge.http, FAST, "cancelled") == 1
        assert (await edge.status())["failures"] == {FAST: {"cancelled": 1}}


# ------------------------------------------------------------------ where a deadline comes from


def _model(**keys: int | None) -> EdgeModel:
    return EdgeModel(id=BIG, candidates=(EdgeCandidate(node="node-a", provider="gpu0"),), **keys)  # type: ignore[arg-type]


def _headers(**values: str) -> list[tuple[bytes, bytes]]:
    return [(name.replace("_", "-").encode(), value.encode()) for name, value in values.items()]


async def test_deadline_sources_in_order(mock_clock: trio.testing.MockClock) -> None:
    """[deadline] X-Request-Timeout first, then the openai client's read timeout, then the model's
    default; each bounded by max_deadline_ms; none of them: no deadline at all."""
    model = _model(default_deadline_ms=20_000, max_deadline_ms=60_000)
    both = request_deadline(_headers(x_request_timeout="5", x_stainless_read_timeout="9"), model, False)
    assert (both.seconds, both.source, both.whole) == (5.0, "X-Request-Timeout", True)
    openai_only = request_deadline(_headers(x_stainless_read_timeout="9.5"), model, False)
    assert (openai_only.seconds, openai_only.source, openai_only.whole) == (9.5, "X-Stainless-Read-Timeout", True)
    default = request_deadline([], model, False)
    assert (default.seconds, default.source) == (20.0, "default_deadline_ms")
    capped = request_deadline(_headers(x_request_timeout="600"), model, True)
    assert (capped.seconds, capped.source) == (60.0, "X-Request-Timeout, cut to max_deadline_ms")
    assert capped.run_ms() == 60_000
    mock_clock.jump(59.5)
    assert capped.run_ms() == 500
    none = request_deadline([], _model(), True)
    assert (none.seconds, none.source, none.run_ms(), none.left()) == (None, "none", None, math.inf)
    assert none.may_retry(1.0)


async def test_openai_read_timeout_of_a_stream_holds_until_the_first_byte(mock_clock: trio.testing.MockClock) -> None:
    """[deadline] the openai clients' read timeout is the wait for one byte: for a stream it bounds the
    time to the first byte, then no timer cuts the healthy stream; the Node gets no deadline for it."""
    deadline = request_deadline(_headers(x_stainless_read_timeout="2"), _model(), True)
    assert not deadline.whole and deadline.run_ms() is None
    mock_clock.jump(1.5)
    assert deadline.left() == pytest.approx(0.5)
    assert not deadline.may_retry(1.0)
    deadline.first_byte()
    assert deadline.scope.deadline == math.inf
    whole = request_deadline(_headers(x_request_timeout="2"), _model(), True)
    whole.first_byte()
    assert whole.left() == pytest.approx(2.0)  # the client's whole budget stays


def test_deadline_keys_are_checked() -> None:
    """[deadline] the model's deadline keys: positive, and the default not over the maximum."""
    problems = dict(_model(default_deadline_ms=90_000, max_deadline_ms=60_000, min_attempt_ms=-1).problems("models[0]"))
    assert problems == {
        "models[0].default_deadline_ms": "must be at most max_deadline_ms (60000)",
        "models[0].min_attempt_ms": "must be >= 0, got -1",
    }
    assert dict(_model().problems("m")) == {}
    assert _model().deadline_seconds(None) is None


async def test_the_run_carries_what_is_left_of_the_deadline(tmp_path: Path) -> None:
    """[deadline] the official openai client's ``timeout=`` is the deadline of a non-stream request:
    its run carries what is left of it (wire v6 ``deadline_ms``); a stream's read timeout bounds its
    first byte only, so its run carries none; a request without any, none."""
    async with _rig(tmp_path) as (edge, a, _, results):
        async with edge.openai_client() as client, trio.open_nursery() as nursery:
            answers: list[str | None] = []

            async def ask() -> None:
                chat = await client.chat.completions.create(
                    model=BIG, messages=[{"role": "user", "content": "hi"}], max_tokens=5, timeout=5.0
                )
                answers.append(chat.choices[0].message.content)

            nursery.start_soon(ask)
            await a.answer(await a.next_run(), "in time")
        async with trio.open_nursery() as nursery:
            start_chat(nursery, edge, results, "s", FAST, stream=True, headers={"X-Stainless-Read-Timeout": "5"})
            await a.answer(await a.next_run())
        async with trio.open_nursery() as nursery:
            start_chat(nursery, edge, results, "none", FAST)
            await a.answer(await a.next_run())
        openai_run, stream_run, plain_run = a.runs_received
        assert answers == ["in time"]
        assert openai_run.deadline_ms is not None and 0 < openai_run.deadline_ms <= 5000
        assert stream_run.deadline_ms is None and plain_run.deadline_ms is None
        await edge.assert_drained()


async def test_node_ends_deadline_and_stall_become_their_classes(tmp_path: Path) -> None:
    """[deadline] [error-classes] a run the node ended ``deadline_exceeded`` (its own bound on the
    backend call) is 504 deadline_exceeded, not retried, not the provider's failure; one it ended
    ``stream_stalled`` after the first bytes ends the stream with that class."""
    async with _rig(tmp_path, fallback=True) as rig:
        edge, a, results = rig.edge, rig.a, rig.results
        async with trio.open_nursery() as nursery:
            start_chat(nursery, edge, results, "late", BIG, headers=_timeout(30))
            run = await a.next_run()
            await a.send(RunEnd(run.run_id, "error", "deadline_exceeded", "the run's deadline passed"))
        async with trio.open_nursery() as nursery:
            start_chat(nursery, edge, results, "stalled", FAST, stream=True)
            run = await a.next_run()
            await a.send_json(run.run_id, chat_chunk("first"))
            await a.send(RunEnd(run.run_id, "error", "stream_stalled", "silent for 300 s"))
        late, stalled = results["late"], results["stalled"]
        assert late.status_code == 504 and late.headers["x-iop-error-class"] == "deadline_exceeded"
        assert late.headers["x-iop-attempts"] == "1"
        assert sse_events(stalled.text)[-1]["error"]["code"] == "stream_stalled"
        assert await _failures(edge.http, FAST, "stream_stalled") == 1
        assert edge.provider("node-a", "gpu0")["failures"] == 0
        with trio.move_on_after(0):
            await rig.b.next_run()  # nothing was retried on node-b
        await edge.assert_drained()
