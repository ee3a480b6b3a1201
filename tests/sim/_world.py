"""The seeded whole-system simulation: one Edge, two Nodes, clients and faults in one trio run.

(:mod:`tests.sim._ha` extends :class:`World` to an HA group of Edges.)

Everything runs in a single ``trio.run`` on ``MockClock(autojump_threshold=0)``:

- the real Edge (:class:`iop_edge.EdgeService`: admission, node registry, the
  ASGI :class:`~iop_edge.api.app.EdgeAPI`), with no sockets: each node
  connection is a :class:`~tests.sim._wire.Wire` (memory streams) served by
  ``NodeRegistry.serve_stream`` as the node socket's listener serves a TCP
  connection (pending caps, handshake deadline, the Edge's ``NodeSocket``);
- two real Nodes (:class:`iop_node.EdgeClient` + ``EdgeSession`` +
  :class:`iop_node.NodeRuntime` with its ``LocalGate``), their connector
  injected (the node's own ``EdgeSocket`` over the same wire); every provider is the
  in-process :class:`iop_node.MockAdapter`, behind a thin :class:`SimBackend`
  that counts concurrent upstream requests per provider and can hang;
- clients that call the ASGI app directly with a fake receive/send pair.

Private reads, on purpose: the invariant checker reads
``service.admission._core`` (waiters, provider states and health, live leases)
because the properties it checks -- work conservation, no stranded waiter,
leases per generation, one probe per ejection -- are about exactly that state; the ``stale_close_after_reconnect``
fault calls ``NodeRegistry._release`` on an old link (see :func:`World.fault_stale_close`).
Nothing in the sim writes private state.
"""

from __future__ import annotations

import gc
import hashlib
import json
import random
import typing
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

import attrs
import hypothesis  # noqa: F401 -- see run_seed: loading it makes trio's scheduling repeatable
import trio
import trio.testing
from trio_websocket import ConnectionClosed, HandshakeError

from iop_admission import LocalGate, ProviderKey
from iop_edge import EdgeService
from iop_edge.config import (
    EdgeCandidate,
    EdgeConfig,
    EdgeModel,
    EdgeNode,
    EdgeProvider,
    OutlierSettings,
    ProviderPool,
    RetrySettings,
)
from iop_edge.nodes.link import NodeLink
from iop_node import (
    EdgeClient,
    MockAdapter,
    NodeConfig,
    NodeRuntime,
    ProviderConfig,
    ReconnectConfig,
    RuntimeConfig,
    UpstreamFailed,
    UpstreamUnreachable,
    relay_encoded,
)
from iop_node.edges.websocket import EdgeSocket
from iop_wire import PROTOCOL_VERSION, ProviderInfo, Register, Registered, decode, encode

from ._wire import EDGE, NODE, Wire, node_socket, one_source, serve_edge_end

SITES = (
    "ws_send_failure",
    "connection_drop",
    "graceful_close",
    "duplicate_registration",
    "stale_close_after_reconnect",
    "client_cancel",
    "upstream_error_mid_stream",
    "upstream_hang",
    "refresh_below_in_flight",
    "disable_enable",
    "queue_policy_change",
    "stalled_event_subscriber",
    "clock_jump_past_queue_timeout",
    "backend_down",
    "upstream_5xx_burst",
    "first_token_never",
)
"""Named fault sites. Each is enabled in a run with p=ENABLE_P and fires with p=FIRE_P when reached."""

REQUEST_SITES = frozenset({"client_cancel", "upstream_error_mid_stream", "upstream_hang"})
"""Sites reached once per client request; the others are reached on every fault tick."""

ENABLE_P = 0.25
FIRE_P = 0.25

# ---------------------------------------------------------------- the topology

TOKEN = "sim-token"
HEARTBEAT_TIMEOUT_MS = 3000
NODE_HEARTBEAT_MS = 1000
LONG_THRESHOLD = 256
QUEUE_TIMEOUT_MS = 2000
MAX_QUEUE = 8
FIRST_TOKEN_TIMEOUT_MS = 1500
"""Of both model keys ([first-token-timeout]): below the queue timeout, so one retry fits."""
MAX_ATTEMPTS = 2
LOAD_WINDOW = 8.0
"""Virtual seconds during which requests arrive and faults fire; then everything heals."""
LIVENESS_BOUND = 60.0
"""Virtual seconds after healing within which every request must have ended."""

PROVIDERS: dict[ProviderKey, EdgeProvider] = {
    ProviderKey("node-a", "gpu0"): EdgeProvider(
        id="gpu0", capacity=2, long_context_capacity=1, context_window_tokens=4096, total_context_tokens=4096
    ),
    ProviderKey("node-a", "gpu1"): EdgeProvider(id="gpu1", capacity=1),
    ProviderKey("node-b", "gpu0"): EdgeProvider(
        id="gpu0", capacity=1, long_context_capacity=1, context_window_tokens=4096, total_context_tokens=4096
    ),
}
MODELS: dict[str, tuple[ProviderKey, ...]] = {
    # Two model keys share node-a/gpu0; each has a second provider of its own.
    "ornith:35b": (ProviderKey("node-a", "gpu0"), ProviderKey("node-b", "gpu0")),
    "ornith-fast": (ProviderKey("node-a", "gpu0"), ProviderKey("node-a", "gpu1")),
}
NODES = ("node-a", "node-b")

EXPECTED_ERRORS = frozenset(
    {
        "429:queue_full",
        "429:queue_timeout",
        "503:unavailable",
        "503:provider_busy",
        "502:upstream_error",
        "502:node_disconnected",
        "502:client_too_slow",
        "502:first_token_timeout",
    }
)
"""Explicit error answers a client may legitimately get under these faults."""


@attrs.frozen
class Overrides:
    """What the refresh faults changed relative to the base config."""

    capacity: tuple[tuple[ProviderKey, int], ...] = ()
    disabled: frozenset[ProviderKey] = frozenset()
    max_queue: int = MAX_QUEUE
    queue_timeout_ms: int = QUEUE_TIMEOUT_MS


def edge_config(o: Overrides = Overrides()) -> EdgeConfig:
    """The Edge config for ``o`` (built directly: no YAML parsing in the hot loop)."""
    capacity = dict(o.capacity)
    nodes = []
    for node_id in NODES:
        providers = []
        for key, p in PROVIDERS.items():
            if key.node_id != node_id:
                continue
            cap = capacity.get(key, p.capacity)
            providers.append(
                attrs.evolve(
                    p,
                    capacity=cap,
                    long_context_capacity=min(p.long_context_capacity, cap),
                    total_context_tokens=p.context_window_tokens * min(p.long_context_capacity, cap),
                    enabled=key not in o.disabled,
                )
            )
        nodes.append(EdgeNode(id=node_id, providers=tuple(providers), token=TOKEN))
    models = tuple(
        EdgeModel(
            id=name,
            candidates=tuple(
                EdgeCandidate(node=k.node_id, provider=k.provider_id, upstream_model="qwen3:35b") for k in keys
            ),
            long_context_threshold_tokens=LONG_THRESHOLD,
            first_token_timeout_ms=FIRST_TOKEN_TIMEOUT_MS,
        )
        for name, keys in MODELS.items()
    )
    config = EdgeConfig(
        nodes=tuple(nodes),
        models=models,
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
        provider_pool=ProviderPool(
            max_queue=o.max_queue,
            queue_timeout_ms=o.queue_timeout_ms,
            retry=RetrySettings(max_attempts=MAX_ATTEMPTS),
            outlier=OutlierSettings(consecutive_failures=2, base_ejection_ms=1000, max_ejection_ms=4000),
        ),
    )
    return one_source(config)


def node_config(node_id: str) -> NodeConfig:
    providers = tuple(
        ProviderConfig(id=k.provider_id, adapter="mock", capacity=p.capacity)
        for k, p in PROVIDERS.items()
        if k.node_id == node_id
    )
    return NodeConfig(
        node_id=node_id,
        edge_url="ws://edge.sim.invalid",
        providers=providers,
        token=TOKEN,
        heartbeat_interval_ms=NODE_HEARTBEAT_MS,
        runtime=RuntimeConfig(concurrency=sum(p.capacity for p in providers)),
        reconnect=ReconnectConfig(initial_ms=100, max_ms=1000, jitter=0.2),
    )


# ----------------------------------------------------------------- the workload


@attrs.frozen
class RequestPlan:
    """One client request, decided up front from the seed."""

    number: int
    at: float
    model: str
    long: bool
    stream: bool
    max_tokens: int
    latency: float
    tokens_per_second: float
    cancel_after: float | None = None
    cancel_after_sends: int | None = None
    fail_after_chunks: int | None = None
    hang: bool = False

    def body(self) -> bytes:
        content = "x" * (LONG_THRESHOLD * 4 + 40 if self.long else 40)
        sim = {
            "n": self.number,
            "latency": self.latency,
            "tps": self.tokens_per_second,
            "fail_after": self.fail_after_chunks,
            "hang": self.hang,
        }
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.max_tokens,
            "stream": self.stream,
            "sim": sim,
        }
        return json.dumps(body).encode()


@attrs.define(eq=False)
class Outcome:
    """What one client saw."""

    status: int | None = None
    headers: dict[bytes, bytes] = attrs.field(factory=dict)
    body: bytearray = attrs.field(factory=bytearray)
    finished: bool = False
    gone: bool = False
    sends: int = 0
    ended_at: float | None = None
    result: str = "pending"
    head_order: int = 0


@attrs.define(eq=False)
class SeedResult:
    """The figures of one seed."""

    seed: int
    steps: int = 0
    requests: int = 0
    enabled: tuple[str, ...] = ()
    fired: Counter[str] = attrs.field(factory=Counter)
    outcomes: Counter[str] = attrs.field(factory=Counter)
    violations: list[str] = attrs.field(factory=list)
    trace: list[str] = attrs.field(factory=list)
    virtual_time: float = 0.0
    outside_wakeups: int = 0
    """Steps of trio's task for work from outside the loop (callbacks queued by
    a thread or a garbage-collected async generator, signals): each changes a
    batch of runnable tasks, so a run that saw one need not repeat its seed's
    trace."""

    @property
    def trace_hash(self) -> str:
        """Hash of the trace with events of one virtual instant in sorted order.

        Which of several tasks woken at the same instant runs first can depend
        on trio's internal set iteration (object ids), e.g. the order in which
        waiters whose deadlines a clock jump passed together see their
        timeout. Their outcomes do not depend on it, so same-instant events are
        compared as a set; the order across instants is kept.
        """
        lines = sorted(self.trace, key=lambda line: (float(line.partition(" ")[0]), line))
        return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


# ------------------------------------------------------------------ the backend


@attrs.define(eq=False)
class SimBackend:
    """The node's adapter: the real :class:`MockAdapter`, built per request from the
    request's ``sim`` knobs, with upstream in-flight counting and a hang fault."""

    world: World
    key: ProviderKey

    async def run(self, endpoint: str, body: dict[str, Any], *, stream: bool) -> AsyncIterator[dict[str, Any]]:
        """Yield the mock's chunks. Checkpoints; cancellation closes the mock run."""
        sim = body.get("sim") or {}
        mock = MockAdapter(
            latency=float(sim.get("latency", 0.0)),
            tokens_per_second=float(sim.get("tps", 0.0)),
            fail_after_chunks=sim.get("fail_after"),
        )
        world = self.world
        world.run_started(int(sim.get("n", 0)), self.key)
        world.upstream_enter(self.key)
        try:
            await world.provider_faults(self.key)
            if sim.get("hang") and not world.unhang.is_set():
                world.fired("upstream_hang", f"{self.key}")
                await world.unhang.wait()
            async with aclosing(mock.run(endpoint, body, stream=stream)) as events:
                async for event in events:
                    yield event
        except UpstreamFailed:
            world.fired("upstream_error_mid_stream", f"{self.key}")
            raise
        finally:
            world.upstream_exit(self.key)

    async def relay(
        self, endpoint: str, body: dict[str, Any], *, stream: bool, send: Callable[[bytes], Awaitable[None]]
    ) -> None:
        """:meth:`run` as the client's bytes (wire v2)."""
        await relay_encoded(self.run(endpoint, body, stream=stream), stream=stream, send=send)

    def tunnel(self, method: str, path: str, headers: Any, body: bytes) -> AsyncIterator[Any]:
        raise NotImplementedError("the simulation sends no tunnel requests")

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


# -------------------------------------------------------------------- the world


class World:
    """One seed's system, faults and checks.

    The hooks :mod:`tests.sim._ha` overrides for Edge replicas: :attr:`sites`,
    :attr:`expected_errors`, :meth:`edge_config`, :meth:`front`, :meth:`watching`,
    :meth:`connected` (and the checks, fault and node methods themselves).
    """

    sites: tuple[str, ...] = SITES
    expected_errors: frozenset[str] = EXPECTED_ERRORS
    backend: type[SimBackend] = SimBackend
    """The node's adapter per provider (the tenant world's reports usage)."""

    def __init__(self, seed: int, clock: trio.testing.MockClock) -> None:
        self.seed = seed
        self.clock = clock
        self.rng = random.Random(f"sim:{seed}:plan")
        self.frng = random.Random(f"sim:{seed}:faults")
        self.result = SeedResult(seed)
        self.enabled = frozenset(s for s in self.sites if self.rng.random() < ENABLE_P)
        self.result.enabled = tuple(s for s in self.sites if s in self.enabled)
        self.overrides = Overrides()
        self.service = EdgeService(self.edge_config(self.overrides))
        self.unhang = trio.Event()
        self.upstream: Counter[ProviderKey] = Counter()
        self.upstream_peak: Counter[ProviderKey] = Counter()
        self.wires: dict[str, list[Wire]] = {n: [] for n in NODES}
        self.clients: dict[str, EdgeClient] = {}
        self.runtimes: dict[str, NodeRuntime] = {}
        self.seen_links: dict[str, dict[int, NodeLink]] = {n: {} for n in NODES}
        self.stopping = False
        self.nursery: trio.Nursery | None = None
        self.stall_scope: trio.CancelScope | None = None
        # the ledger: every lease's granted/released/revoked events
        self.ledger_granted: set[int] = set()
        self.ledger_released: set[int] = set()
        self.ledger_revoked: set[int] = set()
        self.max_lease_id = 0
        self.refresh_watermark = 0
        self.outcomes: dict[int, Outcome] = {}
        self.plans: list[RequestPlan] = []
        self._ledger: trio.MemoryReceiveChannel[Any] | None = None
        # provider faults ([outlier-ejection]) and what the checker needs to judge retries
        self.down_until: dict[ProviderKey, float] = {}
        self.stuck_until: dict[ProviderKey, float] = {}
        self.burst: Counter[ProviderKey] = Counter()
        self.order = 0  # a global sequence: backend run starts and response heads are ordered by it
        self.run_starts: dict[int, list[int]] = {}  # request number -> order of each backend run start
        self.probe_reports: Counter[tuple[ProviderKey, int]] = Counter()  # (provider, epoch) -> probe reports
        self._wrap_reports(self.service, self.probe_reports)

    # ---------------------------------------------------------------- tracing

    def trace(self, text: str) -> None:
        self.result.trace.append(f"{trio.current_time():.6f} {text}")

    def violation(self, text: str) -> None:
        if len(self.result.violations) < 50:
            self.result.violations.append(f"t={trio.current_time():.6f} {text}")

    def fired(self, site: str, detail: str = "") -> None:
        self.result.fired[site] += 1
        self.trace(f"fault {site} {detail}".rstrip())

    def reached(self, site: str) -> bool:
        """A fault site was reached: fire it? (Uses the fault RNG; the caller then fires.)"""
        return site in self.enabled and self.frng.random() < FIRE_P

    # ------------------------------------------------------------- upstream

    def upstream_enter(self, key: ProviderKey) -> None:
        self.upstream[key] += 1
        self.upstream_peak[key] = max(self.upstream_peak[key], self.upstream[key])
        if self.upstream[key] > PROVIDERS[key].capacity:
            self.violation(
                f"backend {key}: {self.upstream[key]} concurrent upstream requests > capacity {PROVIDERS[key].capacity}"
            )

    def upstream_exit(self, key: ProviderKey) -> None:
        self.upstream[key] -= 1
        if self.upstream[key] < 0:
            self.violation(f"backend {key}: upstream in-flight went negative")

    def run_started(self, number: int, key: ProviderKey) -> None:
        self.order += 1
        self.run_starts.setdefault(number, []).append(self.order)

    async def provider_faults(self, key: ProviderKey) -> None:
        """A run reaches the backend of ``key``: down, in a 5xx burst, or never sending a first token.

        Checkpoints; a stuck run waits until its fault window ends or it is cancelled.
        """
        now = trio.current_time()
        if self.down_until.get(key, 0.0) > now:
            self.fired("backend_down", f"{key} refused a run")
            raise UpstreamUnreachable("connection refused (sim backend down)")
        if self.burst[key] > 0:
            self.burst[key] -= 1
            self.fired("upstream_5xx_burst", f"{key} answered 500")
            raise UpstreamFailed("internal server error (sim 5xx burst)", 500)
        until = self.stuck_until.get(key, 0.0)
        if until > now:
            self.fired("first_token_never", f"{key} holds a run without a first token")
            await trio.sleep_until(until)

    def edge_config(self, overrides: Overrides) -> EdgeConfig:
        """The Edge's config under ``overrides`` (the HA world adds ``ha:``)."""
        return edge_config(overrides)

    def front(self) -> EdgeService:
        """The Edge a client request goes to (the HA world's load balancer chooses among replicas)."""
        return self.service

    def _wrap_reports(self, service: EdgeService, reports: Counter[tuple[ProviderKey, int]]) -> None:
        """Record the deciding probe reports per (provider, health epoch): one per ejection period."""
        admission = service.admission
        failure, success = admission.report_failure, admission.report_success

        def record(lease: Any) -> None:
            # The report that decides an ejection: the running probe's (an earlier probe that
            # ended unreported -- cancelled, fenced -- no longer decides anything).
            if lease.probe and not lease._reported and lease._slot.probe_lease == lease.id:
                reports[lease.provider, lease._epoch] += 1

        def report_failure(lease: Any) -> None:
            record(lease)
            failure(lease)

        def report_success(lease: Any) -> None:
            record(lease)
            success(lease)

        admission.report_failure = report_failure  # type: ignore[method-assign]
        admission.report_success = report_success  # type: ignore[method-assign]

    # ---------------------------------------------------------------- nodes

    @asynccontextmanager
    async def connector(self, node_id: str, nursery: trio.Nursery) -> AsyncIterator[EdgeSocket]:
        """The node's injected connector: a fresh :class:`Wire`, its Edge end served by the registry."""
        wires = self.wires[node_id]
        wire = Wire(node_id, len(wires) + 1)
        wires.append(wire)
        assert self.nursery is not None
        self.nursery.start_soon(serve_edge_end, self.service, wire)
        async with node_socket(wire) as ws:
            yield ws

    def new_runtime(self, node_id: str, config: NodeConfig, **fields: Any) -> NodeRuntime:
        """A node process's runtime: its gate, a :class:`SimBackend` per provider, ``fields`` (the HA world's fence)."""
        gate = LocalGate(limits={p.id: p.capacity for p in config.providers}, global_limit=config.runtime.concurrency)
        adapters = {p.id: self.backend(self, ProviderKey(node_id, p.id)) for p in config.providers}
        return NodeRuntime(gate=gate, adapters=adapters, **fields)  # type: ignore[arg-type]

    async def node_process(self, node_id: str, restart: trio.Event | None = None) -> None:
        """One node 'process' after another: a graceful shutdown is followed by a restart."""
        config = node_config(node_id)
        incarnation = 0
        while not self.stopping:
            incarnation += 1
            async with self.new_runtime(node_id, config) as runtime:
                client = EdgeClient(
                    config,
                    runtime,
                    connect=lambda nursery: self.connector(node_id, nursery),
                    rng=random.Random(f"sim:{self.seed}:{node_id}:{incarnation}"),
                )
                self.clients[node_id] = client
                self.runtimes[node_id] = runtime
                await client.run()
            if self.stopping:
                return
            await trio.sleep(self.frng.uniform(0.05, 1.0))
            self.trace(f"node {node_id} restarted")

    # --------------------------------------------------------------- clients

    async def client(self, plan: RequestPlan) -> None:
        """One client request against the ASGI app; records what it saw."""
        await trio.sleep_until(plan.at)
        out = self.outcomes[plan.number] = Outcome()
        gone = trio.Event()
        body = plan.body()
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await trio.lowlevel.checkpoint()
            out.sends += 1
            if message["type"] == "http.response.start":
                out.status = message["status"]
                out.headers = dict(message["headers"])
                self.order += 1
                out.head_order = self.order
            else:
                out.body += message.get("body", b"")
                if not message.get("more_body", False):
                    out.finished = True
            if plan.cancel_after_sends is not None and out.sends >= plan.cancel_after_sends and not gone.is_set():
                out.gone = True
                self.fired("client_cancel", f"request {plan.number} after {out.sends} sends")
                gone.set()

        async def cancel_later(delay: float) -> None:
            await trio.sleep(delay)
            if not out.finished:
                out.gone = True
                self.fired("client_cancel", f"request {plan.number} after {delay:.3f} s")
                gone.set()

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/chat/completions",
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *self.request_headers(plan),
            ],
        }
        async with trio.open_nursery() as nursery:
            if plan.cancel_after is not None:
                nursery.start_soon(cancel_later, plan.cancel_after)
            try:
                await self.front().api(scope, receive, send)
            except Exception as exc:  # the app must answer, never raise
                self.violation(f"request {plan.number}: the ASGI app raised {type(exc).__name__}: {exc}")
            nursery.cancel_scope.cancel()
        out.ended_at = trio.current_time()
        self._check_attempts(plan, out)
        out.result = self._classify(plan, out)
        self.result.outcomes[out.result.split(" ")[0]] += 1
        self.trace(f"request {plan.number} {plan.model} {'long' if plan.long else 'normal'} -> {out.result}")

    def request_headers(self, plan: RequestPlan) -> list[tuple[bytes, bytes]]:
        """Headers a client adds to its request (the tenant world's: its tenant's API key)."""
        return []

    def _check_attempts(self, plan: RequestPlan, out: Outcome) -> None:
        """[failover-before-first-byte] no run starts after the response head; attempts are bounded."""
        starts = self.run_starts.get(plan.number, [])
        if out.status is not None and any(order > out.head_order for order in starts):
            self.violation(f"request {plan.number}: a run started after the response head (retry after a byte)")
        attempts = out.headers.get(b"x-iop-attempts")
        if attempts is not None:
            if not 1 <= int(attempts) <= MAX_ATTEMPTS:
                self.violation(f"request {plan.number}: x-iop-attempts {attempts!r}")
            if int(attempts) > 1:
                self.result.fired["retried"] += 1
        if len(starts) > MAX_ATTEMPTS:
            self.violation(f"request {plan.number}: {len(starts)} backend runs > {MAX_ATTEMPTS} attempts")

    def _classify(self, plan: RequestPlan, out: Outcome) -> str:
        if out.status is None:
            if out.gone:
                return "cancelled"
            self.violation(f"request {plan.number}: ended without any response and without cancel")
            return "no_response"
        if out.status == 200:
            provider = out.headers.get(b"x-iop-provider", b"").decode()
            if provider not in {str(k) for k in MODELS[plan.model]}:
                self.violation(f"request {plan.number}: served by {provider!r}, not a candidate of {plan.model}")
            if not out.finished:
                if out.gone:
                    return "cancelled"
                self.violation(f"request {plan.number}: 200 response never finished")
                return "unfinished"
            if plan.stream:
                text = out.body.decode()
                if text.endswith("data: [DONE]\n\n"):
                    return "ok"
                last = text.rstrip("\n").rsplit("data: ", 1)[-1]
                try:
                    code = json.loads(last)["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    self.violation(f"request {plan.number}: stream ended without [DONE] or error: {last[:80]!r}")
                    return "bad_stream"
                return f"midstream:{code}"
            return "ok"
        if not out.finished:
            if out.gone:
                return "cancelled"
            self.violation(f"request {plan.number}: error response {out.status} never finished")
        try:
            code = json.loads(bytes(out.body))["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = "?"
        result = f"{out.status}:{code}"
        if result not in self.expected_errors:
            self.violation(f"request {plan.number}: unexpected answer {result}")
        return result

    def plan_requests(self) -> list[RequestPlan]:
        rng = self.rng
        plans = []
        t = 0.0
        for number in range(1, rng.randint(20, 36) + 1):
            t += rng.expovariate(3.5)
            if t >= LOAD_WINDOW:
                break  # arrival times stay distinct: no order left to the scheduler
            model = "ornith:35b" if rng.random() < 0.55 else "ornith-fast"
            stream = rng.random() < 0.6
            plan = RequestPlan(
                number=number,
                at=t,
                model=model,
                long=rng.random() < 0.3,
                stream=stream,
                max_tokens=rng.randint(1, 8),
                latency=rng.uniform(0.01, 0.6),
                tokens_per_second=rng.choice((0.0, rng.uniform(5, 40))),
            )
            plans.append(self.request_faults(plan))
        return plans

    def request_faults(self, plan: RequestPlan) -> RequestPlan:
        """``plan`` with the request fault sites, reached once per request."""
        rng = self.rng
        if self.reached("client_cancel"):
            if rng.random() < 0.5:
                plan = attrs.evolve(plan, cancel_after=rng.uniform(0.0, 1.5))
            else:
                plan = attrs.evolve(plan, cancel_after_sends=rng.randint(1, 3))
        if self.reached("upstream_error_mid_stream"):
            plan = attrs.evolve(plan, fail_after_chunks=rng.randint(0, plan.max_tokens))
        if self.reached("upstream_hang"):
            plan = attrs.evolve(plan, hang=True)
        return plan

    # ---------------------------------------------------------------- faults

    async def fault_ticks(self) -> None:
        """Reach every tick-driven site at random times during the load window."""
        rng = self.frng
        sites = [s for s in self.sites if s not in REQUEST_SITES]
        while trio.current_time() < LOAD_WINDOW:
            await trio.sleep(rng.uniform(0.2, 0.8))
            for site in sites:
                if self.reached(site):
                    await getattr(self, f"fault_{site}")()
            if self.overrides != Overrides() and rng.random() < 0.3:
                self.apply(Overrides(), "restore")

    def live_wire(self, node_id: str) -> Wire | None:
        wires = self.wires[node_id]
        if wires and not wires[-1].dead and not wires[-1].blackholed:
            return wires[-1]
        return None

    async def fault_backend_down(self) -> None:
        key = self.frng.choice(tuple(PROVIDERS))
        self.down_until[key] = trio.current_time() + self.frng.uniform(0.5, 3.0)
        self.trace(f"backend {key} down until {self.down_until[key]:.3f}")

    async def fault_upstream_5xx_burst(self) -> None:
        key = self.frng.choice(tuple(PROVIDERS))
        self.burst[key] += self.frng.randint(2, 5)
        self.trace(f"backend {key} 5xx burst of {self.burst[key]}")

    async def fault_first_token_never(self) -> None:
        key = self.frng.choice(tuple(PROVIDERS))
        self.stuck_until[key] = trio.current_time() + self.frng.uniform(1.0, 4.0)
        self.trace(f"backend {key} sends no first token until {self.stuck_until[key]:.3f}")

    async def fault_ws_send_failure(self) -> None:
        node_id = self.frng.choice(NODES)
        side = self.frng.choice((EDGE, NODE))
        wire = self.live_wire(node_id)
        if wire is not None:
            wire.fail_next_send(side)
            self.fired("ws_send_failure", f"{wire!r} {side}")

    async def fault_connection_drop(self) -> None:
        node_id = self.frng.choice(NODES)
        wire = self.live_wire(node_id)
        if wire is None:
            return
        if self.frng.random() < 0.5:
            wire.cut()
            self.fired("connection_drop", f"{wire!r} cut")
        else:
            delay = self.frng.uniform(0.5, 6.0)
            wire.blackhole()
            self.fired("connection_drop", f"{wire!r} blackholed for {delay:.3f}")
            assert self.nursery is not None
            self.nursery.start_soon(self._cut_later, wire, delay)

    async def _cut_later(self, wire: Wire, delay: float) -> None:
        await trio.sleep(delay)
        wire.cut()

    async def fault_graceful_close(self) -> None:
        node_id = self.frng.choice(NODES)
        client = self.clients.get(node_id)
        if client is not None and client.session is not None:
            client.shutdown()
            self.fired("graceful_close", node_id)

    async def fault_duplicate_registration(self) -> None:
        node_id = self.frng.choice(NODES)
        if not self.service.admission.is_connected(node_id):
            return
        self.fired("duplicate_registration", node_id)
        assert self.nursery is not None
        self.nursery.start_soon(self._duplicate, node_id)

    async def _duplicate(self, node_id: str) -> None:
        """A second connection registering as a node that is connected."""
        admission = self.service.admission
        before = admission.generation(node_id)
        wire = Wire(f"{node_id}-dup", 0)
        assert self.nursery is not None
        self.nursery.start_soon(serve_edge_end, self.service, wire)
        try:
            async with node_socket(wire) as ws:
                with trio.fail_after(10):
                    providers = tuple(ProviderInfo(p.id, "mock", p.capacity) for p in node_config(node_id).providers)
                    await ws.send_message(encode(Register(node_id, TOKEN, PROTOCOL_VERSION, providers)))
                    answer = decode(await ws.get_message())
                if isinstance(answer, Registered):
                    # The real link had just gone: this one was accepted. Leave gracefully.
                    self.trace(f"duplicate {node_id} accepted as generation {answer.generation}")
                else:
                    self.trace(f"duplicate {node_id} rejected: {getattr(answer, 'code', answer)}")
                    if admission.generation(node_id) != before:
                        self.violation(f"a rejected duplicate registration of {node_id} changed its generation")
                with trio.move_on_after(1):
                    await ws.aclose(1000, "sim duplicate done")
        except (ConnectionClosed, HandshakeError, trio.TooSlowError) as exc:
            self.trace(f"duplicate {node_id} ended: {type(exc).__name__}")

    async def fault_stale_close_after_reconnect(self) -> None:
        """The end of an old connection's serve, arriving after the node reconnected.

        ``NodeRegistry`` refuses a second live link per node, so a stale end
        cannot happen through ``serve_stream`` itself; this calls the code path an old
        connection's ``finally`` runs (``NodeRegistry._release``) on a link
        of an older generation, and checks it changes nothing.
        """
        node_id = self.frng.choice(NODES)
        admission = self.service.admission
        current = admission.generation(node_id)
        stale = [g for g in self.seen_links[node_id] if g < current]
        if not stale:
            return
        link = self.seen_links[node_id][self.frng.choice(stale)]
        connected = admission.is_connected(node_id)
        before = admission.snapshot()
        self.service.registry._release(link)
        self.fired("stale_close_after_reconnect", f"{node_id} gen {link.generation} (current {current})")
        if admission.generation(node_id) != current or admission.is_connected(node_id) != connected:
            self.violation(f"stale close of {node_id} gen {link.generation} changed connectivity")
        if admission.snapshot() != before:
            self.violation(f"stale close of {node_id} gen {link.generation} changed the snapshot")
        await trio.lowlevel.checkpoint()

    async def fault_refresh_below_in_flight(self) -> None:
        snapshots = [s for s in self.service.admission.snapshot().providers if s.in_flight >= 2]
        if not snapshots:
            return
        s = self.frng.choice(snapshots)
        key = ProviderKey(s.node_id, s.provider_id)
        capacity = dict(self.overrides.capacity)
        capacity[key] = self.frng.randint(1, s.in_flight - 1)
        self.apply(attrs.evolve(self.overrides, capacity=tuple(sorted(capacity.items()))), "refresh_below_in_flight")
        self.fired("refresh_below_in_flight", f"{key} capacity {capacity[key]} < in_flight {s.in_flight}")
        await trio.lowlevel.checkpoint()

    async def fault_disable_enable(self) -> None:
        key = self.frng.choice(list(PROVIDERS))
        disabled = set(self.overrides.disabled) ^ {key}
        self.apply(attrs.evolve(self.overrides, disabled=frozenset(disabled)), "disable_enable")
        self.fired("disable_enable", f"{key} {'disabled' if key in disabled else 'enabled'}")
        await trio.lowlevel.checkpoint()

    async def fault_queue_policy_change(self) -> None:
        max_queue = self.frng.choice((1, 2, 4, 8, 16))
        timeout = self.frng.choice((300, 800, 1500, 2500))
        self.apply(attrs.evolve(self.overrides, max_queue=max_queue, queue_timeout_ms=timeout), "queue_policy_change")
        self.fired("queue_policy_change", f"max_queue {max_queue} timeout {timeout} ms")
        await trio.lowlevel.checkpoint()

    async def fault_stalled_event_subscriber(self) -> None:
        if self.stall_scope is not None:
            return
        self.fired("stalled_event_subscriber")
        assert self.nursery is not None
        await self.nursery.start(self._stalled_subscriber, self.frng.randint(0, 4))

    async def _stalled_subscriber(
        self, buffer: int, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        with trio.CancelScope() as scope:
            self.stall_scope = scope
            async with self.service.admission.subscribe(buffer=buffer):
                task_status.started()
                await trio.sleep_forever()  # never reads

    async def fault_clock_jump_past_queue_timeout(self) -> None:
        jump = self.service.admission.config.policy.queue_timeout + self.frng.uniform(0.001, 0.5)
        self.fired("clock_jump_past_queue_timeout", f"{jump:.3f} s")
        self.clock.jump(jump)
        await trio.lowlevel.checkpoint()

    def apply(self, overrides: Overrides, why: str) -> None:
        """Refresh the Edge as a reload does (EdgeService.reload minus the file read)."""
        self.drain_ledger()
        self.max_lease_id = max(
            [self.max_lease_id, *(lease.id for lease in self.service.admission._core.live_leases())]
        )
        config = self.edge_config(overrides)
        self.service.admission.refresh(config.pool_config())
        self.service.config = config
        self.overrides = overrides
        self.refresh_watermark = self.max_lease_id
        self.trace(f"refresh ({why}) {overrides}")

    async def heal(self) -> None:
        """End every fault: restore the config, unhang, unstall, let blackholes time out."""
        self.trace("heal")
        if self.overrides != Overrides():
            self.apply(Overrides(), "heal")
        self.unhang.set()
        self.down_until.clear()
        self.stuck_until.clear()
        self.burst.clear()
        if self.stall_scope is not None:
            self.stall_scope.cancel()
        for wires in self.wires.values():
            for wire in wires:
                wire.fail_next = {EDGE: False, NODE: False}
                if wire.blackholed:
                    wire.cut()
        await trio.lowlevel.checkpoint()

    # ---------------------------------------------------------------- checks

    def drain_ledger(self) -> None:
        channel = self._ledger
        if channel is None:
            return
        while True:
            try:
                event = channel.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                return
            lease_id = event.lease_id
            if event.kind == "granted":
                if lease_id in self.ledger_granted:
                    self.violation(f"lease {lease_id} granted twice")
                self.ledger_granted.add(lease_id)
                self.max_lease_id = max(self.max_lease_id, lease_id)
            elif event.kind == "released":
                if lease_id not in self.ledger_granted:
                    self.violation(f"lease {lease_id} released but never granted")
                if lease_id in self.ledger_released:
                    self.violation(f"lease {lease_id} released twice")
                self.ledger_released.add(lease_id)
            elif event.kind == "revoked":
                if lease_id in self.ledger_revoked:
                    self.violation(f"lease {lease_id} revoked twice")
                self.ledger_revoked.add(lease_id)

    def check(self) -> None:
        """Every invariant that must hold whenever the system is quiescent."""
        self.drain_ledger()
        admission = self.service.admission
        core = admission._core
        now = trio.current_time()
        snap = admission.snapshot()
        if snap.queue_depth < 0 or snap.queue_depth != core.queue_depth:
            self.violation(f"queue depth {snap.queue_depth} vs {core.queue_depth}")
        for link in self.service.registry.links():
            self.seen_links[link.node_id][link.generation] = link
        live = list(core.live_leases())
        self.max_lease_id = max([self.max_lease_id, *(lease.id for lease in live)])
        waiters = list(core.waiters())
        pressure: Counter[ProviderKey] = Counter()
        long_pressure: Counter[ProviderKey] = Counter()
        tenancy = core._tenants.tenancy
        for w in waiters:
            candidates = w._candidates
            panic = _in_panic(candidates, w.long)
            capped = tenancy is not None and not tenancy.fair.can_run(w.tenant)  # at its max_in_flight: it waits
            for p in candidates:
                # [cross-group-wakeup] work conservation: no queued waiter has a dispatchable candidate
                # (an ejected one only counts in panic mode, [outlier-ejection]).
                if capped or not (p.admitting or panic):
                    continue
                if p.eligible and p.in_flight < p.capacity and (not w.long or p.long_in_flight < p.long_capacity):
                    self.violation(f"{w!r} queued while {p.key} is dispatchable for it")
            for p in candidates:
                if p.eligible and (not w.long or p.long_capacity >= 1):
                    pressure[p.key] += 1
                    if w.long:
                        long_pressure[p.key] += 1
            # [disconnect-queue-resolution] a waiter with no eligible candidate ends at once.
            if not any(p.eligible and (not w.long or p.long_capacity >= 1) for p in candidates):
                self.violation(f"{w!r} queued with no eligible candidate")
            if w.deadline <= now:
                self.violation(f"{w!r} still queued past its deadline {w.deadline:.6f}")
        for s in snap.providers:
            key = ProviderKey(s.node_id, s.provider_id)
            for name in ("in_flight", "long_in_flight", "queued", "long_queued"):
                if getattr(s, name) < 0:
                    self.violation(f"{key} {name} = {getattr(s, name)} < 0")
            # [snapshot-source] queued is candidate pressure
            if (s.queued, s.long_queued) != (pressure[key], long_pressure[key]):
                self.violation(
                    f"{key} snapshot queued {s.queued}/{s.long_queued} != pressure {pressure[key]}/{long_pressure[key]}"
                )
        for p in tuple(core._pool.providers.values()):
            leases = list(p.leases.values())
            # [held-elsewhere] in_flight counts the runs another Edge left on the node too.
            long_leases = sum(lease.long for lease in leases)
            if p.in_flight != len(leases) + p.held or p.long_in_flight != long_leases + p.held_long:
                self.violation(
                    f"{p.key} in_flight {p.in_flight}/{p.long_in_flight} != live leases {len(leases)}/{long_leases}"
                    f" + held {p.held}/{p.held_long}"
                )
            for lease in leases:
                if lease.released or lease.generation != p.node.generation or not p.node.connected:
                    self.violation(f"{lease!r} live on {p.key} gen {p.node.generation} connected={p.node.connected}")
            # Over capacity only with leases granted before the last refresh (that lowered it).
            if p.in_flight > p.capacity or p.long_in_flight > p.long_capacity:
                late = [lease.id for lease in leases if lease.id > self.refresh_watermark]
                if late:
                    self.violation(
                        f"{p.key} {p.in_flight}/{p.capacity} in flight with leases {late} granted after the last refresh"
                    )
        self.check_health(now)
        for key, n in self.upstream.items():
            if n < 0 or n > PROVIDERS[key].capacity:
                self.violation(f"backend {key} in flight {n}")
        for node_id, runtime in self.runtimes.items():
            stats = runtime.gate.statistics()
            if stats.total_in_use < 0 or any(v < 0 for v in stats.in_use.values()):
                self.violation(f"{node_id} gate counters negative: {stats}")

    def check_health(self, now: float) -> None:
        """[outlier-ejection] ejections end on time; one probe at a time, one probe report per ejection."""
        for p in tuple(self.service.admission._core._pool.providers.values()):
            # A probe out is the one live lease the provider waits for; no other grant probes.
            if p.health.value == "probing" and p.probe_lease not in p.leases:
                self.violation(f"{p.key}: probing, but its probe lease {p.probe_lease} is not live")
            if p.health.value != "probing" and p.probe_lease:
                self.violation(f"{p.key}: {p.health.value} with a probe lease {p.probe_lease} out")
            if p.health.value == "ejected" and p.ejected_until <= now:
                self.violation(f"{p.key}: still ejected {now - p.ejected_until:.6f} s after its ejection time")
            if p.health.value == "ejected":
                self.result.fired["ejected provider seen"] += 1
        for (key, epoch), n in self.probe_reports.items():
            if n > 1:
                self.violation(f"{key}: {n} probes reported in one ejection period (epoch {epoch})")

    def quiescent(self) -> None:
        """A step: no task can run before the virtual clock moves. Check everything."""
        self.result.steps += 1
        self.check()

    def final_check(self) -> None:
        """Liveness after healing: every request ended, every counter 0 (the node socket's pending
        count too), every lease released once."""
        self.check()
        admission = self.service.admission
        snap = admission.snapshot()
        if snap.queue_depth:
            self.violation(f"{snap.queue_depth} waiters left at the end")
        for s in snap.providers:
            if s.in_flight or s.long_in_flight or s.queued or s.long_queued:
                self.violation(f"{s.node_id}/{s.provider_id} counters not 0 at the end: {s}")
            if s.status != "available":
                self.violation(f"{s.node_id}/{s.provider_id} is {s.status} after healing")
        if list(admission._core.live_leases()):
            self.violation("live leases left at the end")
        if self.ledger_granted != self.ledger_released:
            self.violation(
                f"leases granted but never released: {sorted(self.ledger_granted - self.ledger_released)[:10]}"
            )
        if pending := self.service.registry.limits.pending:
            self.violation(f"{pending} node connections still counted pending at the end")
        for key, n in self.upstream.items():
            if n:
                self.violation(f"backend {key}: {n} upstream requests left")
        for node_id, runtime in self.runtimes.items():
            if runtime.gate.statistics().total_in_use:
                self.violation(f"{node_id}: gate permits left at the end")
        for plan in self.plans:
            out = self.outcomes.get(plan.number)
            if out is None or out.ended_at is None:
                self.violation(f"request {plan.number} never ended (liveness)")

    # ------------------------------------------------------------------ run

    async def run(self) -> None:
        self.plans = self.plan_requests()
        self.result.requests = len(self.plans)
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            async with self.watching(nursery):
                processes = []
                for node_id in NODES:
                    done = trio.Event()
                    processes.append(done)
                    nursery.start_soon(self._process_then, node_id, done)
                with trio.fail_after(30):
                    while not self.connected():
                        await trio.sleep(0.01)
                start = trio.current_time()
                self.plans = [attrs.evolve(p, at=start + p.at) for p in self.plans]
                with trio.move_on_after(LOAD_WINDOW + LIVENESS_BOUND) as bound:
                    async with trio.open_nursery() as clients:
                        for plan in self.plans:
                            clients.start_soon(self.client, plan)
                        await self.fault_ticks()
                        await self.heal()
                if bound.cancelled_caught:
                    self.violation("liveness: requests still running long after healing")
                # Let the last faults play out (a node shut down at the last tick restarts
                # within 1 s, reconnect backoff is <= 1.2 s), then wait for both nodes.
                await trio.sleep(3.0)
                with trio.move_on_after(30) as back:
                    while not self.connected() or any(c.session is None for c in self.clients.values()):
                        await trio.sleep(0.05)
                if back.cancelled_caught:
                    self.violation("nodes did not reconnect after healing")
                await trio.sleep(0.5)
                await trio.testing.wait_all_tasks_blocked()
                self.final_check()
                self.result.virtual_time = trio.current_time()
                self.stopping = True
                for client in self.clients.values():
                    client.shutdown()
                with trio.move_on_after(10):
                    for done in processes:
                        await done.wait()
                nursery.cancel_scope.cancel()

    @asynccontextmanager
    async def watching(self, nursery: trio.Nursery) -> AsyncIterator[None]:
        """The ledger subscription and the ejection watcher for the run (of every Edge in the HA world)."""
        admission = self.service.admission
        async with admission.subscribe(buffer=1_000_000) as ledger:
            self._ledger = ledger
            nursery.start_soon(admission.watch_ejections)
            yield

    def connected(self) -> bool:
        """Every node registered (with every Edge in the HA world)."""
        return all(self.service.admission.is_connected(n) for n in NODES)

    async def _process_then(self, node_id: str, done: trio.Event) -> None:
        try:
            await self.node_process(node_id)
        finally:
            done.set()


@typing.final
class Steps(trio.abc.Instrument):
    """Calls :meth:`World.quiescent` whenever the run loop goes idle.

    The run loop is about to wait with no runnable task and no expired
    deadline: the next thing to happen is the mock clock jumping to the next
    deadline. (A checker task in ``wait_all_tasks_blocked`` would instead stop
    the autojump: trio wakes idle waiters *instead of* jumping the clock.)
    """

    def __init__(self, world: World) -> None:
        self.world = world
        self.entry_steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        # trio's task that runs callbacks queued from outside the loop and
        # drains its wake-up socket (signals, threads, finalizers); its first
        # step, at the start of the run, only parks it
        if task.name == "<TrioToken.run_sync_soon task>" and not self.world.stopping:
            self.entry_steps += 1
            self.world.result.outside_wakeups = self.entry_steps - 1

    def before_io_wait(self, timeout: float) -> None:
        stats = trio.lowlevel.current_statistics()
        if not stats.tasks_runnable and stats.seconds_to_next_deadline > 0 and not stats.run_sync_soon_queue_size:
            self.world.quiescent()


def run_seed(seed: int, kind: type[World] = World) -> SeedResult:
    """Run one seed to the end and return its figures (violations included, never raised).

    trio's scheduler shuffles each batch of runnable tasks with a module-level
    ``random.Random`` (``trio._core._run._r``, private), in creation order first
    once Hypothesis is loaded (trio registers a Hypothesis plugin for that,
    hence the import above: a run under pytest and one from ``python -m
    tests.sim`` schedule alike). Seeding it from the
    seed makes the schedule -- and so the trace -- repeat for a given seed. The
    private name is the only hook trio offers; if it disappears, runs still
    work, only less repeatable (the trace hash test would show it).

    The schedule repeats only if nothing outside the simulation queues work on
    the loop (:attr:`SeedResult.outside_wakeups` counts what did). Garbage
    collection is one such source -- an abandoned async generator is closed by a
    callback queued when the collector finds it, at a point that depends on the
    whole process's allocation history -- so the run collects first and keeps
    the collector off until it ends (a seed allocates a few MB).
    """
    scheduler_rng = getattr(getattr(trio._core, "_run", None), "_r", None)
    if isinstance(scheduler_rng, random.Random):
        scheduler_rng.seed(seed)
    clock = trio.testing.MockClock(autojump_threshold=0)
    world = kind(seed, clock)
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        trio.run(world.run, clock=clock, instruments=[Steps(world)])
    finally:
        if collecting:
            gc.enable()
    return world.result


def run_seeds(seeds: Iterator[int] | range) -> list[SeedResult]:
    return [run_seed(seed) for seed in seeds]


def _in_panic(candidates: tuple[Any, ...], long: bool) -> bool:
    """Panic mode as admission defines it: some candidate could run the request, none is admitting."""
    able = [p for p in candidates if p.eligible and (not long or p.long_capacity >= 1)]
    return bool(able) and not any(p.admitting for p in able)
