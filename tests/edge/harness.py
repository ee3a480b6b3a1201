"""Harness for the in-process Edge tests: a running EdgeService, fake and real nodes.

Every test runs :meth:`iop_edge.EdgeService.serve` in its own nursery on
127.0.0.1 port 0 (HTTP API and node socket), talks to it with ``httpx`` and
drives it with either

- a :class:`FakeNode`: a bare ``trio_websocket`` client written here, which
  speaks the wire protocol step by step, so a test controls exactly when a run
  gets an answer, when the node goes silent and how its socket ends; or
- a real in-process Node (:func:`real_node`): ``iop_node.EdgeClient`` +
  ``NodeRuntime`` with ``adapter: mock`` providers or the ``openai`` adapter in
  front of an in-process :class:`~iop_mock.MockBackend`.

The config is the shared-provider layout of [cross-model-tests]: model keys
``ornith:35b`` and ``ornith-fast`` both on the capacity-1 provider
``node-a/gpu0``; ``ornith:35b`` may fall back to ``node-b/gpu1``.
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import h11
import httpx
import openai
import trio
import trio.testing
from trio_websocket import ConnectionClosed, WebSocketConnection, wrap_client_stream

from iop_edge import EdgeService
from iop_edge.config import load_edge_config
from iop_node import EdgeClient, NodeConfig, NodeRuntime, ProviderConfig, RuntimeConfig
from iop_wire import (
    PROTOCOL_VERSION,
    Cancel,
    Heartbeat,
    Leader,
    Message,
    ProviderInfo,
    Register,
    Registered,
    Rejected,
    Run,
    RunData,
    RunEnd,
    decode,
    encode,
    encode_data,
)

BIG = "ornith:35b"
FAST = "ornith-fast"
TOKEN_A = "tok-A-5e4f1d2c-sentinel"
TOKEN_B = "tok-B-9a7b3c1e-sentinel"
ADMIN_TOKEN = "admin-7c1d-sentinel"
LONG_THRESHOLD = 100
"""long_context_threshold_tokens of both model keys."""


@attrs.define(kw_only=True)
class EdgeLayout:
    """The knobs of the test ``edge.yaml`` (everything else is fixed)."""

    gpu0_capacity: int = 1
    gpu0_long_capacity: int = 1
    gpu0_enabled: bool = True
    gpu0_admit_by: str = "slots"  # "both": its long slots' tokens (window x long capacity) are a budget
    max_queue: int = 8
    queue_timeout_ms: int = 20_000
    heartbeat_timeout_ms: int = 15_000
    admin_token: str | None = ADMIN_TOKEN
    api_keys: tuple[str, ...] | None = None
    max_body_bytes: int = 64 * 1024
    max_ws_message_bytes: int = 64 * 1024
    shed_loop_lag_ms: int = 600_000
    """Lag shedding off: on a busy test machine the loop may lag; shedding has its own tests."""
    shed_connections: int = 6144
    max_retry_after_s: int = 30
    """Also the longest a refused connection is left unread (pacing)."""
    extra: tuple[str, ...] = ()
    """More top-level lines, e.g. ``"node_max_pending: 4"``."""
    retry: str | None = None  # provider_pool.retry, e.g. "{max_attempts: 3}"
    outlier: str | None = None  # provider_pool.outlier, e.g. "{consecutive_failures: 2}"
    first_token_timeout_ms: int | None = None  # of ornith:35b
    model_keys: tuple[str, ...] = ()
    """More keys of ornith:35b's entry, e.g. ``"min_attempt_ms: 500"``."""

    def yaml(self) -> str:
        """The ``edge.yaml`` text for this layout."""
        lines = [
            "listen: 127.0.0.1:0",
            "node_listen: 127.0.0.1:0",
            f"heartbeat_timeout_ms: {self.heartbeat_timeout_ms}",
            f"provider_pool: {{max_queue: {self.max_queue}, queue_timeout_ms: {self.queue_timeout_ms}"
            + (f", retry: {self.retry}" if self.retry else "")
            + (f", outlier: {self.outlier}" if self.outlier else "")
            + "}",
            f"max_body_bytes: {self.max_body_bytes}",
            f"max_ws_message_bytes: {self.max_ws_message_bytes}",
            f"overload: {{shed_loop_lag_ms: {self.shed_loop_lag_ms}, shed_connections: {self.shed_connections},"
            f" max_retry_after_s: {self.max_retry_after_s}}}",
            *self.extra,
        ]
        if self.admin_token is not None:
            lines.append(f"admin_token: {self.admin_token}")
        if self.api_keys is not None:
            lines.append(f"api_keys: [{', '.join(self.api_keys)}]")
        window = 8192
        lines += [
            "nodes:",
            "  - id: node-a",
            f"    token: {TOKEN_A}",
            "    providers:",
            f"      - {{id: gpu0, capacity: {self.gpu0_capacity},"
            f" long_context_capacity: {self.gpu0_long_capacity},"
            f" context_window_tokens: {window},"
            f" total_context_tokens: {window * self.gpu0_long_capacity},"
            f" priority: 3, enabled: {str(self.gpu0_enabled).lower()}, admit_by: {self.gpu0_admit_by}}}",
            "  - id: node-b",
            f"    token: {TOKEN_B}",
            "    providers:",
            f"      - {{id: gpu1, capacity: 1, long_context_capacity: 1,"
            f" context_window_tokens: {window}, total_context_tokens: {window}, priority: 0}}",
            "models:",
            f'  - id: "{BIG}"',
            f"    long_context_threshold_tokens: {LONG_THRESHOLD}",
            *([f"    first_token_timeout_ms: {self.first_token_timeout_ms}"] if self.first_token_timeout_ms else []),
            *(f"    {line}" for line in self.model_keys),
            "    candidates:",
            '      - {node: node-a, provider: gpu0, upstream_model: "qwen3:35b"}',
            '      - {node: node-b, provider: gpu1, upstream_model: "qwen3:35b-b"}',
            f"  - id: {FAST}",
            f"    long_context_threshold_tokens: {LONG_THRESHOLD}",
            "    candidates:",
            '      - {node: node-a, provider: gpu0, upstream_model: "qwen3:35b-fast"}',
        ]
        return "\n".join(lines) + "\n"


@attrs.define(eq=False)
class Edge:
    """A running Edge: the service, its ports, an HTTP client and its config file."""

    service: EdgeService
    http: httpx.AsyncClient
    http_port: int
    node_port: int
    config_path: Path

    # -------------------------------------------------------------- HTTP helpers

    async def chat(
        self, model: str, content: str = "hi", *, headers: dict[str, str] | None = None, **fields: Any
    ) -> httpx.Response:
        """POST /v1/chat/completions (non-stream unless ``stream=True`` is given)."""
        body = {"model": model, "messages": [{"role": "user", "content": content}], **fields}
        return await self.http.post("/v1/chat/completions", json=body, headers=headers)

    def openai_client(self, *, api_key: str = "k", max_retries: int = 0) -> openai.AsyncOpenAI:
        """The official async ``openai`` client on this Edge's ``/v1`` (use it as ``async with``)."""
        return openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{self.http_port}/v1", api_key=api_key, max_retries=max_retries
        )

    async def status(self) -> dict[str, Any]:
        """GET /status as JSON."""
        response = await self.http.get("/status")
        assert response.status_code == 200
        return response.json()

    def provider(self, node_id: str, provider_id: str) -> dict[str, Any]:
        """The admission snapshot of one provider, as a /status provider entry."""
        snap = self.service.admission.snapshot().provider(node_id, provider_id)
        return attrs.asdict(snap)

    @property
    def queue_depth(self) -> int:
        return self.service.admission.snapshot().queue_depth

    def rewrite(self, layout: EdgeLayout) -> None:
        """Replace the config file (for reload tests)."""
        self.config_path.write_text(layout.yaml())

    # -------------------------------------------------------------- assertions

    def _drained(self) -> bool:
        snap = self.service.admission.snapshot()
        return snap.queue_depth == 0 and all(p.in_flight == p.long_in_flight == 0 for p in snap.providers)

    async def assert_drained(self) -> None:
        """[lease-lifecycle] drain check: every counter 0, the queue empty.

        A client may read the last byte of its response just before the
        Edge's handler leaves its lease scope, so the check first lets every
        task settle (each settle re-polls the sockets).
        """
        for _ in range(100):
            if self._drained():
                break
            await trio.testing.wait_all_tasks_blocked(cushion=0.002)
        snap = self.service.admission.snapshot()
        assert snap.queue_depth == 0
        for p in snap.providers:
            assert (p.in_flight, p.long_in_flight, p.queued, p.long_queued) == (0, 0, 0, 0), p


async def eventually(condition: Callable[[], bool]) -> None:
    """Wait until ``condition()`` holds, re-checking whenever every task is blocked.

    The caller bounds the wait with ``trio.fail_after``.
    """
    while not condition():
        await trio.testing.wait_all_tasks_blocked(cushion=0.002)


@asynccontextmanager
async def running_edge(tmp_path: Path, layout: EdgeLayout | None = None) -> AsyncIterator[Edge]:
    """Write ``edge.yaml`` for ``layout``, serve an Edge from it, yield it, stop it."""
    path = tmp_path / "edge.yaml"
    path.write_text((layout or EdgeLayout()).yaml())
    service = EdgeService(load_edge_config(path), config_path=path)
    async with trio.open_nursery() as nursery:
        http_port, node_port = await nursery.start(service.serve)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=30) as http:
            yield Edge(service, http, http_port, node_port, path)
        nursery.cancel_scope.cancel()


def start_chat(
    nursery: trio.Nursery, edge: Edge, results: dict[str, httpx.Response], name: str, model: str, **fields: Any
) -> None:
    """Start ``edge.chat(model, name, **fields)`` in ``nursery``; its response lands in ``results[name]``."""

    async def post() -> None:
        results[name] = await edge.chat(model, name, **fields)

    nursery.start_soon(post)


# ---------------------------------------------------------------------------- fake node


@attrs.define(eq=False)
class FakeNode:
    """A wire-protocol node driven by the test; ``stream`` is its raw TCP stream."""

    ws: WebSocketConnection
    stream: trio.SocketStream
    node_id: str
    protocol: int = PROTOCOL_VERSION
    registered: Registered | None = None
    rejected: Rejected | None = None
    leaders: list[Leader] = attrs.field(factory=list)
    runs_received: list[Run] = attrs.field(factory=list)
    _framed: dict[str, int] = attrs.field(factory=dict)
    """Runs whose output :meth:`send_json` framed, and the seq of their next record."""
    _streams: dict[str, bool] = attrs.field(factory=dict)
    """Whether each run this node was given (:meth:`next_run`, :meth:`answer`) is streamed."""

    async def send(self, message: Message) -> None:
        """Send ``message``; a streamed run's ``ok`` end whose output :meth:`send_json` framed goes
        behind the ``data: [DONE]`` a node relays from its backend."""
        if isinstance(message, RunEnd) and message.status == "ok" and message.run_id in self._framed:
            await self._done(message.run_id)
        await self.ws.send_message(encode(message))

    async def send_data(self, *records: RunData) -> None:
        """One data frame holding ``records``."""
        await self.ws.send_message(encode_data(records))

    async def send_json(self, run_id: str, data: dict[str, Any] | None) -> None:
        """``data`` as a node relays it, in one data record: an SSE event of a streamed run
        (``data: [DONE]`` for None), or a non-stream run's whole JSON body."""
        seq = self._framed.get(run_id, 0)
        self._framed[run_id] = seq + 1
        body = b"[DONE]" if data is None else json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()
        await self.send_data(RunData(run_id, seq, b"data: " + body + b"\n\n" if self._streams[run_id] else body))

    async def _done(self, run_id: str) -> None:
        """A streamed run's ``data: [DONE]``, as its backend writes it (a non-stream run has none)."""
        if self._streams[run_id]:
            await self.send_json(run_id, None)

    async def receive(self) -> Message:
        """The next Edge message."""
        return decode(await self.ws.get_message())

    async def register(self, token: str, providers: Iterable[str]) -> Registered | Rejected:
        infos = tuple(ProviderInfo(p, "mock", 1) for p in providers)
        await self.send(Register(self.node_id, token, self.protocol, infos))
        answer = await self.receive()
        assert isinstance(answer, Registered | Rejected), answer
        if isinstance(answer, Registered):
            self.registered = answer
        else:
            self.rejected = answer
        return answer

    async def next_run(self) -> Run:
        """The next run, as a real node serves it (``Run.for_upstream()``: from v5 the upstream model
        put into the client's body); the run as received is in :attr:`runs_received`."""
        message = await self._next_after_leaders()
        assert isinstance(message, Run), message
        self.runs_received.append(message)
        self._streams[message.run_id] = message.stream
        return message.for_upstream()

    async def next_cancel(self) -> Cancel:
        message = await self._next_after_leaders()
        assert isinstance(message, Cancel), message
        return message

    async def _next_after_leaders(self) -> Message:
        """The next Edge message that is not a ``leader`` (an HA leader's: kept in :attr:`leaders`)."""
        while isinstance(message := await self.receive(), Leader):
            self.leaders.append(message)
        return message

    async def answer(self, run: Run, text: str = "ok") -> None:
        """Finish ``run`` successfully: one chunk (stream) or one whole response."""
        self._streams[run.run_id] = run.stream
        await self.send_json(run.run_id, chat_chunk(text) if run.stream else chat_response(text))
        await self.send(RunEnd(run.run_id, "ok"))

    async def heartbeat(self, seq: int = 1) -> None:
        await self.send(Heartbeat(seq))

    async def drop(self) -> None:
        """Close the TCP stream without a WebSocket close (a vanished peer)."""
        await self.stream.aclose()


@asynccontextmanager
async def fake_node(
    edge: Edge,
    node_id: str = "node-a",
    *,
    token: str | None = None,
    providers: Iterable[str] = ("gpu0",),
    register: bool = True,
    protocol: int = PROTOCOL_VERSION,
) -> AsyncIterator[FakeNode]:
    """Connect a :class:`FakeNode` to the Edge's node socket (registered unless told not to).

    On exit the WebSocket is closed normally (1000) if it is still open, and
    the TCP stream is always closed.
    """
    if token is None:
        token = TOKEN_A if node_id == "node-a" else TOKEN_B
    async with trio.open_nursery() as nursery:
        stream = await trio.open_tcp_stream("127.0.0.1", edge.node_port)
        try:
            ws = await wrap_client_stream(nursery, stream, "127.0.0.1", "/", max_message_size=1 << 24)
            node = FakeNode(ws, stream, node_id, protocol)
            try:
                if register:
                    answer = await node.register(token, providers)
                    assert isinstance(answer, Registered), answer
                yield node
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    try:
                        await ws.aclose()
                    except ConnectionClosed:
                        pass
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await stream.aclose()
        nursery.cancel_scope.cancel()


def chat_response(text: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": 0,
        "model": "fake",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def chat_chunk(text: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "fake",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }


def sse_events(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded (``[DONE]`` kept as a string)."""
    out: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


# ---------------------------------------------------------------------------- real node


def node_config(edge: Edge, node_id: str, providers: Iterable[ProviderConfig], *, concurrency: int = 4) -> NodeConfig:
    token = TOKEN_A if node_id == "node-a" else TOKEN_B
    return NodeConfig(
        node_id=node_id,
        edge_url=f"ws://127.0.0.1:{edge.node_port}",
        providers=tuple(providers),
        token=token,
        runtime=RuntimeConfig(concurrency=concurrency),
    )


@asynccontextmanager
async def real_node(edge: Edge, config: NodeConfig) -> AsyncIterator[EdgeClient]:
    """Run an in-process Node (EdgeClient + NodeRuntime) until the block ends; wait for registration."""
    async with NodeRuntime.from_config(config) as runtime:
        client = EdgeClient(config, runtime, rng=random.Random(7))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.run)
            await eventually(lambda: edge.service.admission.is_connected(config.node_id))
            try:
                yield client
            finally:
                client.shutdown()


def mock_provider(provider_id: str = "gpu0", **knobs: Any) -> ProviderConfig:
    """An ``adapter: mock`` provider of capacity 1."""
    return ProviderConfig(id=provider_id, adapter="mock", capacity=1, **knobs)


async def h11_answer(client: h11.Connection, stream: trio.abc.ReceiveStream) -> tuple[h11.Response, bytes]:
    """Read one whole answer from ``stream`` with the client connection ``client``: its head and body."""
    response: h11.Response | None = None
    body = bytearray()
    while not isinstance(event := client.next_event(), h11.EndOfMessage):
        if event is h11.NEED_DATA:
            client.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Response):
            response = event
        elif isinstance(event, h11.Data):
            body += event.data
    assert response is not None
    return response, bytes(body)
