"""The Node's configuration file (``node.yaml``) as frozen attrs values.

The key names are a contract (``docs/node.md``, Configuration)::

    node_id: node-a
    edge_url: ws://127.0.0.1:8081   # or edge_urls: [ws://edge-1:8081, ws://edge-2:8081] (HA)
    token: dev-token                # or token_env: NAME (exactly one)
    heartbeat_interval_ms: 5000
    runtime: {concurrency: 4}
    providers:
      - {id: gpu0, adapter: openai, base_url: "http://127.0.0.1:9100/v1", capacity: 1}

Every other key is optional and documented in ``docs/node.md``. Loading goes
through :func:`iop_config.load_config`, so every problem is reported as
``FILE:LINE: field.path: message`` and unknown keys are errors. Cross-field rules
live in :meth:`NodeConfig.problems`, which the loader calls after structuring.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Iterator, Mapping
from typing import final

import attrs

from iop_config import client_ssl_context, load_config, tls_problems

ADAPTERS = ("openai", "ollama", "mock")
"""Adapter names a provider may use."""

_HTTP_ADAPTERS = ("openai", "ollama")
MAX_ABORT_GRACE_MS = 1_500
"""The most ``abort_grace_ms``: the Edge waits 2 s for a cancelled run's end before it lets its lease go."""

PROBES = ("auto", "openai", "llama_cpp", "vllm", "ollama", "none")
"""Readiness probe kinds (``providers[].health.probe``); ``auto`` picks by adapter."""


@final
@attrs.frozen
class RuntimeConfig:
    """Node-wide runtime limits.

    Attributes:
        concurrency: max concurrent runs across all providers (>= 1); runs over
            the limit are rejected at once with ``concurrency_limit``.
    """

    concurrency: int = 4

    def field_problems(self, path: str) -> Iterator[tuple[str, str]]:
        """Yield ``(path, message)`` for every invalid value below ``path``."""
        if self.concurrency < 1:
            yield f"{path}.concurrency", f"must be >= 1, got {self.concurrency}"


@final
@attrs.frozen
class ReconnectConfig:
    """Backoff between connection attempts: doubling from ``initial_ms`` to ``max_ms``.

    Attributes:
        initial_ms: first delay after a failed attempt or a drop.
        max_ms: cap of the doubling delay.
        jitter: relative jitter, 0.2 means +-20 %.
    """

    initial_ms: int = 100
    max_ms: int = 5000
    jitter: float = 0.2

    def field_problems(self, path: str) -> Iterator[tuple[str, str]]:
        """Yield ``(path, message)`` for every invalid value below ``path``."""
        if self.initial_ms < 1:
            yield f"{path}.initial_ms", f"must be >= 1, got {self.initial_ms}"
        if self.max_ms < self.initial_ms:
            yield f"{path}.max_ms", f"must be >= initial_ms ({self.initial_ms}), got {self.max_ms}"
        if not 0.0 <= self.jitter < 1.0:
            yield f"{path}.jitter", f"must be in [0, 1), got {self.jitter}"


@final
@attrs.frozen
class UpstreamLimits:
    """``providers[].limits``: bounds on what the provider's backend may send (docs/security.md).

    Past any of them the run fails (the client gets 502) and the connection to
    the backend is closed; nothing else is affected.

    Attributes:
        head_bytes: the most bytes of an answer's head, informational (1xx)
            answers before it included (failure: ``upstream_too_large``).
        answer_bytes: the most bytes of a non-stream answer's body, and of one
            line of a streamed answer the Node parses (``upstream_too_large``).
        chunk_extension_bytes: the most bytes of chunk extensions and trailer
            fields in one chunked answer (RFC 9112 §7.1.1; ``upstream_error``).
        informational_answers: the most 1xx answers before the final one
            (``upstream_error``).
    """

    head_bytes: int = 64 * 1024
    answer_bytes: int = 16 * 1024 * 1024
    chunk_extension_bytes: int = 16 * 1024
    informational_answers: int = 5

    def field_problems(self, path: str) -> Iterator[tuple[str, str]]:
        """Yield ``(path, message)`` for every invalid value below ``path``."""
        for name in ("head_bytes", "answer_bytes"):
            if getattr(self, name) < 1024:
                yield f"{path}.{name}", f"must be >= 1024, got {getattr(self, name)}"
        for name in ("chunk_extension_bytes", "informational_answers"):
            if getattr(self, name) < 0:
                yield f"{path}.{name}", f"must be >= 0, got {getattr(self, name)}"


@final
@attrs.frozen
class HealthConfig:
    """``providers[].health``: how the node watches the provider while connected (docs/node.md, Health).

    Envoy's active health checking knobs for the readiness probe, the
    forward-progress watchdog's ``stall_ms`` and the optional idle canary.

    Attributes:
        probe: the readiness probe: ``openai`` (``GET {base_url}/models``),
            ``llama_cpp`` (``/health``, 503 while loading, and ``/slots``),
            ``vllm`` (``/health`` and ``/metrics``), ``ollama`` (``/api/ps``),
            ``none``; ``auto`` is ``openai`` or ``ollama`` by adapter, ``none`` for ``mock``.
        interval_ms: time between two probes while the provider has traffic.
        timeout_ms: a probe without a whole answer in this time failed.
        unhealthy_threshold: failed probes in a row that make a ready provider not ready.
        healthy_threshold: passed probes in a row that make a not-ready provider ready.
        no_traffic_interval_ms: time between two probes once the provider has had no
            run for this long (Envoy's ``no_traffic_interval``).
        jitter: relative jitter of every interval, 0.1 means +-10 %.
        stall_ms: a provider whose runs in flight all went this long without a
            byte from the backend is stalled (0: no watchdog).
        canary_idle_ms: after this long without a run, send a one-token
            completion (None: no canary; it costs tokens).
        canary_model: the upstream model the canary names (required with ``canary_idle_ms``).
    """

    probe: str = "auto"
    interval_ms: int = 1000
    timeout_ms: int = 1000
    unhealthy_threshold: int = 2
    healthy_threshold: int = 1
    no_traffic_interval_ms: int = 10_000
    jitter: float = 0.1
    stall_ms: int = 6000
    canary_idle_ms: int | None = None
    canary_model: str | None = None

    def field_problems(self, path: str) -> Iterator[tuple[str, str]]:
        """Yield ``(path, message)`` for every invalid value below ``path``."""
        if self.probe not in PROBES:
            yield f"{path}.probe", f"must be one of {', '.join(PROBES)}, got {self.probe!r}"
        for name in ("interval_ms", "timeout_ms", "unhealthy_threshold", "healthy_threshold", "no_traffic_interval_ms"):
            if getattr(self, name) < 1:
                yield f"{path}.{name}", f"must be >= 1, got {getattr(self, name)}"
        if not 0.0 <= self.jitter < 1.0:
            yield f"{path}.jitter", f"must be in [0, 1), got {self.jitter}"
        if self.stall_ms < 0:
            yield f"{path}.stall_ms", f"must be >= 0, got {self.stall_ms}"
        if self.canary_idle_ms is not None:
            if self.canary_idle_ms < 1:
                yield f"{path}.canary_idle_ms", f"must be >= 1, got {self.canary_idle_ms}"
            if not self.canary_model:
                yield f"{path}.canary_model", "is required with canary_idle_ms"

    def probe_for(self, adapter: str) -> str:
        """The probe kind used for a provider of ``adapter`` (``auto`` resolved)."""
        if self.probe != "auto":
            return self.probe
        return adapter if adapter in _HTTP_ADAPTERS else "none"


@final
@attrs.frozen
class ProviderConfig:
    """One backend exposed by this node.

    Attributes:
        id: provider id, unique on this node (the Edge names it ``node/id``).
        adapter: ``openai``, ``ollama`` or ``mock``.
        capacity: max concurrent runs on this provider (>= 1); also the size of
            its HTTP connection pool.
        base_url: upstream URL; required for ``openai`` (e.g.
            ``http://127.0.0.1:9100/v1``) and ``ollama`` (e.g.
            ``http://127.0.0.1:11434``); unused by ``mock``.
        timeout_ms: max wait for the upstream between two reads (and for the
            whole non-stream response body to start).
        connect_timeout_ms: max wait to open a TCP connection to the upstream.
        abort_grace_ms: how long a cancelled run's upstream request is held, counted busy, for the
            backend to let go of it (close its connection) before its capacity returns
            ([cancel-upstream]); 0: closed at once. At most :data:`MAX_ABORT_GRACE_MS`.
        latency_ms: ``mock`` only: delay before the first chunk.
        tokens_per_second: ``mock`` only: streaming rate; 0 means no delay.
        fail_after_chunks: ``mock`` only: fault knob; after this many chunks the
            run fails with ``upstream_error`` (None: never).
        limits: bounds on what the backend sends.
        health: readiness probe, stall watchdog and canary.
    """

    id: str
    adapter: str
    capacity: int = 1
    base_url: str | None = None
    timeout_ms: int = 300_000
    connect_timeout_ms: int = 5_000
    abort_grace_ms: int = 1_000
    latency_ms: int = 0
    tokens_per_second: float = 0.0
    fail_after_chunks: int | None = None
    limits: UpstreamLimits = UpstreamLimits()
    health: HealthConfig = HealthConfig()

    def field_problems(self, path: str) -> Iterator[tuple[str, str]]:
        """Yield ``(path, message)`` for every invalid value below ``path``."""
        if not self.id:
            yield f"{path}.id", "must not be empty"
        if self.adapter not in ADAPTERS:
            yield f"{path}.adapter", f"must be one of {', '.join(ADAPTERS)}, got {self.adapter!r}"
        if self.capacity < 1:
            yield f"{path}.capacity", f"must be >= 1, got {self.capacity}"
        if self.adapter in _HTTP_ADAPTERS:
            if self.base_url is None:
                yield f"{path}.base_url", f"is required for adapter {self.adapter!r}"
            elif not self.base_url.startswith(("http://", "https://")):
                yield f"{path}.base_url", f"must start with http:// or https://, got {self.base_url!r}"
        for name in ("timeout_ms", "connect_timeout_ms"):
            if getattr(self, name) < 1:
                yield f"{path}.{name}", f"must be >= 1, got {getattr(self, name)}"
        if not 0 <= self.abort_grace_ms <= MAX_ABORT_GRACE_MS:
            yield f"{path}.abort_grace_ms", f"must be 0 to {MAX_ABORT_GRACE_MS}, got {self.abort_grace_ms}"
        if self.latency_ms < 0:
            yield f"{path}.latency_ms", f"must be >= 0, got {self.latency_ms}"
        if self.tokens_per_second < 0:
            yield f"{path}.tokens_per_second", f"must be >= 0, got {self.tokens_per_second}"
        if self.fail_after_chunks is not None and self.fail_after_chunks < 0:
            yield f"{path}.fail_after_chunks", f"must be >= 0, got {self.fail_after_chunks}"
        yield from self.limits.field_problems(f"{path}.limits")
        yield from self.health.field_problems(f"{path}.health")
        if self.adapter not in _HTTP_ADAPTERS and self.health.probe not in ("auto", "none"):
            yield f"{path}.health.probe", f"adapter {self.adapter!r} has no HTTP backend to probe"


@final
@attrs.frozen(kw_only=True)
class TlsConfig:
    """``tls``: how the node checks the Edge's certificate, and the certificate it presents.

    Attributes:
        ca_file: PEM file of the CA(s) that issued the Edge's certificate
            (a private CA); None: the system's trusted CAs.
        cert_file: this node's client certificate (PEM), for an Edge that
            requires mutual TLS; it must name the node id as a DNS name in its
            subject alternative names.
        key_file: the private key of ``cert_file`` (PEM, unencrypted).
    """

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def ssl_context(self) -> ssl.SSLContext:
        """A fresh client context from the files (read now).

        Raises:
            iop_config.TlsFileError: a file is missing, unreadable or does not fit.
        """
        return client_ssl_context(self.ca_file, self.cert_file, self.key_file)

    def field_problems(self, path: str, edge_urls: tuple[str, ...]) -> Iterator[tuple[str, str]]:
        if (self.cert_file is None) != (self.key_file is None):
            missing = "key_file" if self.key_file is None else "cert_file"
            yield f"{path}.{missing}", "give cert_file and key_file together"
        elif not all(url.startswith("wss://") for url in edge_urls):
            yield path, "TLS settings need a wss:// edge_url"
        else:
            yield from tls_problems(path, self.ssl_context)


@final
@attrs.frozen(kw_only=True)
class NodeConfig:
    """The whole ``node.yaml``.

    Attributes:
        node_id: this node's id as configured on the Edge.
        edge_url: ``ws://`` or ``wss://`` URL of the Edge's node socket; the
            one-Edge form of ``edge_urls`` (give exactly one of the two).
        edge_urls: the node sockets of every Edge of an HA group (docs/ha.md):
            the node keeps one registered connection to each, all sharing its
            one gate [warm-standby].
        providers: the backends this node serves (at least one, unique ids).
        token: the registration token (never logged, never in repr).
        token_env: name of an environment variable holding the token instead.
        heartbeat_interval_ms: heartbeat period; the node uses the smaller of
            this and the Edge's ``registered.heartbeat_interval_ms``.
        runtime: node-wide limits.
        reconnect: backoff between connection attempts.
        tls: private CA and client certificate for a ``wss://`` Edge.
    """

    node_id: str
    providers: tuple[ProviderConfig, ...]
    edge_url: str | None = None
    edge_urls: tuple[str, ...] = ()
    token: str | None = attrs.field(default=None, repr=False)
    token_env: str | None = None
    heartbeat_interval_ms: int = 5000
    runtime: RuntimeConfig = RuntimeConfig()
    reconnect: ReconnectConfig = ReconnectConfig()
    tls: TlsConfig | None = None

    def problems(self) -> Iterator[tuple[str, str]]:
        """Yield ``(field path, message)`` for every cross-field problem.

        Called by :func:`iop_config.load_config` after structuring. The
        ``token_env`` variable is looked up in ``os.environ`` here, so a missing
        token is reported with its file and line like any other problem.
        """
        if not self.node_id:
            yield "node_id", "must not be empty"
        yield from self._url_problems()
        if self.token is not None and self.token_env is not None:
            yield "token_env", "give either token or token_env, not both"
        elif self.token is None and self.token_env is None:
            yield "token", "missing: give token or token_env"
        elif self.token is not None and not self.token:
            yield "token", "must not be empty"
        elif self.token_env is not None and not os.environ.get(self.token_env):
            yield "token_env", f"environment variable {self.token_env!r} is not set or empty"
        if self.heartbeat_interval_ms < 1:
            yield "heartbeat_interval_ms", f"must be >= 1, got {self.heartbeat_interval_ms}"
        yield from self.runtime.field_problems("runtime")
        yield from self.reconnect.field_problems("reconnect")
        if self.tls is not None:
            yield from self.tls.field_problems("tls", self.urls)
        if not self.providers:
            yield "providers", "must list at least one provider"
        seen: set[str] = set()
        for index, provider in enumerate(self.providers):
            yield from provider.field_problems(f"providers[{index}]")
            if provider.id in seen:
                yield f"providers[{index}].id", f"duplicate provider id {provider.id!r}"
            seen.add(provider.id)

    @property
    def urls(self) -> tuple[str, ...]:
        """Every Edge this node connects to: ``edge_urls``, or ``(edge_url,)``."""
        if self.edge_urls:
            return self.edge_urls
        return (self.edge_url,) if self.edge_url is not None else ()

    def _url_problems(self) -> Iterator[tuple[str, str]]:
        if self.edge_url is not None and self.edge_urls:
            yield "edge_urls", "give either edge_url or edge_urls, not both"
            return
        if self.edge_url is None and not self.edge_urls:
            yield "edge_url", "missing: give edge_url or edge_urls"
            return
        field = "edge_url" if self.edge_url is not None else "edge_urls"
        seen: set[str] = set()
        for index, url in enumerate(self.urls):
            path = field if self.edge_url is not None else f"{field}[{index}]"
            if not url.startswith(("ws://", "wss://")):
                yield path, f"must start with ws:// or wss://, got {url!r}"
            elif url in seen:
                yield path, f"duplicate Edge URL {url!r}"
            seen.add(url)

    def ssl_context(self, url: str | None = None) -> ssl.SSLContext | None:
        """The client context for ``url`` (default: the first Edge URL), read from the files now; None for ``ws://``.

        Raises:
            iop_config.TlsFileError: a file named under ``tls`` cannot be used.
        """
        target = url if url is not None else self.urls[0]
        if not target.startswith("wss://"):
            return None
        return self.tls.ssl_context() if self.tls is not None else client_ssl_context()

    def resolved_token(self, environ: Mapping[str, str] | None = None) -> str:
        """Return the registration token, reading ``token_env`` if that is set.

        Raises:
            LookupError: neither ``token`` nor a set ``token_env`` variable gives one.
        """
        if self.token:
            return self.token
        env = os.environ if environ is None else environ
        if self.token_env and env.get(self.token_env):
            return env[self.token_env]
        raise LookupError("no registration token: set token or token_env")


def load_node_config(path: str | os.PathLike[str]) -> NodeConfig:
    """Read and validate a ``node.yaml``.

    Raises:
        iop_config.ConfigFileError: every problem, each ``FILE:LINE: path: message``.
        OSError: the file cannot be read.
    """
    return load_config(path, NodeConfig)
