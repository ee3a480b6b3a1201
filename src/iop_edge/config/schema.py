"""The parts of ``edge.yaml`` as frozen attrs values, one class per mapping of the file.

The key names are a contract (``docs/edge-config.md``). Each class checks its own fields
(``problems``); the rules across the whole file are :meth:`~iop_edge.config.EdgeConfig.problems`'.

Secrets: node tokens and the admin token are ``repr=False``. API keys never exist in the loaded
config in plain form: each is structured straight into an :class:`ApiKeyDigest` (SHA-256 hex)
and compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import ssl
from collections.abc import Iterator, Mapping
from typing import ClassVar, NamedTuple, TypeVar, final

import attrs

from iop_admission import (
    OutlierPolicy,
    ProviderSpec,
    QueuePolicy,
    RetryPolicy,
    TenantSpec,
)
from iop_config import server_ssl_context
from iop_edge.config.secrets import presented_bytes
from iop_edge.front_door.overload import OverloadPolicy
from iop_wire import MAX_NODE_ID_CHARS, valid_node_id

T = TypeVar("T")


def queue_hints(owner: str) -> Mapping[str, str]:
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
    def of(cls, key: str, *, presented: bool = False) -> ApiKeyDigest:
        """Digest a configured key (its UTF-8), or a ``presented`` one (the bytes sent: :func:`presented_bytes`)."""
        return cls(hashlib.sha256(presented_bytes(key) if presented else key.encode("utf-8")).hexdigest())


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
        yield from at_least(f"{where}.consecutive_failures", self.consecutive_failures, 0)
        yield from at_least(f"{where}.base_ejection_ms", self.base_ejection_ms, 1)
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
    admit_by: str = "slots"
    _spec: ProviderSpec | None = attrs.field(default=None, init=False, eq=False, repr=False)
    """The spec, once built (:meth:`spec`); not a key of the file."""

    config_key_hints: ClassVar[Mapping[str, str]] = queue_hints("a provider")

    def spec(self) -> ProviderSpec:
        """The library's spec, built once per provider object. Raises ``ConfigError`` on bad values.

        [reload-off-loop] A loaded file shares one provider object among the
        providers written alike (see :func:`_memoized_hook`), so a spec is
        built and checked once per distinct provider.
        """
        if self._spec is None:
            spec = ProviderSpec(**{f.name: getattr(self, f.name) for f in attrs.fields(ProviderSpec)})
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

    config_key_hints: ClassVar[Mapping[str, str]] = queue_hints("a node")

    def problems(self, where: str) -> Iterator[tuple[str, str]]:
        """The node's own problems: an id no node could register with, its token."""
        if not valid_node_id(self.id):
            yield f"{where}.id", f"must be at most {MAX_NODE_ID_CHARS} printable characters (a node could not register)"
        yield from secret_problems(f"{where}.token", self.token, f"{where}.token_env", self.token_env, required=True)


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


DEFAULT_LISTEN = HostPort("127.0.0.1", 8080)
DEFAULT_NODE_LISTEN = HostPort("127.0.0.1", 8081)


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
        yield from at_least("overload.shed_loop_lag_ms", self.shed_loop_lag_ms, 1)
        yield from at_least("overload.max_connections", self.max_connections, 1)
        yield from at_least("overload.shed_connections", self.shed_connections, 0)
        if self.shed_connections > self.max_connections:
            yield "overload.shed_connections", f"must be <= overload.max_connections ({self.max_connections})"
        yield from at_least("overload.max_retry_after_s", self.max_retry_after_s, 1)
        yield from at_least("overload.refusal_rate", self.refusal_rate, 1)


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
        yield from at_least("ha.ttl_s", self.ttl_s, 2)
        if self.step_down_margin_ms is not None and not 0 < self.step_down_margin_ms < self.ttl_s * 1000:
            yield "ha.step_down_margin_ms", f"must be > 0 and < ha.ttl_s ({self.ttl_s} s)"
        yield from at_least("ha.poll_interval_ms", self.poll_interval_ms, 10)
        if (self.cert_file is None) != (self.key_file is None):
            yield "ha.cert_file", "ha.cert_file and ha.key_file go together"
        if self.user is not None:
            if not self.user:
                yield "ha.user", "must not be empty"
            yield from secret_problems(
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
        yield from secret_problems(
            "ui.viewer_token", self.viewer_token, "ui.viewer_token_env", self.viewer_token_env, required=False
        )
        yield from at_least("ui.max_viewers", self.max_viewers, 1)
        yield from at_least("ui.update_interval_ms", self.update_interval_ms, 100)
        yield from at_least("ui.max_provider_rows", self.max_provider_rows, 1)
        yield from at_least("ui.max_waiter_rows", self.max_waiter_rows, 1)
        if self.enabled and not (self.viewer_token or self.viewer_token_env or admin_token or admin_token_env):
            yield "ui.enabled", "needs a token: set admin_token or ui.viewer_token"

    def accepts(self, token: str, admin_token: str | None) -> bool:
        """True if ``token`` is the viewer token or the admin token (constant time, both compared)."""
        given = presented_bytes(token)
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
            return tuple(ApiKeyDigest.of(key) for key in split_keys(environ.get(self.api_keys_env, "")))
        return self.api_keys or ()

    def problems(self, where: str) -> Iterator[tuple[str, str]]:
        if not self.name:
            yield f"{where}.name", "must not be empty"
        if not self.weight > 0:
            yield f"{where}.weight", f"must be > 0, got {self.weight}"
        for key in ("max_in_flight", "max_queue"):
            value = getattr(self, key)
            if value is not None:
                yield from at_least(f"{where}.{key}", value, 1)
        if self.api_keys is not None and self.api_keys_env is not None:
            yield f"{where}.api_keys_env", "give at most one of api_keys or api_keys_env"
        elif self.api_keys is not None and not self.api_keys:
            yield f"{where}.api_keys", "must list at least one key (leave the key out for a tenant without keys)"
        elif self.api_keys_env is not None:
            if not self.api_keys_env:
                yield f"{where}.api_keys_env", "must name an environment variable"
            elif not split_keys(os.environ.get(self.api_keys_env, "")):
                yield (
                    f"{where}.api_keys_env",
                    f"environment variable {self.api_keys_env!r} is not set or holds no keys "
                    "(expected a comma-separated list)",
                )


def split_keys(text: str) -> list[str]:
    return [key.strip() for key in text.split(",") if key.strip()]


def at_least(path: str, value: int, minimum: int) -> Iterator[tuple[str, str]]:
    if value < minimum:
        yield path, f"must be >= {minimum}, got {value}"


def secret_problems(
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
