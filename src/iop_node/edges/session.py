"""One Edge connection: register, heartbeat, serve runs, cancel them all at the end.

:class:`EdgeSession` serves ONE already-open connection (the node's own
:class:`~iop_node.edges.websocket.EdgeSocket`, or a ``trio_websocket.WebSocketConnection``);
it never connects. That keeps it usable over in-memory streams (a simulation can
wrap ``trio.testing.memory_stream_pair`` with ``trio_websocket.wrap_client_stream``)
and leaves reconnecting to :class:`~iop_node.EdgeClient`.

Design notes:

- One nursery per connection; every run task lives in it. When the connection
  closes or drops, or the session is cancelled (shutdown), the nursery is
  cancelled, which cancels every run that came over this connection and
  closes its upstream request (adapters are iterated inside ``aclosing``).
- Reading hops, runs stay. The task that reads a ``run`` with nothing else
  read behind it serves that run itself and hands the reading to a new task
  (:meth:`EdgeSession._read`): at low concurrency the upstream request goes out
  without a task switch. Every task of the connection is in its nursery either way.
- Permits are taken synchronously in the message dispatch, before the run
  is served, and returned by its task with ``with permit:``. The permit
  is returned *before* the ``run_end`` / ``tunnel_end`` is sent, so when the
  Edge sees the end and dispatches the next run, the permit is already free.
- Sending. The connection serializes ``send_message``, but a
  send cancelled half-way could leave a partial frame on the socket, and runs
  are cancelled all the time. So run tasks never write to the socket: they hand
  frames to one writer task through an unbuffered memory channel, whose
  ``send`` is cancellation-atomic. Only the writer touches the socket, and it is
  cancelled only when the whole connection is being torn down. A failed write
  (``ConnectionClosed``) ends the connection and with it every run. One
  exception (:meth:`EdgeSession._end`): a run that ends alone, with the writer
  idle, writes its last data record and its end itself through the node's own
  :class:`~iop_node.edges.websocket.EdgeSocket` (whole and in order even when
  cancelled), after its cancel scope, saving the writer's wakeup.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import final

import attrs
import trio
from trio_websocket import ConnectionClosed

from iop_admission import ConcurrencyLimitExceeded, Permit
from iop_node._errors import EdgeProtocolViolation, RegistrationRejected, RegistrationTimeout, RunFailed, UpstreamFailed
from iop_node._runtime import NodeRuntime
from iop_node.adapters.interface import Adapter
from iop_node.config import NodeConfig
from iop_node.edges.fence import RunsElsewhere
from iop_node.edges.outbox import Outbox
from iop_node.edges.relays import Record, relay_run, relay_tunnel, write_frames
from iop_node.edges.websocket import EdgeSocket, EdgeWebSocket
from iop_node.health.watcher import HealthReport
from iop_node.upstream.poller import BodyPoller, new_poller
from iop_wire import (
    CLOSE_GOING_AWAY,
    CLOSE_PROTOCOL_ERROR,
    END_MESSAGE_LIMIT,
    PROTOCOL_VERSION,
    Cancel,
    Heartbeat,
    Leader,
    NodeMessage,
    ProtocolError,
    ProviderHealth,
    ProviderInfo,
    Register,
    Registered,
    Rejected,
    Run,
    RunEnd,
    TunnelEnd,
    TunnelRequest,
    decode,
    encode,
    end_code_for,
    health_for,
    speaks,
)

logger = logging.getLogger("iop_node")

REGISTER_TIMEOUT = 10.0
"""Seconds to wait for ``registered`` / ``rejected`` after sending ``register``."""
CLOSE_TIMEOUT = 1.0
"""Seconds the closing handshake may take before the socket is dropped."""

_EndFactory = Callable[[str, str | None, str | None, UpstreamFailed | None], RunEnd | TunnelEnd]
_Relay = Callable[[], Awaitable[Record | None]]
_Serve = Callable[[], Awaitable[None]]  # a run or tunnel request, ready to be served
"""Serves one run; returns the run's last data record when it is held for the run's end."""


def _run_end(
    status: str, code: str | None, message: str | None, upstream: UpstreamFailed | None, *, run_id: str, protocol: int
) -> RunEnd:
    message = message and message[:END_MESSAGE_LIMIT]  # it may quote the client's body
    code = end_code_for(protocol, code)  # a code newer than the Edge's version, in its words
    if upstream is None:
        return RunEnd(run_id, status, code, message)
    return RunEnd(run_id, status, code, message, upstream.status, upstream.body)


def _tunnel_end(
    status: str, code: str | None, message: str | None, upstream: UpstreamFailed | None, *, run_id: str
) -> TunnelEnd:
    return TunnelEnd(run_id, status, code, message and message[:END_MESSAGE_LIMIT])


def _elsewhere_of(session: EdgeSession) -> RunsElsewhere:
    runtime = session.runtime
    return RunsElsewhere(runtime.fence, runtime.run_ends, runtime.gate, runtime.long_runs)


def _start_health_reports(session: EdgeSession, nursery: trio.Nursery) -> None:
    """[health-probe] Send the Edge what the node's health watcher finds (from wire v6)."""
    watcher = session.runtime.health
    if watcher is not None and speaks(session.protocol, ProviderHealth):
        said: dict[str, ProviderHealth] = {}  # this connection's last report of each provider
        nursery.start_soon(watcher.report, functools.partial(_send_health, session._send, session.protocol, said))


async def _send_health(
    send: Callable[[NodeMessage], Awaitable[None]],
    protocol: int,
    said: dict[str, ProviderHealth],
    provider: str,
    report: HealthReport,
) -> None:
    """One report, in the words of the connection's version (a v6 Edge's has no engine view), unless
    those words are the ones the Edge last got (a v6 Edge is not told each change of a view it never sees)."""
    reason = report.reason[:END_MESSAGE_LIMIT]
    message = health_for(protocol, ProviderHealth(provider, report.state, reason, report.capacity, report.engine))
    if said.get(provider, ProviderHealth(provider, "ready")) != message:  # the Edge assumes ready at first
        said[provider] = message
        await send(message)


async def _heartbeat(session: EdgeSession, interval: float) -> None:
    while True:
        await trio.sleep(interval)
        session.heartbeats_sent += 1
        await session._send(Heartbeat(session.heartbeats_sent))


async def _until_silent(ws: EdgeSocket, interval: float, connection: trio.CancelScope) -> None:
    """End the connection once the Edge stopped answering (:meth:`EdgeSocket.keep_alive`)."""
    await ws.keep_alive(interval)
    connection.cancel()


@final
@attrs.define(eq=False)
class EdgeSession:
    """Serves one open WebSocket connection to the Edge.

    Attributes:
        ws: the open connection; the session closes it when it ends.
        config: the node's config (node id, token, heartbeat interval, providers).
        runtime: the gate and adapters shared by every connection of the node.
        token: the registration token (never logged).
        protocol: the wire version this session offers and speaks (one of
            :data:`iop_wire.PROTOCOL_VERSIONS`; the node serves a run of either alike).
        registered: the Edge's ``registered`` answer, once received.
        heartbeats_sent: number of heartbeats sent on this connection.
    """

    ws: EdgeWebSocket
    config: NodeConfig
    runtime: NodeRuntime
    token: str = attrs.field(repr=False)
    protocol: int = PROTOCOL_VERSION
    registered: Registered | None = attrs.field(default=None, init=False)
    heartbeats_sent: int = attrs.field(default=0, init=False)
    _active: dict[str, trio.CancelScope] = attrs.field(factory=dict, init=False)
    _outbox: Outbox | None = attrs.field(default=None, init=False)
    _poller: BodyPoller | None = attrs.field(default=None, init=False)
    _nursery: trio.Nursery | None = attrs.field(default=None, init=False)
    _close_code: int = attrs.field(default=CLOSE_GOING_AWAY, init=False)
    _close_reason: str = attrs.field(default="node going away", init=False)
    _elsewhere: RunsElsewhere = attrs.field(init=False, default=attrs.Factory(_elsewhere_of, takes_self=True))

    @property
    def active_runs(self) -> int:
        """Runs and tunnel requests of this connection that have not ended yet."""
        return len(self._active)

    async def serve(self) -> None:
        """Register, then serve the connection until it closes; always close it.

        Returns when the Edge closes the connection or it drops (every run of
        the connection is cancelled first), or after a protocol violation by the
        Edge (closed with 1002). Checkpoints. Cancellation (shutdown) cancels
        every run, then sends a close 1001 to the Edge (shielded, bounded by
        :data:`CLOSE_TIMEOUT`) and re-raises.

        Raises:
            RegistrationRejected: the Edge answered ``rejected``.
            RegistrationTimeout: no answer to ``register`` in time.
            EdgeProtocolViolation: the answer to ``register`` was not valid.
            trio_websocket.ConnectionClosed: the connection closed during registration.
        """
        try:
            self.registered = await self._register()
            interval = min(self.config.heartbeat_interval_ms, self.registered.heartbeat_interval_ms) / 1000
            logger.info(
                "registered as %s, generation %d, wire v%d, heartbeat every %.3f s",
                self.registered.node_id,
                self.registered.generation,
                self.protocol,
                interval,
            )
            self._outbox = Outbox()
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._poller = new_poller(nursery, self._outbox.room)
                nursery.start_soon(write_frames, self.ws, self._outbox, nursery.cancel_scope)
                nursery.start_soon(_heartbeat, self, interval)
                nursery.start_soon(self._elsewhere.report, self._send, interval)
                _start_health_reports(self, nursery)
                if isinstance(self.ws, EdgeSocket):  # a dead Edge is noticed within the interval
                    nursery.start_soon(_until_silent, self.ws, interval, nursery.cancel_scope)
                await self._read()  # it cancels the nursery when the connection ends
        finally:
            if self._poller is not None:
                self._poller.close()
            with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
                await self.ws.aclose(self._close_code, self._close_reason)
            close = self.ws.closed
            if self.registered is not None:
                logger.info(
                    "disconnected from edge (%s)",
                    f"code {close.code} {close.reason or ''}".strip() if close else "no close frame",
                )

    async def _register(self) -> Registered:
        providers = tuple(ProviderInfo(p.id, p.adapter, p.capacity) for p in self.config.providers)
        await self.ws.send_message(encode(Register(self.config.node_id, self.token, self.protocol, providers)))
        data: str | bytes | None = None
        with trio.move_on_after(REGISTER_TIMEOUT):
            data = await self.ws.get_message()
        if data is None:
            raise RegistrationTimeout(f"no answer to register within {REGISTER_TIMEOUT:g} s")
        try:
            answer = decode(data)
        except ProtocolError as exc:
            self._protocol_error(exc.close_code, exc.close_reason)
            raise EdgeProtocolViolation(f"bad answer to register: {exc.reason}") from None
        if isinstance(answer, Rejected):
            logger.warning(
                "registration rejected: %s: %s (%s)",
                answer.code,
                answer.reason,
                "retryable" if answer.retryable else "not retryable",
            )
            self._close_code, self._close_reason = 1000, "rejected"
            raise RegistrationRejected(answer.code, answer.reason, answer.retryable)
        if not isinstance(answer, Registered):
            self._protocol_error(CLOSE_PROTOCOL_ERROR, f"expected registered, got {type(answer).__name__}")
            raise EdgeProtocolViolation(f"expected registered or rejected, got {type(answer).__name__}")
        return answer

    def _protocol_error(self, code: int, reason: str) -> None:
        logger.warning("protocol error from edge, closing with %d: %s", code, reason)
        self._close_code, self._close_reason = code, reason

    async def _read(self) -> None:
        """Read and dispatch the Edge's messages; at the connection's end, cancel its nursery.

        A run (or tunnel request) that arrives with nothing read behind it is served
        by the reading task itself, which hands the reading on to a new task first:
        the run's upstream request then goes out without a task switch (the switch
        goes to the next read instead, which has to wait for the socket anyway). A
        run with more messages read behind it gets a task of its own, and the
        reading goes on at once.
        """
        serve = await self._dispatch()
        if serve is None:
            assert self._nursery is not None
            self._nursery.cancel_scope.cancel()
        else:
            await serve()

    async def _dispatch(self) -> _Serve | None:
        """Dispatch Edge messages until the connection closes or breaks the protocol (None), or
        until a run for this task to serve arrives (see :meth:`_read`)."""
        handlers: dict[type, Callable[..., Awaitable[_Serve | None]]] = {
            Run: self._on_run,
            TunnelRequest: self._on_tunnel_request,
            Cancel: self._on_cancel,
            Leader: self._on_leader,
        }
        while True:
            try:
                data = await self.ws.get_message()
            except ConnectionClosed:
                return None
            try:
                message = decode(data)
            except ProtocolError as exc:
                self._protocol_error(exc.close_code, exc.close_reason)
                return None
            handler = handlers.get(type(message))
            if handler is None:
                self._protocol_error(CLOSE_PROTOCOL_ERROR, f"unexpected {type(message).__name__} after registered")
                return None
            if isinstance(message, Run | TunnelRequest) and message.run_id in self._active:
                self._protocol_error(CLOSE_PROTOCOL_ERROR, f"duplicate run_id {message.run_id!r}")
                return None
            serve = await handler(message)
            if serve is not None:
                assert self._nursery is not None
                ws = self.ws
                if isinstance(ws, EdgeSocket) and not ws.buffered:
                    self._nursery.start_soon(self._read)
                    return serve
                self._nursery.start_soon(serve)

    async def _on_run(self, run: Run) -> _Serve | None:
        end = functools.partial(_run_end, run_id=run.run_id, protocol=self.protocol)
        admitted = await self._admit(run.provider, end, run.epoch)
        if admitted is None:
            return None
        permit, adapter = admitted
        run = run.for_upstream()  # v5: the client's body as sent, the upstream model put in here
        relay = functools.partial(relay_run, run, adapter, self._outbox, self._poller, self.runtime)
        return self._serving(run.run_id, permit, relay, end, run.long)

    async def _on_tunnel_request(self, request: TunnelRequest) -> _Serve | None:
        end = functools.partial(_tunnel_end, run_id=request.run_id)
        try:
            body = request.body_bytes()
        except ProtocolError as exc:
            await self._send(end("error", "bad_request", exc.reason, None))
            return None
        admitted = await self._admit(request.provider, end, request.epoch)
        if admitted is None:
            return None
        permit, adapter = admitted
        relay = functools.partial(relay_tunnel, request, body, adapter, self._send)
        return self._serving(request.run_id, permit, relay, end)

    async def _on_cancel(self, cancel: Cancel) -> None:
        scope = self._active.get(cancel.run_id)
        if scope is None:
            logger.debug("cancel for %s ignored: no such run", cancel.run_id)
        else:
            scope.cancel()
        await trio.lowlevel.checkpoint()

    async def _on_leader(self, leader: Leader) -> None:
        """[epoch-fencing] A new leader: raise the fence, report the runs in flight per provider it did not send."""
        await self._send(self._elsewhere.lead(leader))

    async def _admit(self, provider: str, end: _EndFactory, epoch: int | None) -> tuple[Permit, Adapter] | None:
        """Take the permit synchronously (past the epoch fence); on refusal answer the end at once."""
        try:
            return self.runtime.admit(provider, epoch)
        except (RunFailed, ConcurrencyLimitExceeded) as exc:
            code = exc.code if isinstance(exc, RunFailed) else "concurrency_limit"
            logger.info("run refused on %s: %s: %s", provider, code, exc)
            await self._send(end("error", code, str(exc), None))
            return None

    def _serving(self, run_id: str, permit: Permit, relay: _Relay, end: _EndFactory, long: bool = False) -> _Serve:
        """The run (``long``: a long-context one) as one call that serves it (in whichever
        task :meth:`_dispatch` chooses)."""
        # The scope exists before the run is served, so a cancel that arrives
        # before its first checkpoint still takes effect.
        scope = self._active[run_id] = trio.CancelScope()
        self._elsewhere.took(permit.name, long)
        return functools.partial(self._serve_one, run_id, permit, scope, relay, end, long)

    async def _serve_one(
        self,
        run_id: str,
        permit: Permit,
        scope: trio.CancelScope,
        relay: _Relay,
        end: _EndFactory,
        long: bool,
    ) -> None:
        """Run one relay under its permit and cancel scope, then send its end (behind the
        run's last data record, if the relay held it: :meth:`_end`).

        The permit is returned before the end is sent. Cancellation of the
        session (drop, shutdown) propagates: no end is sent then.
        """
        held = None
        try:
            with permit, scope:
                held = await relay()
            if scope.cancelled_caught:
                final = end("cancelled", "cancelled", "cancelled by the edge", None)
            else:
                final = end("ok", None, None, None)
        except RunFailed as exc:
            upstream = exc if isinstance(exc, UpstreamFailed) else None
            logger.warning("run %s failed: %s: %s", run_id, exc.code, exc.message)
            final = end("error", exc.code, exc.message, upstream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return  # the writer is gone: the connection is ending, so is this run
        except Exception as exc:  # a bug or an upstream shape we did not expect: end this run only
            logger.exception("run %s failed unexpectedly", run_id)
            final = end("error", "upstream_error", f"node error: {type(exc).__name__}: {exc}"[:500], None)
        finally:
            del self._active[run_id]
            self._elsewhere.gave_back(permit.name, long)
        try:
            await self._end(final, held)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return

    async def _end(self, final: RunEnd | TunnelEnd, held: Record | None) -> None:
        """Send a run's end, behind its last data record if the relay held it.

        The run task writes them itself (one write, no scheduling round for the
        writer) when no other run is in flight and the writer waits for work with
        nothing queued; otherwise they are queued for the writer. Checkpoints.

        Raises:
            trio.BrokenResourceError: the writer is gone (the connection is ending).
        """
        assert self._outbox is not None
        outbox = self._outbox
        frame = encode(final)
        ws = self.ws
        # Only the node's own socket: its sends are whole and in order even when
        # cancelled (trio-websocket's could leave half a frame on the socket).
        if not self._active and isinstance(ws, EdgeSocket):
            frames = outbox.take_if_idle(held, frame)
            if frames is not None:
                try:
                    await ws.send_messages(frames)
                except ConnectionClosed:
                    assert self._nursery is not None
                    self._nursery.cancel_scope.cancel()
                return
        if held is not None:
            await outbox.put_record(*held)
        await outbox.put_text(frame)

    async def _send(self, message: NodeMessage) -> None:
        """Queue one message for the writer task.

        Checkpoints only when the outbox is full; cancellation-atomic (the message
        is either queued whole or not at all).

        Raises:
            trio.BrokenResourceError: the writer is gone (the connection is ending).
        """
        assert self._outbox is not None
        await self._outbox.put_text(encode(message))
