"""One registered node connection: :class:`NodeLink` (its reader, its writer, its runs).

One nursery per connection, with one reader and one writer task. Nothing waits to send: a frame
(a run, a cancel) goes to the socket at once from the task that has it when the writer is idle
with nothing queued (:meth:`NodeSocket.send_nowait`: one non-blocking write, so a request handler
being cancelled can never leave half a frame on the socket; what the socket does not take is the
writer's to send), and otherwise into the connection's *outbox* (a deque the writer is parked
on), behind the frames already there, for the writer. A node that stops reading its socket stalls
only its own writer. A full outbox (:data:`OUTBOX_SIZE` frames) means the node is not keeping up:
the connection is dropped.

Every message from the node counts as liveness. No message for ``heartbeat_timeout`` seconds and
the Edge drops the connection itself: the fallback for a peer that vanished without a close.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Protocol, final

import trio
from trio_websocket import ConnectionClosed

from iop_admission import ProviderKey, ProviderReport
from iop_edge.metrics import DisconnectCause
from iop_edge.nodes.connection import NodeSocket, close_quietly
from iop_edge.nodes.health_reports import apply_report
from iop_edge.nodes.run_frame import run_frame
from iop_edge.nodes.runs import NodeGone, RunChannel, RunMessage, RunNotSent
from iop_edge.nodes.states import ABORT, CLOSE, CLOSED, DRAIN, IDLE, QUEUE, LinkInput, next_link_state
from iop_io import ParkedTask
from iop_wire import (
    CLOSE_PROTOCOL_ERROR,
    PROTOCOL_VERSION,
    Cancel,
    Heartbeat,
    InFlight,
    ProtocolError,
    ProviderHealth,
    Run,
    RunEnd,
    TunnelEnd,
    TunnelRequest,
    decode,
    encode,
    health_for,
    speaks,
    split_data,
)

logger = logging.getLogger("iop_edge.nodes")


OUTBOX_SIZE = 1024
"""Frames queued for one node before it counts as stalled and is dropped."""
WRITE_BATCH_BYTES = 64 * 1024
"""Characters of queued frames past which the node link's writer stops adding frames to one write."""
FLUSH = ""
"""Queued (never sent) behind a frame sent without waiting: the node link's writer sends what the
socket did not take of it, and what was queued behind it in the same scheduling round."""
_Queued = tuple[str, str]
"""A frame in the outbox and the run it opens ("" for any other frame): a frame the writer cannot
send fails that run alone (:meth:`NodeLink._send_queued`)."""


class LinkFence(Protocol):
    """What a node connection asks of this Edge's leader fence (:class:`~iop_edge.ha.fencing.LeaderFence`)."""

    @property
    def leads(self) -> Callable[[], bool] | None: ...

    def stamp(self) -> int | None: ...

    def may_send(self) -> bool: ...

    def refused(self, node_id: str) -> None: ...

    def answered(self, node_id: str, message: InFlight) -> None: ...


class LinkHost(Protocol):
    """What a node connection needs of the Edge around it (the registry): its leader fence, the
    largest frame a node may send, and where its health reports go. The link knows nothing else
    of its host."""

    @property
    def fence(self) -> LinkFence: ...

    @property
    def max_message_bytes(self) -> int: ...

    def report_health(self, provider: ProviderKey, report: ProviderReport) -> None:
        """[health-probe] A node's report of one of its providers, for the admission core."""


@final
class NodeLink:
    """One registered node connection: one node, one generation, one protocol version, talking to
    its host through :class:`LinkHost`."""

    def __init__(
        self,
        host: LinkHost,
        node_id: str,
        generation: int,
        ws: NodeSocket,
        protocol: int = PROTOCOL_VERSION,
    ) -> None:
        self.host = host
        self.node_id = node_id
        self.generation = generation
        self.ws = ws
        self.protocol = protocol
        self.providers: tuple[str, ...] = ()
        self.told: dict[str, tuple[str, str, int | None]] = {}  # provider -> its last report's words (logged)
        self.last_seen = trio.current_time()
        self.cause: DisconnectCause = "error"
        # The frames for the writer (a deque and the writer parked on it, not a memory channel:
        # one reader, and a frame per request pays neither the channel's calls nor its WouldBlock).
        self._outbox: collections.deque[_Queued] = collections.deque()
        self._writer = ParkedTask()  # the writer task, when it waits for frames
        self.state = IDLE
        """Where the connection stands (:class:`~iop_edge.nodes.states.LinkState`), moved only
        through its table (:func:`~iop_edge.nodes.states.next_link_state`)."""
        self._runs: dict[str, RunChannel] = {}
        self._unsent_runs: dict[int, str] = {}  # with ha: id of a run's frame waiting in the outbox -> run id
        self._cancel_scope: trio.CancelScope | None = None

    # ----------------------------------------------------------------- runs

    @property
    def epoch(self) -> int | None:
        """The epoch to put on a run about to be sent on this connection [epoch-fencing]: the
        leader's (:meth:`~iop_edge.ha.fencing.LeaderFence.stamp`).

        Raises:
            NotLeading: this Edge has ``ha:`` and cannot prove it leads: send nothing.
        """
        return self.host.fence.stamp()

    def send_frame(self, frame: str) -> None:
        """Queue one frame that is not a run's (``leader``); dropped if the connection is ending."""
        try:
            self._queue(frame)
        except (NodeGone, RunNotSent):
            pass

    def open_run(self, message: Run | TunnelRequest, body_json: str | None = None) -> RunChannel:
        """Encode a run (``body_json``: see :func:`run_frame`) for this connection's wire version,
        then register it and queue its frame for the node (never waits). Registered only once its
        frame is one the node can take: a run that cannot be sent fails alone, before anything is
        counted.

        Raises:
            RunNotSent: the frame cannot be sent (nothing was registered or queued).
            NodeGone: the connection is closing or its outbox is full.
        """
        frame = run_frame(message, body_json, self.node_id, self.protocol)
        run_id = message.run_id
        channel = self._runs[run_id] = RunChannel(run_id, self)
        try:
            sent = self._queue(frame, run_id)
        except (NodeGone, RunNotSent):
            self.forget_run(run_id)
            raise
        if not sent and self.host.fence.leads is not None:
            self._unsent_runs[id(frame)] = run_id  # checked again when the writer takes it (_withhold_runs)
        return channel

    def cancel_run(self, run_id: str) -> bool:
        """Ask the node to cancel ``run_id`` (never waits).

        Returns:
            True when ``cancel`` was queued: the run is still tracked and the
            connection open, so its end (or the connection's) will follow.
        """
        if run_id not in self._runs:
            return False
        try:
            self._queue(encode(Cancel(run_id)))
        except (NodeGone, RunNotSent):  # ending (the node cancels every run itself), or not framed
            return False
        return True

    def forget_run(self, run_id: str) -> None:
        """Stop tracking ``run_id``: later frames for it are dropped."""
        channel = self._runs.pop(run_id, None)
        if channel is not None:
            channel.close()

    def _queue(self, frame: str, run_id: str = "") -> bool:
        """Send ``frame`` now if the writer is idle with nothing queued, else queue it for the writer;
        whether it was sent now.

        A request handler then writes its run's frame itself: at concurrency 1 the
        frame leaves without waiting for the writer task's turn (a scheduling round
        or two on the request's path). The write cannot be cancelled half-way (it
        does not wait). The writer is still woken (with :data:`FLUSH`): it sends
        what the socket did not take, and frames queued in the same scheduling
        round wait behind it and leave together in its one write, as before. Raises
        :class:`NodeGone` (closing, or the outbox full) or :class:`RunNotSent` (not framed, not written).
        """
        if self.state is CLOSED:
            raise NodeGone(f"node {self.node_id} is disconnecting")
        ws = self.ws
        if self.state is IDLE:
            try:
                sent = ws.send_nowait(frame)
            except ConnectionClosed:
                self.abort()
                raise NodeGone(f"node {self.node_id} is disconnecting") from None
            except (ValueError, TypeError) as exc:  # framing failed: nothing was written
                raise RunNotSent(f"not sent to node {self.node_id}: {exc}", status=502, code="upstream_error") from None
            if sent:
                frame = FLUSH
        if len(self._outbox) >= OUTBOX_SIZE:
            logger.warning("node %s is not reading its socket; dropping it", self.node_id)
            self.cause = "error"
            self.abort()
            raise NodeGone(f"node {self.node_id} is stalled")
        self._outbox.append((frame, run_id))
        self._to(QUEUE)  # what follows queues behind it: the order of frames is kept
        self._writer.wake()
        return frame is FLUSH

    @property
    def queued_frames(self) -> int:
        """Frames waiting for the writer (a node that does not read its socket makes them pile up)."""
        return len(self._outbox)

    def _deliver(self, run_id: str, message: RunMessage) -> None:
        channel = self._runs.get(run_id)
        if channel is None:
            return  # a late message for a run we already gave up on
        if not channel.deliver(message):
            self.cancel_run(run_id)
            self.forget_run(run_id)
        elif type(message) is RunEnd or type(message) is TunnelEnd:
            del self._runs[run_id]
            if message.code == "stale_epoch":
                self.host.fence.refused(self.node_id)

    def _deliver_data(self, frame: bytes) -> str | None:
        """Hand the records of a data frame to their runs; the protocol problem, if any.

        A run with several records in the frame gets their bytes joined, in
        order, as one delivery: one write to its client instead of one per record.
        Every record's order is checked before any is delivered.
        """
        runs = self._runs
        batch: dict[str, tuple[RunChannel, int, list[bytes]]] = {}
        for run_id, seq, data in split_data(frame, max_bytes=self.host.max_message_bytes):
            channel = runs.get(run_id)
            if channel is None:
                continue  # a late record for a run we already gave up on
            if seq != channel.next_seq:
                return f"run {run_id}: data record {seq} out of order"
            channel.next_seq = seq + 1
            joined = batch.get(run_id)
            if joined is None:
                batch[run_id] = (channel, seq, [data])
            else:
                joined[2].append(data)  # joined once below: a run's records in one frame are copied once
        for run_id, (channel, seq, pieces) in batch.items():
            data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            if not channel.deliver_data(seq, data):
                self.cancel_run(run_id)
                self.forget_run(run_id)
        return None

    @property
    def active_runs(self) -> int:
        """Runs this connection carries right now."""
        return len(self._runs)

    # ------------------------------------------------------------ lifecycle

    def _to(self, given: LinkInput) -> None:
        self.state = next_link_state(self.state, given)

    def abort(self) -> None:
        """Drop the connection now (its serve loop ends and disconnects the node)."""
        self._to(ABORT)
        if self._cancel_scope is not None:
            self._cancel_scope.cancel()

    async def _serve(self, heartbeat_timeout: float) -> None:
        async with trio.open_nursery() as nursery:
            self._cancel_scope = nursery.cancel_scope
            nursery.start_soon(self._write)
            with trio.CancelScope() as reading:
                nursery.start_soon(self._watch_heartbeat, heartbeat_timeout, reading)
                await self._read()
            nursery.cancel_scope.cancel()

    async def _watch_heartbeat(self, heartbeat_timeout: float, reading: trio.CancelScope) -> None:
        """Stop ``reading`` once no message came for ``heartbeat_timeout`` seconds.

        A task of its own, so the reader pays no timer per message (it only
        stamps :attr:`last_seen`).
        """
        while True:
            expires = self.last_seen + heartbeat_timeout
            if trio.current_time() >= expires:
                self.cause = "heartbeat_timeout"
                logger.warning("node %s sent nothing for %.1fs: dropping it", self.node_id, heartbeat_timeout)
                reading.cancel()
                return
            await trio.sleep_until(expires)

    async def _write(self) -> None:
        """Send the outbox's frames until it is closed and empty, or the connection fails. Checkpoints."""
        outbox = self._outbox
        try:
            while outbox or self.state is not CLOSED:
                if not outbox:
                    await self._writer.park()
                    continue
                await self._send_queued()
                if not outbox:
                    self._to(DRAIN)
        except ConnectionClosed:
            self.abort()

    async def _send_queued(self) -> None:
        """Send the first frame queued and those behind it, in one write to the socket where possible.

        A write to a loopback or LAN socket costs more CPU than framing a
        message, so the frames that queued up while the writer waited (runs
        opened by several request handlers in one scheduling round) go out
        together (:meth:`NodeSocket.send_messages`); a batch stops growing past
        :data:`WRITE_BATCH_BYTES`, so large frames go one by one and a node that
        stops reading leaves the rest in its outbox. The writer waits one
        scheduling round for more only when others were queued already (at
        concurrency 1 that round would be latency for nothing).
        """
        ws = self.ws
        outbox = self._outbox
        if len(outbox) > 1:
            # Others queued already, so requests are arriving together: one more scheduling
            # round lets the handlers runnable now queue theirs (never at concurrency 1).
            await trio.lowlevel.cancel_shielded_checkpoint()
        frames = [outbox.popleft()]
        size = len(frames[0][0])
        while outbox and size < WRITE_BATCH_BYTES:  # large frames go one by one, the rest wait
            frames.append(outbox.popleft())
            size += len(frames[-1][0])
        if self._unsent_runs:
            frames = _withhold_queued(self, frames)
        if not (queued := [item for item in frames if item[0]]) and not ws.backlogged:  # without FLUSH
            return
        try:
            await ws.send_messages([frame for frame, _ in queued])  # none: the rest of a frame sent without waiting
        except (ValueError, TypeError):  # a frame the socket cannot frame (nothing was written)
            await _send_one_by_one(self, queued)

    async def _read(self) -> None:
        ws = self.ws
        while True:
            try:
                text = await ws.get_message()
            except ConnectionClosed as exc:
                code = exc.reason.code if exc.reason else None
                self.cause = "graceful" if code in (1000, 1001) else "error"
                return
            self.last_seen = trio.current_time()
            try:
                if type(text) is bytes:
                    problem = self._deliver_data(text)
                    if problem is None:
                        continue
                    raise ProtocolError(problem)
                message = decode(text, max_bytes=self.host.max_message_bytes)
            except ProtocolError as exc:
                logger.warning("node %s: protocol error: %s", self.node_id, exc.reason)
                self.cause = "error"
                await close_quietly(ws, exc.close_code, exc.close_reason)
                return
            kind = type(message)
            if kind is Heartbeat:
                continue
            if isinstance(message, RunMessage):
                self._deliver(message.run_id, message)
                continue
            if _for_the_host(self, message):
                continue
            logger.warning("node %s sent an unexpected %s", self.node_id, kind.__name__)
            self.cause = "error"
            await close_quietly(ws, CLOSE_PROTOCOL_ERROR, f"unexpected {kind.__name__} message")
            return

    def _end_runs(self) -> None:
        self._to(CLOSE)
        self._writer.wake()
        for channel in self._runs.values():
            channel.close()
        self._runs.clear()

    def __repr__(self) -> str:
        return f"<NodeLink {self.node_id} gen {self.generation} runs {len(self._runs)}>"


def _for_the_host(link: NodeLink, message: object) -> bool:
    """Hand a message for the Edge around the link to its host; whether it was one (a v6 node's
    ``provider_health`` with an ``engine`` is not: that version has no such field)."""
    if isinstance(message, InFlight):
        link.host.fence.answered(link.node_id, message)
        return True
    if (
        isinstance(message, ProviderHealth)
        and speaks(link.protocol, ProviderHealth)
        and health_for(link.protocol, message) is message
    ):
        apply_report(link, message)  # [health-probe]
        return True
    return False


def _withhold_runs(frames: list[str], unsent: dict[int, str], runs: dict[str, RunChannel], may_send: bool) -> list[str]:
    """``frames`` less the runs' (``unsent``: frame id -> run id) when this Edge cannot prove it leads now
    (``may_send`` false) [ha-step-down].

    A run's frame is stamped when its run opens; one that waited in the outbox (the writer busy) is
    checked again as it leaves: a leader paused between the two sends nothing when it wakes. Such a
    run ends at once, refused ``stale_epoch`` by this Edge itself (its client's answer is ``503
    not_leader``; no node refused anything, so ``iop_ha_stale_epoch_refused_total`` does not count it).
    """
    kept = []
    for frame in frames:
        run_id = unsent.pop(id(frame), None)
        if run_id is None or may_send:
            kept.append(frame)
            continue
        channel = runs.pop(run_id, None)
        if channel is not None:
            channel.deliver(RunEnd(run_id, "error", "stale_epoch", "not sent: this Edge cannot prove it leads"))
    return kept


def _withhold_queued(link: NodeLink, frames: list[_Queued]) -> list[_Queued]:
    """:func:`_withhold_runs` over the outbox's items (a frame and its run)."""
    may_send = link.host.fence.may_send()
    kept = {id(frame) for frame in _withhold_runs([f for f, _ in frames], link._unsent_runs, link._runs, may_send)}
    return [item for item in frames if id(item[0]) in kept]


async def _send_one_by_one(link: NodeLink, queued: list[_Queued]) -> None:
    """Send ``queued`` a frame at a time; one that cannot be framed ends its run alone (a
    ``bad_request`` end: the client's 502), the others go out. Checkpoints."""
    for frame, run_id in queued:
        try:
            await link.ws.send_messages([frame])
        except (ValueError, TypeError) as exc:
            logger.warning("node %s: a frame could not be sent: %s", link.node_id, exc)
            if run_id in link._runs:
                reason = f"the request could not be sent to node {link.node_id}: {exc}"
                link._deliver(run_id, RunEnd(run_id, "error", "bad_request", reason))
