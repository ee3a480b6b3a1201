"""The Edge config file (``edge.yaml``): structure, validation, and mapping to a PoolConfig.

The key names are a contract (``docs/edge-config.md``). The
classes below describe the file one to one; :meth:`EdgeConfig.problems` holds
every cross-field rule, so each problem is reported as ``FILE:LINE: path:
message`` by :mod:`iop_config`. :func:`load_edge_config` then resolves the
secrets the file only names (``token_env``, ``admin_token_env``,
``api_keys_env``) from the environment.

Secrets: node tokens and the admin token are ``repr=False``. API keys never
exist in the loaded config in plain form: each is structured straight into an
:class:`ApiKeyDigest` (SHA-256 hex) and compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import ssl
from collections.abc import Callable, Iterator, Mapping
from typing import ClassVar, NamedTuple, TypeVar, final

import attrs
import cattrs

from iop_admission import (
    ConfigError,
    ModelGroup,
    OutlierPolicy,
    PoolConfig,
    ProviderKey,
    ProviderSpec,
    QueuePolicy,
    RetryPolicy,
    TenantSpec,
    validate_pool,
)
from iop_config import load_config, make_converter, server_ssl_context, tls_problems
from iop_edge._off_loop import paced, yield_to_loop
from iop_edge.api.overload import OverloadPolicy
from iop_edge.nodes.limits import PendingLimits

T = TypeVar("T")

__all__ = [
    "ApiKeyDigest",
    "ApiTls",
    "EdgeCandidate",
    "EdgeConfig",
    "EdgeModel",
    "EdgeNode",
    "EdgeProvider",
    "EdgeTenant",
    "HostPort",
    "NodeTls",
    "OutlierSettings",
    "ProviderPool",
    "RetrySettings",
    "UiConfig",
    "load_edge_config",
    "parse_host_port",
]


def _queue_hints(owner: str) -> Mapping[str, str]:
    """[queue-ownership] messages for queue keys written where they do not belong."""
    message = f"queue settings belong to provider_pool (Edge-wide), not to {owner}"
    return {"max_queue": message, "queue_timeout_ms": message}


@final
class HostPort(NamedTuple):
    """A listen address parsed from ``"host:port"`` (``"[::1]:8080"`` for IPv6).

    A NamedTuple rather than an attrs class so that ``host, port = cfg.listen``
    works where a socket API wants the pair.
    """

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


_PORT = re.compile(r"[0-9]{1,5}")


def parse_host_port(text: str) -> HostPort:
    """Parse ``"host:port"``; raise ``ValueError`` with a human message if malformed."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError("must be 'host:port', e.g. '127.0.0.1:8080'")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError("an IPv6 host goes in brackets, e.g. '[::1]:8080'")
    if not host:
        raise ValueError("must be 'host:port' with a non-empty host")
    if not _PORT.fullmatch(port) or int(port) > 65535:
        raise ValueError("port must be an integer from 0 to 65535")
    return HostPort(host, int(port))


@final
@attrs.frozen
class ApiKeyDigest:
    """SHA-256 hex digest of one HTTP API key; the plain key is never stored."""

    hexdigest: str

    @classmethod
    def of(cls, key: str) -> ApiKeyDigest:
        """Digest a plain key."""
        return cls(hashlib.sha256(key.encode("utf-8")).hexdigest())


@final
@attrs.frozen(kw_only=True)
class RetrySettings:
    """``provider_pool.retry``: failover before the first byte ([failover-before-first-byte])."""

    max_attempts: int = 2

    def policy(self) -> RetryPolicy:
        """The library's policy."""
        return RetryPolicy(max_attempts=self.max_attempts)


@final
@attrs.frozen(kw_only=True)
class OutlierSettings:
    """``provider_pool.outlier``: passive ejection of failing providers ([outlier-ejection])."""

    consecutive_failures: int = 3
    base_ejection_ms: int = 5000
    max_ejection_ms: int = 300000

    def policy(self) -> OutlierPolicy:
        """The library's policy (milliseconds become seconds)."""
        return OutlierPolicy(
            consecutive_failures=self.consecutive_failures,
            base_ejection=self.base_ejection_ms / 1000,
            max_ejection=self.max_ejection_ms / 1000,
        )

    def problems(self) -> Iterator[tuple[str, str]]:
        where = "provider_pool.outlier"
        yield from _at_least(f"{where}.consecutive_failures", self.consecutive_failures, 0)
        yield from _at_least(f"{where}.base_ejection_ms", self.base_ejection_ms, 1)
        if self.max_ejection_ms < self.base_ejection_ms:
            yield f"{where}.max_ejection_ms", f"must be >= base_ejection_ms ({self.base_ejection_ms})"


@final
@attrs.frozen(kw_only=True)
class ProviderPool:
    """``provider_pool``: the one Edge-wide queue policy ([queue-ownership]), retry and outlier settings."""

    max_queue: int = 64
    queue_timeout_ms: int = 30000
    retry: RetrySettings = attrs.field(factory=RetrySettings)
    outlier: OutlierSettings = attrs.field(factory=OutlierSettings)

    def policy(self) -> QueuePolicy:
        """The library's policy (milliseconds become seconds)."""
        return QueuePolicy(max_queue=self.max_queue, queue_timeout=self.queue_timeout_ms / 1000)


@final
@attrs.frozen(kw_only=True)
class EdgeProvider:
    """``nodes[].providers[]``: per-provider execution properties, never queue settings."""

    id: str
    capacity: int
    long_context_capacity: int = 0
    context_window_tokens: int = 0
    total_context_tokens: int | None = None
    priority: int = 0
    enabled: bool = True
    _spec: ProviderSpec | None = attrs.field(default=None, init=False, eq=False, repr=False)
    """The spec, once built (:meth:`spec`); not a key of the file."""

    config_key_hints: ClassVar[Mapping[str, str]] = _queue_hints("a provider")

    def spec(self) -> ProviderSpec:
        """The library's spec, built once per provider object. Raises ``ConfigError`` on bad values.

        [reload-off-loop] A loaded file shares one provider object among the
        providers written alike (see :func:`_memoized_hook`), so a spec is
        built and checked once per distinct provider.
        """
        if self._spec is None:
            spec = ProviderSpec(
                capacity=self.capacity,
                long_context_capacity=self.long_context_capacity,
                context_window_tokens=self.context_window_tokens,
                total_context_tokens=self.total_context_tokens,
                priority=self.priority,
                enabled=self.enabled,
            )
            object.__setattr__(self, "_spec", spec)
        assert self._spec is not None
        return self._spec


@final
@attrs.frozen(kw_only=True)
class EdgeNode:
    """``nodes[]``: a node allowed to register, its token and its providers.

    In the file exactly one of ``token`` / ``token_env`` is given. After
    :func:`load_edge_config`, ``token`` holds the effective token either way
    (``token_env`` still names where it came from).
    """

    id: str
    providers: tuple[EdgeProvider, ...]
    token: str | None = attrs.field(default=None, repr=False)
    token_env: str | None = None

    config_key_hints: ClassVar[Mapping[str, str]] = _queue_hints("a node")


@final
@attrs.frozen(kw_only=True)
class EdgeCandidate:
    """``models[].candidates[]``: one provider that may serve the model."""

    node: str
    provider: str
    upstream_model: str | None = None

    config_key_hints: ClassVar[Mapping[str, str]] = _queue_hints("a candidate")

    @property
    def key(self) -> ProviderKey:
        """The provider's identity."""
        return ProviderKey(self.node, self.provider)


@final
@attrs.frozen(kw_only=True)
class EdgeModel:
    """``models[]``: an external model key and its candidates, in preference order."""

    id: str
    candidates: tuple[EdgeCandidate, ...]
    long_context_threshold_tokens: int | None = None
    first_token_timeout_ms: int | None = None

    config_key_hints: ClassVar[Mapping[str, str]] = _queue_hints("a model")


@final
@attrs.frozen(kw_only=True)
class NodeTls:
    """``node_tls``: TLS on the node socket; ``client_ca_file`` turns on mutual TLS.

    With mutual TLS a node must present a certificate issued by a CA in
    ``client_ca_file`` whose subject alternative names hold its node id as a
    DNS name.
    """

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def ssl_context(self) -> ssl.SSLContext:
        """A fresh server context from the files (read now).

        Raises:
            iop_config.TlsFileError: a file is missing, unreadable or does not fit.
        """
        return server_ssl_context(self.cert_file, self.key_file, self.client_ca_file)


@final
@attrs.frozen(kw_only=True)
class ApiTls:
    """``tls``: TLS on the HTTP API listener (``https://``)."""

    cert_file: str
    key_file: str

    def ssl_context(self) -> ssl.SSLContext:
        """A fresh server context from the files (read now), offering HTTP/1.1 by ALPN.

        Raises:
            iop_config.TlsFileError: a file is missing, unreadable or does not fit.
        """
        context = server_ssl_context(self.cert_file, self.key_file)
        context.set_alpn_protocols(["http/1.1"])
        return context


_DEFAULT_LISTEN = HostPort("127.0.0.1", 8080)
_DEFAULT_NODE_LISTEN = HostPort("127.0.0.1", 8081)


@final
@attrs.frozen(kw_only=True)
class OverloadConfig:
    """``overload``: when the Edge sheds new requests and refuses connections."""

    shed_loop_lag_ms: int = 200
    shed_connections: int = 6144
    max_connections: int = 8192
    max_retry_after_s: int = 30
    refusal_rate: int = 1000

    def policy(self) -> OverloadPolicy:
        """The front door's policy (milliseconds become seconds)."""
        return OverloadPolicy(
            shed_loop_lag=self.shed_loop_lag_ms / 1000,
            shed_connections=self.shed_connections,
            max_connections=self.max_connections,
            max_retry_after=self.max_retry_after_s,
            refusal_rate=self.refusal_rate,
        )

    def problems(self) -> Iterator[tuple[str, str]]:
        yield from _at_least("overload.shed_loop_lag_ms", self.shed_loop_lag_ms, 1)
        yield from _at_least("overload.max_connections", self.max_connections, 1)
        yield from _at_least("overload.shed_connections", self.shed_connections, 0)
        if self.shed_connections > self.max_connections:
            yield "overload.shed_connections", f"must be <= overload.max_connections ({self.max_connections})"
        yield from _at_least("overload.max_retry_after_s", self.max_retry_after_s, 1)
        yield from _at_least("overload.refusal_rate", self.refusal_rate, 1)


@final
@attrs.frozen(kw_only=True)
class HaConfig:
    """``ha``: active-passive Edges elected through etcd (docs/ha.md). Absent: one Edge, no etcd."""

    endpoints: tuple[str, ...]
    advertise: str
    election: str = "iop-edge"
    ttl_s: int = 2
    step_down_margin_ms: int | None = None
    """How long before its lease can expire the leader steps down; default a third of the TTL."""
    poll_interval_ms: int = 100
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    user: str | None = None
    """etcd user (etcd's auth enabled); with exactly one of ``password`` / ``password_env``."""
    password: str | None = attrs.field(default=None, repr=False)
    password_env: str | None = None

    @property
    def key(self) -> str:
        """The election key in etcd."""
        return f"/iop/election/{self.election}"

    @property
    def credentials(self) -> tuple[str, str] | None:
        """``(user, password)`` for etcd's auth, or None (no ``user``)."""
        return None if self.user is None else (self.user, self.password or "")

    @property
    def margin(self) -> float:
        if self.step_down_margin_ms is None:
            return self.ttl_s / 3
        return self.step_down_margin_ms / 1000

    def problems(self) -> Iterator[tuple[str, str]]:
        if not self.endpoints:
            yield "ha.endpoints", "must list at least one etcd endpoint"
        for i, endpoint in enumerate(self.endpoints):
            if not endpoint.startswith(("http://", "https://")):
                yield f"ha.endpoints[{i}]", "must be an http:// or https:// URL"
        if not self.advertise:
            yield "ha.advertise", "must be this Edge's address as clients reach it"
        yield from _at_least("ha.ttl_s", self.ttl_s, 2)
        if self.step_down_margin_ms is not None and not 0 < self.step_down_margin_ms < self.ttl_s * 1000:
            yield "ha.step_down_margin_ms", f"must be > 0 and < ha.ttl_s ({self.ttl_s} s)"
        yield from _at_least("ha.poll_interval_ms", self.poll_interval_ms, 10)
        if (self.cert_file is None) != (self.key_file is None):
            yield "ha.cert_file", "ha.cert_file and ha.key_file go together"
        if self.user is not None:
            if not self.user:
                yield "ha.user", "must not be empty"
            yield from _secret_problems(
                "ha.password", self.password, "ha.password_env", self.password_env, required=True
            )
        elif self.password is not None or self.password_env is not None:
            yield "ha.user", "required with ha.password or ha.password_env"


@final
@attrs.frozen(kw_only=True)
class UiConfig:
    """``ui``: the live queue page at ``/ui`` ([queue-page]); off unless ``enabled``.

    A viewer shows the admin token or ``viewer_token`` (read only: it opens the
    page and its stream, nothing else). At most ``max_viewers`` streams run at once.
    """

    enabled: bool = False
    viewer_token: str | None = attrs.field(default=None, repr=False)
    viewer_token_env: str | None = None
    max_viewers: int = 20
    update_interval_ms: int = 1000
    max_provider_rows: int = 200
    max_waiter_rows: int = 100

    def problems(self, admin_token: str | None, admin_token_env: str | None) -> Iterator[tuple[str, str]]:
        yield from _secret_problems(
            "ui.viewer_token", self.viewer_token, "ui.viewer_token_env", self.viewer_token_env, required=False
        )
        yield from _at_least("ui.max_viewers", self.max_viewers, 1)
        yield from _at_least("ui.update_interval_ms", self.update_interval_ms, 100)
        yield from _at_least("ui.max_provider_rows", self.max_provider_rows, 1)
        yield from _at_least("ui.max_waiter_rows", self.max_waiter_rows, 1)
        if self.enabled and not (self.viewer_token or self.viewer_token_env or admin_token or admin_token_env):
            yield "ui.enabled", "needs a token: set admin_token or ui.viewer_token"

    def accepts(self, token: str, admin_token: str | None) -> bool:
        """True if ``token`` is the viewer token or the admin token (constant time, both compared)."""
        given = token.encode()
        return any(
            [  # noqa: C419 -- compare against both, whichever matches
                bool(secret) and hmac.compare_digest(secret.encode(), given)
                for secret in (self.viewer_token, admin_token)
                if secret is not None
            ]
        )


TENANT_COSTS = ("requests", "tokens")
"""The values of ``tenant_cost``: what a grant charges its tenant ([tenant-edge])."""


@final
@attrs.frozen(kw_only=True)
class EdgeTenant:
    """One entry of ``tenants``: a tenant's share, band, quotas and API keys ([tenant-edge]).

    Its keys are given like the top-level ones: inline (``api_keys``, digested at
    once) or by the name of an environment variable holding a comma-separated
    list (``api_keys_env``). A request whose key is one of them is charged to it.
    """

    name: str
    weight: float = 1.0
    priority: int = 0
    max_in_flight: int | None = None
    max_queue: int | None = None
    api_keys: tuple[ApiKeyDigest, ...] | None = attrs.field(default=None, repr=False)
    api_keys_env: str | None = None

    def spec(self) -> TenantSpec:
        """The admission core's :class:`TenantSpec` of this entry."""
        return TenantSpec(
            self.name,
            weight=self.weight,
            priority=self.priority,
            max_in_flight=self.max_in_flight,
            max_queue=self.max_queue,
        )

    def key_digests(self, environ: Mapping[str, str]) -> tuple[ApiKeyDigest, ...]:
        """Its keys: the inline ones, or those of its environment variable in ``environ``."""
        if self.api_keys_env is not None:
            return tuple(ApiKeyDigest.of(key) for key in _split_keys(environ.get(self.api_keys_env, "")))
        return self.api_keys or ()

    def problems(self, where: str) -> Iterator[tuple[str, str]]:
        if not self.name:
            yield f"{where}.name", "must not be empty"
        if not self.weight > 0:
            yield f"{where}.weight", f"must be > 0, got {self.weight}"
        for key in ("max_in_flight", "max_queue"):
            value = getattr(self, key)
            if value is not None:
                yield from _at_least(f"{where}.{key}", value, 1)
        if self.api_keys is not None and self.api_keys_env is not None:
            yield f"{where}.api_keys_env", "give at most one of api_keys or api_keys_env"
        elif self.api_keys is not None and not self.api_keys:
            yield f"{where}.api_keys", "must list at least one key (leave the key out for a tenant without keys)"
        elif self.api_keys_env is not None:
            if not self.api_keys_env:
                yield f"{where}.api_keys_env", "must name an environment variable"
            elif not _split_keys(os.environ.get(self.api_keys_env, "")):
                yield (
                    f"{where}.api_keys_env",
                    f"environment variable {self.api_keys_env!r} is not set or holds no keys "
                    "(expected a comma-separated list)",
                )


def tenant_problems(tenants: tuple[EdgeTenant, ...], cost: str, header: str | None) -> Iterator[tuple[str, str]]:
    """The rules of ``tenants``, ``tenant_cost`` and ``tenant_header`` ([tenant-edge]); reads ``os.environ``."""
    if cost not in TENANT_COSTS:
        yield "tenant_cost", f"must be one of {', '.join(TENANT_COSTS)}"
    if header is not None and not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", header):
        yield "tenant_header", "must be an HTTP header name (or leave the key out: off)"
    first: dict[str, int] = {}
    owner: dict[str, int] = {}
    for i, tenant in enumerate(tenants):
        where = f"tenants[{i}]"
        yield from tenant.problems(where)
        if tenant.name in first:
            yield f"{where}.name", f"duplicate tenant {tenant.name!r} (first at tenants[{first[tenant.name]}])"
        first.setdefault(tenant.name, i)
        for digest in tenant.key_digests(os.environ):
            other = owner.setdefault(digest.hexdigest, i)
            if other != i:
                field = "api_keys_env" if tenant.api_keys_env is not None else "api_keys"
                yield f"{where}.{field}", f"a key of this tenant belongs to tenants[{other}] too"
                break


@final
@attrs.frozen
class _Lookups:
    """An :class:`EdgeConfig`'s tables by id ([reconnect-storm]: a registration and a request
    cost the same whatever the number of nodes and candidates). The first entry of an id wins,
    as a scan would find it."""

    nodes_by_id: dict[str, EdgeNode]
    provider_spans: dict[str, tuple[int, int]]
    """Node id -> ``(first, count)`` of its providers in the pool's order."""
    models_by_id: dict[str, EdgeModel]
    upstream_models: dict[tuple[str, ProviderKey], str]
    """``(model, provider)`` -> the model name sent upstream."""
    key_owners: dict[str, str | None]
    """API key digest -> the tenant it belongs to (None: a top-level key; a tenant's key wins over
    the same top-level one; a key in two tenants is a config error)."""

    @classmethod
    def of(cls, config: EdgeConfig) -> _Lookups:
        """The tables of ``config`` (calls :func:`~iop_edge._off_loop.yield_to_loop` as it goes)."""
        spans: dict[str, tuple[int, int]] = {}
        first = 0
        for node in paced(config.nodes):
            spans.setdefault(node.id, (first, len(node.providers)))
            first += len(node.providers)
        models_by_id = {model.id: model for model in reversed(config.models)}
        owners: dict[str, str | None] = {digest.hexdigest: None for digest in config.api_keys or ()}
        for digest, name in config._tenant_keys:
            if owners.get(digest.hexdigest) is None:
                owners[digest.hexdigest] = name
        return cls(
            key_owners=owners,
            nodes_by_id={node.id: node for node in paced(reversed(config.nodes))},
            provider_spans=spans,
            models_by_id=models_by_id,
            upstream_models={
                (model.id, c.key): c.upstream_model or model.id
                for model in reversed(models_by_id.values())
                for c in paced(reversed(model.candidates))
            },
        )


@final
@attrs.frozen(kw_only=True)
class EdgeConfig:
    """The whole ``edge.yaml``. See docs/edge-config.md for every key.

    Load it with :func:`load_edge_config`; it is valid by construction then.
    """

    nodes: tuple[EdgeNode, ...]
    models: tuple[EdgeModel, ...]
    listen: HostPort = _DEFAULT_LISTEN
    node_listen: HostPort = _DEFAULT_NODE_LISTEN
    heartbeat_timeout_ms: int = 15000
    provider_pool: ProviderPool = attrs.field(factory=ProviderPool)
    admin_token: str | None = attrs.field(default=None, repr=False)
    admin_token_env: str | None = None
    api_keys: tuple[ApiKeyDigest, ...] | None = attrs.field(default=None, repr=False)
    api_keys_env: str | None = None
    tenants: tuple[EdgeTenant, ...] = ()
    tenant_cost: str = "requests"
    tenant_header: str | None = None
    _tenant_keys: tuple[tuple[ApiKeyDigest, str], ...] = attrs.field(default=(), init=False, eq=False, repr=False)
    """Every tenant's key digests with its name, once resolved (:func:`load_edge_config`); not a key of the file."""
    max_body_bytes: int = 4 * 1024 * 1024
    max_ws_message_bytes: int = 8 * 1024 * 1024
    header_timeout_ms: int = 10000
    node_handshake_timeout_ms: int = 5000
    node_listen_backlog: int = 4096
    metrics_per_provider: bool = True
    metrics_per_node: bool = True
    node_max_pending: int = 256
    node_max_pending_per_address: int = 8
    node_reject_backoff_base_ms: int = 100
    node_reject_backoff_max_ms: int = 5000
    overload: OverloadConfig = attrs.field(factory=OverloadConfig)
    ui: UiConfig = attrs.field(factory=UiConfig)
    node_tls: NodeTls | None = None
    tls: ApiTls | None = None
    ha: HaConfig | None = None
    _pool: PoolConfig | None = attrs.field(default=None, init=False, eq=False, repr=False)
    """The pool, once built (:meth:`pool_config`); not a key of the file."""
    _lookups: _Lookups | None = attrs.field(default=None, init=False, eq=False, repr=False)
    """The lookup tables by id, once built (:meth:`build_lookups`); not a key of the file."""

    config_key_hints: ClassVar[Mapping[str, str]] = {
        "max_queue": "belongs under provider_pool (provider_pool: {max_queue: ...})",
        "queue_timeout_ms": "belongs under provider_pool (provider_pool: {queue_timeout_ms: ...})",
    }

    # -- what the Edge asks of its config -------------------------------------

    def pool_config(self) -> PoolConfig:
        """Map the file to the admission library's :class:`PoolConfig`.

        Built once per config: a config from :func:`load_edge_config` has the
        one its check built and validated ([reload-off-loop]: each provider's
        spec is built once per load, and a reload's ``prepare_refresh`` finds
        the pool already valid).
        """
        if self._pool is None:
            specs = {
                ProviderKey(node.id, provider.id): provider.spec()
                for node in paced(self.nodes)
                for provider in node.providers
            }
            object.__setattr__(self, "_pool", self._pool_of(specs))
        assert self._pool is not None
        return self._pool

    def _pool_of(self, specs: Mapping[ProviderKey, ProviderSpec]) -> PoolConfig:
        """The :class:`PoolConfig` of this file with the providers' ``specs`` (in file order)."""
        tenants: tuple[TenantSpec, ...] = tuple(tenant.spec() for tenant in self.tenants)
        return PoolConfig(
            policy=self.provider_pool.policy(),
            providers=specs,
            models={
                model.id: ModelGroup(candidates=tuple(c.key for c in paced(model.candidates))) for model in self.models
            },
            retry=self.provider_pool.retry.policy(),
            outlier=self.provider_pool.outlier.policy(),
            tenants=tenants,
        )

    def upstream_model(self, model: str, key: ProviderKey) -> str:
        """The model name to send upstream when ``model`` runs on ``key``.

        Raises:
            KeyError: ``key`` is not a candidate of ``model``.
        """
        try:
            return self._tables.upstream_models[model, key]
        except KeyError:
            raise KeyError(f"provider {key} is not a candidate of model {model!r}") from None

    def node_socket_limits(self, limits: PendingLimits | None = None) -> PendingLimits:
        """The node socket's pending caps and reject backoff from this file.

        Args:
            limits: limits to re-configure in place (a reload keeps their
                counts); None: make new ones.
        """
        if limits is None:
            limits = PendingLimits(max_pending=self.node_max_pending, max_pending_per_source=1)
        limits.set_policy(
            max_pending=self.node_max_pending,
            max_pending_per_source=self.node_max_pending_per_address,
            backoff_base=self.node_reject_backoff_base_ms / 1000,
            backoff_max=self.node_reject_backoff_max_ms / 1000,
        )
        return limits

    def candidates_of(self, model: str) -> tuple[ProviderKey, ...]:
        """The provider keys ``model`` lists, in order; empty for an unknown model."""
        entry = self._tables.models_by_id.get(model)
        return () if entry is None else tuple(c.key for c in entry.candidates)

    def node_token(self, node_id: str) -> str | None:
        """The token node ``node_id`` must register with; None if it is not configured."""
        node = self._tables.nodes_by_id.get(node_id)
        return None if node is None else node.token

    def long_threshold(self, model: str) -> int | None:
        """Tokens above which a request for ``model`` is long; None: never long (or unknown)."""
        entry = self._tables.models_by_id.get(model)
        return None if entry is None else entry.long_context_threshold_tokens

    def first_token_timeout(self, model: str) -> float | None:
        """Seconds a run of ``model`` may take to its first byte ([first-token-timeout]); None: no limit."""
        entry = self._tables.models_by_id.get(model)
        ms = None if entry is None else entry.first_token_timeout_ms
        return None if ms is None else ms / 1000

    def provider_span(self, node_id: str) -> tuple[int, int]:
        """Where node ``node_id``'s providers are in :meth:`pool_config`'s order: ``(first, count)``.

        A node's providers are consecutive there (file order, node by node);
        ``(0, 0)`` for a node that is not configured. [status-at-size]
        ``/status?node=`` reads only these rows.
        """
        return self._tables.provider_spans.get(node_id, (0, 0))

    def build_lookups(self) -> None:
        """Build the lookup tables by id now instead of at their first use.

        [reload-off-loop] A reload's reader builds them in its own process and
        they travel with the config (they are one of its fields), so the event
        loop never builds them (tens of milliseconds at 10,000 nodes).
        """
        assert self._tables is not None

    @property
    def _tables(self) -> _Lookups:
        lookups = self._lookups
        if lookups is None:
            lookups = _Lookups.of(self)
            object.__setattr__(self, "_lookups", lookups)
        return lookups

    @property
    def api_keys_required(self) -> bool:
        """True when the HTTP API demands one of the configured API keys (top-level or a tenant's)."""
        return bool(self.api_keys) or bool(self._tenant_keys)

    def accepts_api_key(self, key: str) -> bool:
        """True if ``key`` is one of the configured API keys.

        The presented key is hashed once and looked up by its SHA-256 digest: the cost does not
        grow with the number of keys, and the time taken depends on the digest only, never on how
        much of a configured key the presented one shares.
        """
        return ApiKeyDigest.of(key).hexdigest in self._tables.key_owners

    def tenant_of(self, key: str | None, named: str | None = None) -> str | None:
        """The tenant a request is charged to ([tenant-edge]): the one its API ``key`` belongs to
        (looked up by its digest, as :meth:`accepts_api_key` does), else None (the default tenant).

        ``named`` is the ``tenant_header``'s value, read only when the operator set that key (a
        trusted front proxy names the tenant); it wins over the key. The core maps a name that
        is not configured to the default tenant: request input never makes a tenant up.
        """
        if named is not None and self.tenant_header is not None and self.tenants:
            return named
        if key is None or not self._tenant_keys:
            return None
        return self._tables.key_owners.get(ApiKeyDigest.of(key).hexdigest)

    def accepts_admin_token(self, token: str) -> bool:
        """True if an admin token is configured and ``token`` equals it (constant time)."""
        if not self.admin_token:
            return False
        return hmac.compare_digest(self.admin_token.encode(), token.encode())

    # -- validation -------------------------------------------------------------

    def problems(self) -> Iterator[tuple[str, str]]:
        """Every cross-field problem as ``(path, message)``; reads ``os.environ``.

        Called by :func:`iop_config.load_config` on the file as written (before
        :func:`load_edge_config` resolves the environment).
        """
        specs: dict[ProviderKey, ProviderSpec] = {}
        found = [
            *_at_least("heartbeat_timeout_ms", self.heartbeat_timeout_ms, 100),
            *_at_least("provider_pool.max_queue", self.provider_pool.max_queue, 0),
            *_at_least("provider_pool.queue_timeout_ms", self.provider_pool.queue_timeout_ms, 1),
            *_at_least("provider_pool.retry.max_attempts", self.provider_pool.retry.max_attempts, 1),
            *self.provider_pool.outlier.problems(),
            *_at_least("max_body_bytes", self.max_body_bytes, 1),
            *_at_least("max_ws_message_bytes", self.max_ws_message_bytes, 1),
            *_at_least("node_listen_backlog", self.node_listen_backlog, 1),
            *_at_least("header_timeout_ms", self.header_timeout_ms, 1),
            *_at_least("node_handshake_timeout_ms", self.node_handshake_timeout_ms, 1),
            *_at_least("node_max_pending", self.node_max_pending, 1),
            *_at_least("node_max_pending_per_address", self.node_max_pending_per_address, 1),
            *_at_least("node_reject_backoff_base_ms", self.node_reject_backoff_base_ms, 0),
            *_at_least("node_reject_backoff_max_ms", self.node_reject_backoff_max_ms, self.node_reject_backoff_base_ms),
            *self.overload.problems(),
            *(self.ha.problems() if self.ha else ()),
            *self.ui.problems(self.admin_token, self.admin_token_env),
            *self._listen_problems(),
            *(tls_problems("node_tls", self.node_tls.ssl_context) if self.node_tls else ()),
            *(tls_problems("tls", self.tls.ssl_context) if self.tls else ()),
            *_secret_problems("admin_token", self.admin_token, "admin_token_env", self.admin_token_env, required=False),
            *self._api_key_problems(),
            *tenant_problems(self.tenants, self.tenant_cost, self.tenant_header),
            *self._node_problems(specs),
            *self._model_problems(),
        ]
        if not found:
            # Backstop: the library's own whole-pool check must agree.
            pool = self._pool_of(specs)
            try:
                validate_pool(pool, pause=yield_to_loop)
            except ConfigError as exc:
                found.extend(("", problem) for problem in exc.problems)
            else:
                object.__setattr__(self, "_pool", pool)
        return iter(found)

    def _listen_problems(self) -> Iterator[tuple[str, str]]:
        if self.listen == self.node_listen and self.listen.port != 0:
            yield "node_listen", f"must differ from listen ({self.listen})"

    def _api_key_problems(self) -> Iterator[tuple[str, str]]:
        if self.api_keys is not None and self.api_keys_env is not None:
            yield "api_keys_env", "give at most one of api_keys or api_keys_env"
        if self.api_keys is not None and not self.api_keys:
            yield "api_keys", "must list at least one key (leave the key out to disable API keys)"
        if self.api_keys_env is not None:
            if not self.api_keys_env:
                yield "api_keys_env", "must name an environment variable"
            elif not _split_keys(os.environ.get(self.api_keys_env, "")):
                yield (
                    "api_keys_env",
                    (
                        f"environment variable {self.api_keys_env!r} is not set or holds no keys "
                        "(expected a comma-separated list)"
                    ),
                )

    def _node_problems(self, specs: dict[ProviderKey, ProviderSpec]) -> Iterator[tuple[str, str]]:
        """The nodes' problems; each provider's spec that has none goes into ``specs``."""
        yield from _duplicates("nodes", "node id", [node.id for node in self.nodes])
        for i, node in enumerate(paced(self.nodes)):
            where = f"nodes[{i}]"
            yield from _secret_problems(
                f"{where}.token", node.token, f"{where}.token_env", node.token_env, required=True
            )
            yield from _duplicates(f"{where}.providers", "provider id", [provider.id for provider in node.providers])
            for j, provider in enumerate(node.providers):
                try:
                    specs[ProviderKey(node.id, provider.id)] = provider.spec()
                except ConfigError as exc:
                    yield from _spec_problems(f"{where}.providers[{j}]", exc)

    def _model_problems(self) -> Iterator[tuple[str, str]]:
        # reversed: with a duplicate node id (reported elsewhere) the first entry wins.
        providers = {node.id: {p.id for p in node.providers} for node in reversed(self.nodes)}
        yield from _duplicates("models", "model id", [model.id for model in self.models])
        for i, model in enumerate(self.models):
            where = f"models[{i}]"
            if model.long_context_threshold_tokens is not None:
                yield from _at_least(f"{where}.long_context_threshold_tokens", model.long_context_threshold_tokens, 1)
            if model.first_token_timeout_ms is not None:
                yield from _at_least(f"{where}.first_token_timeout_ms", model.first_token_timeout_ms, 1)
            if not model.candidates:
                yield f"{where}.candidates", "must list at least one provider"
            seen: dict[ProviderKey, int] = {}
            for j, candidate in enumerate(paced(model.candidates)):
                at = f"{where}.candidates[{j}]"
                if candidate.node not in providers:
                    yield f"{at}.node", f"node {candidate.node!r} is not configured under nodes"
                elif candidate.provider not in providers[candidate.node]:
                    yield f"{at}.provider", (f"node {candidate.node!r} has no provider {candidate.provider!r}")
                key = candidate.key
                first = seen.setdefault(key, j)
                if first != j:
                    yield at, f"{key} is listed twice (first at candidates[{first}])"
                if candidate.upstream_model == "":
                    yield f"{at}.upstream_model", "must not be empty (leave it out to use the model id)"


def _at_least(path: str, value: int, minimum: int) -> Iterator[tuple[str, str]]:
    if value < minimum:
        yield path, f"must be >= {minimum}, got {value}"


def _duplicates(path: str, what: str, ids: list[str]) -> Iterator[tuple[str, str]]:
    """Empty ids and repeated ids among ``ids`` (the ``id`` keys of the list at ``path``)."""
    first: dict[str, int] = {}
    for i, ident in enumerate(ids):
        if not ident:
            yield f"{path}[{i}].id", "must not be empty"
        elif ident in first:
            yield f"{path}[{i}].id", f"duplicate {what} {ident!r} (first at {path}[{first[ident]}])"
        else:
            first[ident] = i


def _secret_problems(
    path: str, value: str | None, env_path: str, env_name: str | None, *, required: bool
) -> Iterator[tuple[str, str]]:
    """A secret given inline (``value``) or by environment variable name (``env_name``)."""
    key, env_key = path.rpartition(".")[2], env_path.rpartition(".")[2]
    if value is not None and env_name is not None:
        yield env_path, f"give exactly one of {key} or {env_key}, not both"
    elif value is None and env_name is None:
        if required:
            yield path.rpartition(".")[0], f"required: one of {key} or {env_key}"
    elif value is not None and not value:
        yield path, "must not be empty"
    elif env_name is not None and not env_name:
        yield env_path, "must name an environment variable"
    elif env_name is not None and not os.environ.get(env_name):
        yield env_path, f"environment variable {env_name!r} is not set or empty"


def _spec_problems(where: str, error: ConfigError) -> Iterator[tuple[str, str]]:
    """The library's own ProviderSpec rules ([long-state], capacity) a provider broke (``error``,
    from building its spec), at that provider's keys."""
    for problem in error.problems:
        field, sep, message = problem.removeprefix("provider.").partition(": ")
        if sep and field.isidentifier():
            yield f"{where}.{field}", message
        else:
            yield where, problem


def _split_keys(text: str) -> list[str]:
    return [key.strip() for key in text.split(",") if key.strip()]


def _structure_host_port(value: object, _: type) -> HostPort:
    if not isinstance(value, str):
        raise ValueError("must be a 'host:port' string, e.g. '127.0.0.1:8080'")
    return parse_host_port(value)


def _structure_api_key(value: object, _: type) -> ApiKeyDigest:
    if not isinstance(value, str) or not value:
        raise ValueError("must be a non-empty string")
    return ApiKeyDigest.of(value)


def _edge_converter() -> cattrs.Converter:
    converter = make_converter()
    converter.register_structure_hook(HostPort, _structure_host_port)
    converter.register_structure_hook(ApiKeyDigest, _structure_api_key)
    # Before the hooks that structure it are made (they take the hook registered then):
    converter.register_structure_hook(EdgeProvider, _memoized_hook(converter.get_structure_hook(EdgeProvider)))
    for cls in (EdgeNode, EdgeCandidate):  # one of each per node in a large file
        converter.register_structure_hook(cls, _pausing_hook(converter.get_structure_hook(cls)))
    return converter


MEMO_SIZE = 16384
"""Distinct provider mappings :func:`_memoized_hook` remembers (the oldest is forgotten first)."""


def _memoized_hook(hook: Callable[[object, type[T]], T]) -> Callable[[object, type[T]], T]:
    """``hook`` for a flat mapping of scalars, structured once per distinct mapping.

    [reload-off-loop] A large fleet's nodes mostly list providers written
    alike (``{id: gpu0, capacity: 4, ...}`` on every node): each distinct one
    is structured once and its (frozen) result shared, in one load and from
    one load to the next. The memo is keyed by the mapping's keys, values and
    the values' types, in file order (``1``, ``1.0`` and ``true`` are equal in
    Python, not in a config file), so a hit is what ``hook`` would return;
    a mapping ``hook`` refuses is not remembered, and one holding a list or a
    mapping is structured as usual (never remembered). Thread-safe: two
    loads at once may both structure a mapping, never get a wrong result.
    """
    memo: dict[tuple[tuple[object, ...], tuple[type, ...]], T] = {}

    def memoized(value: object, cls: type[T]) -> T:
        if type(value) is not dict:
            return hook(value, cls)
        key = (tuple(value.items()), tuple(map(type, value.values())))
        try:
            return memo[key]
        except KeyError:
            pass
        except TypeError:  # unhashable: a list or a mapping where a scalar belongs
            return hook(value, cls)
        made = memo[key] = hook(value, cls)
        if len(memo) > MEMO_SIZE:
            memo.pop(next(iter(memo)), None)
        return made

    return memoized


def _pausing_hook(hook: Callable[[object, type[T]], T]) -> Callable[[object, type[T]], T]:
    """``hook``, calling :func:`yield_to_loop` first (structuring runs in a reload's worker thread)."""

    def pausing(value: object, cls: type[T]) -> T:
        yield_to_loop()
        return hook(value, cls)

    return pausing


_CONVERTER = _edge_converter()


def load_edge_config(path: str | os.PathLike[str], *, yields_gil: bool = False) -> EdgeConfig:
    """Load and validate ``edge.yaml``, resolving ``*_env`` secrets from ``os.environ``.

    ``yields_gil``: see :func:`iop_config.load_config` (for a load in a thread beside an event
    loop; the Edge's own reload reads the file in a child process and does not use it).

    Raises:
        iop_config.ConfigFileError: listing every problem as ``FILE:LINE: path: message``.
    """
    config = load_config(path, EdgeConfig, converter=_CONVERTER, yields_gil=yields_gil, pause=yield_to_loop)
    return _with_environment(config, os.environ)


def _with_environment(config: EdgeConfig, environ: Mapping[str, str]) -> EdgeConfig:
    """Replace each secret the file names by environment variable with its value."""
    nodes = tuple(
        attrs.evolve(node, token=environ.get(node.token_env, "")) if node.token_env is not None else node
        for node in config.nodes
    )
    admin_token = config.admin_token
    if config.admin_token_env is not None:
        admin_token = environ.get(config.admin_token_env, "")
    api_keys = config.api_keys
    if config.api_keys_env is not None:
        api_keys = tuple(ApiKeyDigest.of(key) for key in _split_keys(environ.get(config.api_keys_env, "")))
    ui = config.ui
    if ui.viewer_token_env is not None:
        ui = attrs.evolve(ui, viewer_token=environ.get(ui.viewer_token_env, ""))
    ha = config.ha
    if ha is not None and ha.password_env is not None:
        ha = attrs.evolve(ha, password=environ.get(ha.password_env, ""))
    tenant_keys = tuple((digest, tenant.name) for tenant in config.tenants for digest in tenant.key_digests(environ))
    resolved = attrs.evolve(config, nodes=nodes, admin_token=admin_token, api_keys=api_keys, ui=ui, ha=ha)
    object.__setattr__(resolved, "_tenant_keys", tenant_keys)
    object.__setattr__(resolved, "_pool", config._pool)  # no secret is in the pool: it is the same
    return resolved
