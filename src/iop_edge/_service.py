"""One Edge: config, the admission pool, the node socket and the HTTP API, wired.

:class:`EdgeService` holds no admission state of its own: it builds one
:class:`~iop_admission.Admission` from the config and hands it to the node
registry (connect/disconnect) and the HTTP API (leases). ``reload`` re-reads the
config file and applies it with ``admission.refresh``, all or nothing.
"""

from __future__ import annotations

import functools
import logging
import os
import ssl
import time
from typing import Any, final

import attrs
import trio

from iop_admission import Admission, ConfigError, PreparedRefresh, ProviderKey
from iop_config import ConfigFileError, TlsFileError
from iop_edge._off_loop import NODE_SLICE, release_in_slices, rows_in_slices, run_in_turns, run_off_loop, yield_to_loop
from iop_edge.admission_feed import feed
from iop_edge.api.app import EdgeAPI
from iop_edge.config import EdgeConfig, load_edge_config
from iop_edge.config.reader import error_lines, rebuild, run_reader
from iop_edge.front_door.overload import FrontDoor, watch_loop_lag
from iop_edge.ha import EdgeHa, Leadership
from iop_edge.listener.server import HttpLimits, serve_http
from iop_edge.metrics import EdgeMetrics
from iop_edge.nodes.health_log import HealthLog
from iop_edge.nodes.registry import NodeRegistry
from iop_edge.status import EdgeStatus, NodeRow, StatusRows, status_document
from iop_edge.token_count import TokenizerError, load_tokenizer

logger = logging.getLogger("iop_edge")


@final
class EdgeService:
    """The Edge daemon's parts, ready to serve.

    Args:
        config: the loaded edge config.
        config_path: the file ``reload`` re-reads (None: reload is refused).
    """

    def __init__(self, config: EdgeConfig, *, config_path: str | os.PathLike[str] | None = None) -> None:
        self.config = config
        self.config_path = config_path
        tls = _tls_contexts(config, config_path)
        self.api_ssl_context = tls.api
        self.admission = Admission(config.pool_config())
        self.metrics = EdgeMetrics(
            self.admission, per_provider=config.metrics_per_provider, per_node=config.metrics_per_node
        )
        self.registry = NodeRegistry(
            self.admission,
            token_for=lambda node_id: self.config.node_token(node_id),
            heartbeat_timeout=config.heartbeat_timeout_ms / 1000,
            max_message_bytes=config.max_ws_message_bytes,
            limits=config.node_socket_limits(),
            handshake_timeout=config.node_handshake_timeout_ms / 1000,
            ssl_context=tls.node,
            on_connect=lambda node_id, generation: self.metrics.node_connected(node_id),
            on_disconnect=lambda node_id, generation, cause: self.metrics.node_disconnected(node_id, cause),
            on_pending_closed=self.metrics.node_pending_closed,
            on_rejected=self.metrics.node_registration_rejected,
        )
        self.metrics.follow_node_socket(lambda: self.registry.limits.pending)
        self.front_door = FrontDoor(config.overload.policy())
        self.metrics.follow_front_door(self.front_door.status)
        self.ha = EdgeHa.of(config.ha, self._leadership_changed) if config.ha is not None else None
        if self.ha is not None:
            self.metrics.registry.register(self.ha.collector(self.registry.fence))
            self.registry.fence.leads = self.ha.admits  # [ha-step-down] asked before every run is sent
        self.api = EdgeAPI(self)
        self._reload_lock = trio.Lock()
        self.http_port: int | None = None
        self.node_port: int | None = None

    # ----------------------------------------------------------------- refresh

    async def reload(self) -> list[str]:
        """Re-read the config file and apply it; return every error (empty: applied).

        [reload-off-loop] The file is read, parsed and validated, and its pool
        and lookup tables built, in a child process at a lower OS priority
        (:mod:`iop_edge.config.reader`); the loop rebuilds the result about a
        millisecond at a time, so it (streams, heartbeats, other requests)
        keeps running. What the new config changes in the pool is worked out
        in turns with the loop (``admission.prepare_refresh`` in a worker
        thread that runs only while the loop waits for it, a slice at a time),
        which also reads the certificate files (the models' tokenizer files, if
        any, are read before, in a worker thread); only the validated result is
        applied on the loop, at once (``admission.refresh``), so that step
        costs what changed, not the size of the fleet; the old config is then
        freed a slice per loop turn. Reloads are serialized: one that arrives
        during another waits for it, then reads the file again. An invalid
        file changes nothing. ``listen``, ``node_listen``, the size limits and
        turning TLS on or off apply at the next start only; tokens, queue
        policy, providers, models, the heartbeat timeout, the node socket
        limits and the certificate files apply at once (to new connections).

        Checkpoints. Cancelled, it returns at once and changes nothing (the
        child is killed, the thread's result dropped), so a shutdown never
        waits for a reload.
        """
        async with self._reload_lock:
            if self.config_path is None:
                return ["this Edge was started without a config file"]
            path = self.config_path
            times = _ReloadTimes(time.perf_counter())
            try:
                config, prepared, tls = await self._read_and_prepare(path, times)
                self.admission.refresh(prepared)
                times.mark("refresh")
            except (ConfigFileError, ConfigError) as exc:
                errors = error_lines(path, exc)
            else:
                old: list[object] = [self.config]
                self._apply(config, tls)
                del config, prepared  # the old pool too: only `old` holds the old config now
                times.mark("swap")
                await release_in_slices(old)
                times.mark("release")
                logger.info("config reloaded from %s (%s)", path, times)
                return []
            self.metrics.refresh_result("rejected")
            for error in errors:
                logger.error("config reload rejected: %s", error)
            return errors

    async def _read_and_prepare(
        self, path: str | os.PathLike[str], times: _ReloadTimes
    ) -> tuple[EdgeConfig, PreparedRefresh, _TlsContexts]:
        """The file read and validated off the loop, its tokenizers loaded, the pool's refresh
        prepared in turns (see :meth:`reload`); raises the config's errors, changes nothing."""
        output = await run_reader(path)
        times.mark("read")
        read = await rebuild(output)
        times.mark("rebuild")
        times.reader_cpu = read.reader_cpu
        config = read.config
        del read, output  # the reader's output: only the config is kept
        if any(model.tokenizer is not None for model in config.models):
            await run_off_loop(lambda: _load_tokenizers(config, path))
            times.mark("tokenizers")
        prepared, tls = await run_in_turns(lambda: _prepare_config(config, path, self.admission, times))
        _refuse_tls_switch(self.config, config, path)
        return config, prepared, tls

    def _apply(self, config: EdgeConfig, tls: _TlsContexts) -> None:
        """Put a validated config in force (the pool is already refreshed)."""
        self.config = config
        self.registry.heartbeat_timeout = config.heartbeat_timeout_ms / 1000
        self.registry.handshake_timeout = config.node_handshake_timeout_ms / 1000
        config.node_socket_limits(self.registry.limits)
        # New connections only; established ones keep their TLS session.
        self.registry.ssl_context, self.api_ssl_context = tls.node, tls.api
        self.metrics.refresh_result("ok")

    def _leadership_changed(self, leadership: Leadership) -> None:
        """[ha-election] Log each change of role (the HTTP API asks :meth:`EdgeHa.admits` per request)."""
        logger.warning("ha: this Edge is %s at epoch %d", leadership.role, leadership.epoch)
        if leadership.leading:  # [epoch-fencing] stamp runs with the term's epoch, announce it to the nodes
            self.registry.fence.lead(leadership.epoch, self.registry.links())
        else:
            self.registry.fence.stand_by()

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        """The ``/status`` document, read in one go (for tools and tests; the route reads in slices)."""
        node_ids = [n.id for n in self.config.nodes]
        nodes = self.registry.node_status(node_ids)
        ha = self.ha.status() if self.ha is not None else None
        status = EdgeStatus(self.admission.snapshot(), nodes, self.front_door.status(), ha, self.metrics.failures)
        return status_document(status)

    async def status_rows(self, *, node: str | None = None, model: str | None = None) -> StatusRows:
        """What ``/status`` writes, optionally only one node's or one model key's part.

        ``node``: that node and its providers. ``model``: the providers the
        model key lists and their nodes. Both: the intersection. An unknown
        id gives empty lists. [status-at-size] Read a slice at a time
        (:func:`rows_in_slices`, then the nodes' connection state
        :data:`NODE_SLICE` nodes per loop turn), so no stream waits for
        10,000 rows; with ``node``, only that node's rows are read, in one
        go. Turning it into JSON is the caller's. Checkpoints.
        """
        if node is None:
            head, rows = await rows_in_slices(self.admission)
        else:
            # The config and the pool are swapped in one loop turn, so the span is the pool's.
            first, count = self.config.provider_span(node)
            head = self.admission.snapshot(count=0)
            rows = self.admission.provider_rows(first=first, count=count) if count else []
        config = self.config  # the config the rows belong to (no checkpoint since)
        node_ids = [n.id for n in config.nodes]
        if node is not None or model is not None:
            listed = set(config.candidates_of(model)) if model is not None else None
            rows = [
                r
                for r in rows
                if (node is None or r["node_id"] == node)
                and (listed is None or ProviderKey(r["node_id"], r["provider_id"]) in listed)
            ]
            keep = {r["node_id"] for r in rows} if listed is not None else {node}
            node_ids = [n for n in node_ids if n in keep]
        nodes: list[NodeRow] = []
        for first in range(0, len(node_ids), NODE_SLICE):
            if first:
                await trio.lowlevel.checkpoint()
            nodes.extend(self.registry.node_rows(node_ids[first : first + NODE_SLICE]))
        ha = self.ha.status() if self.ha is not None else None
        failures = {
            model: dict(counts) for model, counts in self.metrics.failures.items()
        }  # JSON is written off the loop
        return StatusRows(head, rows, nodes, self.front_door.status(), ha, failures)

    # ------------------------------------------------------------------- serve

    async def serve(self, *, task_status: trio.TaskStatus[tuple[int, int]] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the node socket and the HTTP API until cancelled.

        Reports ``(http_port, node_port)`` through ``task_status`` once both
        listen. Cancellation closes every node connection (each node is
        disconnected, so leases are fenced) and stops the HTTP server.
        """
        config = self.config
        async with trio.open_nursery() as nursery:
            health_log = HealthLog(lambda: self.admission.config)
            await nursery.start(feed, self.admission, (self.metrics.requests.observe, health_log.observe))
            if self.ha is not None:  # campaigns from the start; nodes register with a standby too
                await nursery.start(self.ha.run)
            nursery.start_soon(self.admission.watch_ejections)  # ejections end on time [outlier-ejection]
            nursery.start_soon(self.api.queue_page.run)  # the page's memory, from the start [queue-page]
            self.node_port = await nursery.start(
                _serve_nodes,
                self.registry,
                config.node_listen.host,
                config.node_listen.port,
                config.node_listen_backlog,
            )
            nursery.start_soon(watch_loop_lag, self.front_door.shedder)
            limits = HttpLimits(
                header_timeout=config.header_timeout_ms / 1000,
                max_chunk_extension_bytes=config.max_chunk_extension_bytes,
                max_connections=config.overload.max_connections,
            )
            wrap = self._secure_http if self.api_ssl_context is not None else None
            self.http_port = await nursery.start(
                functools.partial(
                    serve_http,
                    self.api,
                    config.listen.host,
                    config.listen.port,
                    limits=limits,
                    counter=self.front_door.connections,
                    wrap_stream=wrap,
                    refuse_head=self.api.refuse_head,
                )
            )
            logger.info(
                "iop-edge listening: %s://%s:%d (API), %s://%s:%d (nodes)",
                "https" if wrap else "http",
                config.listen.host,
                self.http_port,
                "wss" if self.registry.ssl_context else "ws",
                config.node_listen.host,
                self.node_port,
            )
            task_status.started((self.http_port, self.node_port))
            try:
                await trio.sleep_forever()
            finally:
                self.registry.close_all()

    async def _secure_http(self, stream: trio.SocketStream) -> trio.abc.Stream:
        """TLS for one accepted HTTP connection, with the certificate in force now.

        The listener bounds it by the request-head deadline. Checkpoints. A
        failed handshake returns the broken stream: its first read ends the
        connection.
        """
        assert self.api_ssl_context is not None
        tls = trio.SSLStream(stream, self.api_ssl_context, server_side=True, https_compatible=True)
        try:
            await tls.do_handshake()
        except trio.BrokenResourceError as exc:
            logger.debug("HTTP API: TLS handshake failed: %s", exc.__cause__ or exc)
        return tls


@attrs.frozen
class _TlsContexts:
    node: ssl.SSLContext | None
    api: ssl.SSLContext | None


def _tls_contexts(config: EdgeConfig, path: str | os.PathLike[str] | None) -> _TlsContexts:
    """Both listeners' server contexts, read from the files now (None: no TLS there).

    Raises:
        ConfigFileError: a file cannot be used (it changed since the config was checked).
    """
    errors: list[str] = []
    contexts: dict[str, ssl.SSLContext | None] = {}
    for key, tls in (("node_tls", config.node_tls), ("tls", config.tls)):
        try:
            contexts[key] = tls.ssl_context() if tls is not None else None
        except TlsFileError as exc:
            errors.append(f"{path}: {key}.{exc.field}: {exc.message}")
    if errors:
        raise ConfigFileError(errors)
    return _TlsContexts(contexts["node_tls"], contexts["tls"])


def _load_tokenizers(config: EdgeConfig, path: str | os.PathLike[str]) -> None:
    """Read the models' tokenizers in this process ([token-ledger]; a reload's reader process only
    checked them), so a request counts with them at once.

    Raises:
        ConfigFileError: a file cannot be used (it changed since the config was checked).
    """
    errors = []
    for i, model in enumerate(config.models):
        if model.tokenizer is not None:
            try:
                load_tokenizer(model.tokenizer)
            except TokenizerError as exc:
                errors.append(f"{path}: models[{i}].tokenizer: {exc}")
    if errors:
        raise ConfigFileError(errors)


def _refuse_tls_switch(running: EdgeConfig, new: EdgeConfig, path: str | os.PathLike[str]) -> None:
    """Raise ConfigFileError if ``new`` turns TLS on or off on a listener: that takes a restart."""
    errors = [
        f"{path}: {key}: turning TLS on or off takes a restart"
        for key, before, after in (("node_tls", running.node_tls, new.node_tls), ("tls", running.tls, new.tls))
        if (before is None) != (after is None)
    ]
    if errors:
        raise ConfigFileError(errors)


@attrs.define
class _ReloadTimes:
    """Where a reload's time went: each step's seconds, the reader process's and the worker
    thread's CPU seconds, for the log line (``str``)."""

    last: float
    steps: dict[str, float] = attrs.field(factory=dict)
    reader_cpu: float | None = None
    worker_cpu: float | None = None

    def mark(self, step: str) -> None:
        """``step`` ended now (it began at the previous mark)."""
        now = time.perf_counter()
        self.steps[step], self.last = now - self.last, now

    def __str__(self) -> str:
        parts = [f"{step} {seconds * 1000:.1f} ms" for step, seconds in self.steps.items()]
        for what, cpu in (("reader", self.reader_cpu), ("worker", self.worker_cpu)):
            if cpu is not None:
                parts.append(f"{what} CPU {cpu * 1000:.1f} ms")
        return ", ".join(parts)


def _prepare_config(
    config: EdgeConfig, path: str | os.PathLike[str], admission: Admission, times: _ReloadTimes
) -> tuple[PreparedRefresh, _TlsContexts]:
    """Prepare the pool's refresh of ``admission`` to ``config`` and read its certificates (runs in
    turns with the loop, :func:`~iop_edge._off_loop.run_in_turns`; changes nothing but ``times``).

    Raises:
        ConfigFileError, ConfigError: the config is unusable (see :func:`_tls_contexts`).
    """
    cpu = time.thread_time()
    prepared = admission.prepare_refresh(config.pool_config(), pause=yield_to_loop)
    times.mark("prepare")
    tls = _tls_contexts(config, path)
    times.mark("tls")
    times.worker_cpu = time.thread_time() - cpu
    return prepared, tls


async def load_config_off_loop(path: str | os.PathLike[str]) -> EdgeConfig:
    """:func:`load_edge_config` in a worker thread, its lookup tables built there too (not on the
    loop at the first registration), so the event loop keeps running meanwhile.

    Checkpoints. Raises what :func:`load_edge_config` raises.
    """

    def load() -> EdgeConfig:
        config = load_edge_config(path)
        config.build_lookups()
        return config

    return await trio.to_thread.run_sync(load, abandon_on_cancel=True)


async def _serve_nodes(
    registry: NodeRegistry,
    host: str,
    port: int,
    backlog: int,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept node connections on ``host:port`` and serve each with ``registry.serve_stream``.

    Reports the bound port through ``task_status`` once listening, with an
    accept queue of ``backlog`` connections (the kernel caps it at
    ``net.core.somaxconn``) [reconnect-storm]. The
    registry, not trio-websocket's server, runs each connection: it counts
    and limits pending connections from the moment of accept.
    """
    listeners = await trio.open_tcp_listeners(port, host=host, backlog=backlog)
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(registry.serve_stream, listeners)
