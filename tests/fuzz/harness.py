"""One Edge that outlives every Hypothesis example, plus the fuzz strategies.

pytest-trio runs each Hypothesis example in a fresh ``trio.run``. A fuzz check
is about the *same* process surviving bad input, so the Edge (and a real
in-process Node, ``node-a``, with a ``mock`` provider that answers healthy
requests) runs in a thread of its own for the whole session
(:class:`EdgeThread`); examples talk to it over loopback sockets only and read
its counters through ``GET /status``, the public path.

``node-b`` is configured but never started: examples register as ``node-b``
(with its token) when they need a registered connection to abuse, and the
model ``fuzz-b`` is served by ``node-b/gpu1`` only, so a request for it is a
run in flight on that connection.
"""

from __future__ import annotations

import json
import queue
import random
import threading
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio
from hypothesis import strategies as st

from iop_edge import EdgeService
from iop_edge.config import load_edge_config
from iop_node import EdgeClient, NodeConfig, NodeRuntime, ProviderConfig, ReconnectConfig, RuntimeConfig
from iop_wire import (
    PROTOCOL_VERSION,
    Cancel,
    EngineView,
    Heartbeat,
    ProviderHealth,
    ProviderInfo,
    Register,
    Registered,
    Rejected,
    Run,
    RunEnd,
    TunnelChunk,
    TunnelEnd,
    TunnelRequest,
    TunnelStart,
    encode,
)

TOKEN_A = "fuzz-token-a"
TOKEN_B = "fuzz-token-b"
HEALTHY_MODEL = "fuzz-a"
NODE_B_MODEL = "fuzz-b"
MAX_BODY_BYTES = 16 * 1024
MAX_WS_MESSAGE_BYTES = 16 * 1024
START_TIMEOUT = 20.0

EDGE_YAML = f"""\
listen: 127.0.0.1:0
node_listen: 127.0.0.1:0
heartbeat_timeout_ms: 30000
provider_pool: {{max_queue: 16, queue_timeout_ms: 10000}}
max_body_bytes: {MAX_BODY_BYTES}
max_ws_message_bytes: {MAX_WS_MESSAGE_BYTES}
nodes:
  - id: node-a
    token: {TOKEN_A}
    providers:
      - {{id: gpu0, capacity: 4}}
  - id: node-b
    token: {TOKEN_B}
    providers:
      - {{id: gpu1, capacity: 1}}
models:
  - id: {HEALTHY_MODEL}
    candidates: [{{node: node-a, provider: gpu0, upstream_model: mock-a}}]
  - id: {NODE_B_MODEL}
    candidates: [{{node: node-b, provider: gpu1, upstream_model: mock-b}}]
"""

COUNTERS = ("in_flight", "long_in_flight", "queued", "long_queued")


@attrs.define(eq=False)
class EdgeThread:
    """An Edge (config :data:`EDGE_YAML`, written to ``config_path``) and the node ``node-a``,
    served by ``trio.run`` in a daemon thread."""

    config_path: Path
    http_port: int = 0
    node_port: int = 0
    _thread: threading.Thread | None = None
    _token: trio.lowlevel.TrioToken | None = None
    _scope: trio.CancelScope | None = None

    def start(self) -> None:
        """Start the thread and wait until the Edge listens and ``node-a`` is registered."""
        self.config_path.write_text(EDGE_YAML)
        ready: queue.Queue[BaseException | tuple[int, int]] = queue.Queue()
        self._thread = threading.Thread(target=self._main, args=(ready,), name="fuzz-edge", daemon=True)
        self._thread.start()
        outcome = ready.get(timeout=START_TIMEOUT)
        if isinstance(outcome, BaseException):
            raise outcome
        self.http_port, self.node_port = outcome

    @property
    def alive(self) -> bool:
        """Whether the Edge's thread still runs (an exception escaping the Edge would end it)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Cancel the thread's run and join it."""
        if self._token is not None and self._scope is not None:
            trio.from_thread.run_sync(self._scope.cancel, trio_token=self._token)
        if self._thread is not None:
            self._thread.join(timeout=START_TIMEOUT)
            assert not self._thread.is_alive(), "the fuzz Edge thread did not stop"

    def _main(self, ready: queue.Queue[BaseException | tuple[int, int]]) -> None:
        try:
            trio.run(self._serve, ready)
        except BaseException as exc:  # reported to the starting thread, if it still waits
            ready.put(exc)

    async def _serve(self, ready: queue.Queue[BaseException | tuple[int, int]]) -> None:
        service = EdgeService(load_edge_config(self.config_path))
        async with trio.open_nursery() as nursery:
            self._scope = nursery.cancel_scope
            self._token = trio.lowlevel.current_trio_token()
            http_port, node_port = await nursery.start(service.serve)
            config = NodeConfig(
                node_id="node-a",
                edge_url=f"ws://127.0.0.1:{node_port}",
                providers=(ProviderConfig(id="gpu0", adapter="mock", capacity=4),),
                token=TOKEN_A,
                runtime=RuntimeConfig(concurrency=4),
                reconnect=ReconnectConfig(initial_ms=10, max_ms=100),
            )
            async with NodeRuntime.from_config(config) as runtime:
                client = EdgeClient(config, runtime, rng=random.Random(1))
                nursery.start_soon(client.run)
                with trio.fail_after(START_TIMEOUT):
                    while not service.admission.is_connected("node-a"):
                        await trio.sleep(0.01)
                ready.put((http_port, node_port))
                await trio.sleep_forever()


# ------------------------------------------------------------------ checks


async def assert_healthy(http: httpx.AsyncClient) -> None:
    """[lease-lifecycle] The Edge still serves: a healthy request succeeds, then every counter is 0.

    Polls ``/status`` (the caller bounds the wait with ``trio.fail_after``):
    a fenced lease is released at once, but its handler answers the client
    before the registry forgets the link, so ``connected`` may lag a moment.
    """
    body = {"model": HEALTHY_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "chat.completion"
    while True:
        status = (await http.get("/status")).json()
        nodes = {n["node_id"]: n for n in status["nodes"]}
        drained = status["queue_depth"] == 0 and all(p[name] == 0 for p in status["providers"] for name in COUNTERS)
        if drained and nodes["node-a"]["connected"] and not nodes["node-b"]["connected"]:
            return
        await trio.sleep(0.005)


# -------------------------------------------------------------- strategies

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
"""Any JSON document (small)."""

_TYPES = (
    "register",
    "heartbeat",
    "run_end",
    "tunnel_start",
    "tunnel_chunk",
    "tunnel_end",
    "provider_health",
    "registered",
    "rejected",
    "run",
    "cancel",
    "tunnel_request",
)

_VALID_MESSAGES = (
    Register("node-b", TOKEN_B, PROTOCOL_VERSION, (ProviderInfo("gpu1", "mock", 1),)),
    Heartbeat(1),
    RunEnd("r999999", "ok"),
    TunnelStart("r999999", 200, (("a", "b"),)),
    TunnelChunk("r999999", "aGk="),
    TunnelEnd("r999999", "error", "upstream_error", "boom"),
    ProviderHealth("gpu1", "ready", "", None, EngineView(0.5, 100, 200, 3, 1, 0)),
    Registered("node-b", 7, 1000),
    Rejected("bad_token", "no", False),
    Run("r999999", "gpu1", "chat/completions", {"model": "m"}, False),
    Cancel("r999999"),
    TunnelRequest("r999999", "gpu1", "GET", "/v1/models"),
)


@st.composite
def mutated_messages(draw: st.DrawFn) -> str:
    """A real message with one field dropped, retyped or added, or its type swapped."""
    fields: dict[str, Any] = json.loads(encode(draw(st.sampled_from(_VALID_MESSAGES))))
    action = draw(st.sampled_from(["drop", "retype", "extra", "swap_type", "bad_type_tag", "nested"]))
    names = [k for k in fields if k != "type"]
    nested = [k for k in names if isinstance(fields[k], dict) and fields[k] and k != "body"]
    if action == "nested":  # a field of a nested object (provider_health.engine) retyped, if it has one
        if nested:
            inner = fields[draw(st.sampled_from(nested))]
            inner[draw(st.sampled_from(sorted(inner)))] = draw(json_values | st.floats(allow_nan=False))
    elif action == "drop" and names:
        del fields[draw(st.sampled_from(names))]
    elif action == "retype" and names:
        fields[draw(st.sampled_from(names))] = draw(json_values)
    elif action == "extra":
        fields[draw(st.text(min_size=1, max_size=8).filter(lambda k: k not in fields))] = draw(json_values)
    elif action == "swap_type":
        fields["type"] = draw(st.sampled_from(_TYPES))
    else:
        fields["type"] = draw(json_values)
    return json.dumps(fields)


@st.composite
def truncated_messages(draw: st.DrawFn) -> str:
    """A real message cut short (never empty, never whole)."""
    text = encode(draw(st.sampled_from(_VALID_MESSAGES)))
    return text[: draw(st.integers(min_value=0, max_value=len(text) - 1))]


def oversized_frames(limit: int) -> st.SearchStrategy[str]:
    """A text frame just over ``limit`` bytes: valid-looking JSON padding, or plain filler."""
    return st.sampled_from(["json", "filler"]).map(
        lambda kind: (
            json.dumps({"type": "heartbeat", "seq": 1, "pad": "x" * limit}) if kind == "json" else "y" * (limit + 1)
        )
    )


def frames(limit: int | None) -> st.SearchStrategy[str | bytes]:
    """Frames for a wire-protocol receiver: garbage, wrong shapes, truncated, valid, and
    (unless ``limit`` is None) oversized."""
    oversized = [] if limit is None else [oversized_frames(limit)]
    return st.one_of(
        st.text(max_size=64),
        st.binary(max_size=64),
        json_values.map(json.dumps),
        st.dictionaries(st.text(max_size=8), json_values, max_size=4).map(
            lambda d: json.dumps({"type": "register", **d})
        ),
        mutated_messages(),
        truncated_messages(),
        *oversized,
        st.sampled_from(_VALID_MESSAGES).map(encode),
    )
