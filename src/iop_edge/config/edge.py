"""The whole Edge config: :class:`EdgeConfig`, its cross-field rules and its mapping to a PoolConfig.

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

import hmac
import os
import re
from collections.abc import Iterator, Mapping
from typing import ClassVar, TypeVar, final

import attrs

from iop_admission import (
    ConfigError,
    ModelGroup,
    PoolConfig,
    ProviderKey,
    ProviderSpec,
    TenantSpec,
    validate_pool,
)
from iop_config import tls_problems
from iop_edge._off_loop import paced, yield_to_loop
from iop_edge.config.models import EdgeModel
from iop_edge.config.schema import (
    DEFAULT_LISTEN,
    DEFAULT_NODE_LISTEN,
    TENANT_COSTS,
    ApiKeyDigest,
    ApiTls,
    EdgeNode,
    EdgeTenant,
    HaConfig,
    HostPort,
    NodeTls,
    OverloadConfig,
    ProviderPool,
    UiConfig,
    at_least,
    secret_problems,
    split_keys,
)
from iop_edge.config.secrets import presented_bytes
from iop_edge.nodes.limits import PendingLimits
from iop_http import MAX_CHUNK_EXTENSION_BYTES
from iop_wire import MAX_MESSAGE_BYTES, max_body_bytes_for

T = TypeVar("T")


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
    admits_by_tokens: bool
    """Some provider admits by a context-token budget ([token-ledger]): requests carry their tokens."""
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
            admits_by_tokens=any(p.admit_by != "slots" for node in config.nodes for p in node.providers),
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
    listen: HostPort = DEFAULT_LISTEN
    node_listen: HostPort = DEFAULT_NODE_LISTEN
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
    max_answer_bytes: int = 16 * 1024 * 1024
    answer_budget_bytes: int = 256 * 1024 * 1024
    header_timeout_ms: int = 10000
    max_chunk_extension_bytes: int = MAX_CHUNK_EXTENSION_BYTES
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

    def tokenizer(self, model: str) -> str | None:
        """The tokenizer file of ``model`` (``models[].tokenizer``); None: none named, or unknown key."""
        entry = self._tables.models_by_id.get(model)
        return None if entry is None else entry.tokenizer

    def model_entry(self, model: str) -> EdgeModel | None:
        """The ``models[]`` entry of key ``model`` (its deadline bounds, ...); None for an unknown key."""
        return self._tables.models_by_id.get(model)

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
        return ApiKeyDigest.of(key, presented=True).hexdigest in self._tables.key_owners

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
        return self._tables.key_owners.get(ApiKeyDigest.of(key, presented=True).hexdigest)

    def accepts_admin_token(self, token: str) -> bool:
        """True if an admin token is configured and ``token`` equals it (constant time)."""
        if not self.admin_token:
            return False
        return hmac.compare_digest(self.admin_token.encode(), presented_bytes(token))

    # -- validation -------------------------------------------------------------

    def problems(self) -> Iterator[tuple[str, str]]:
        """Every cross-field problem as ``(path, message)``; reads ``os.environ``.

        Called by :func:`iop_config.load_config` on the file as written (before
        :func:`load_edge_config` resolves the environment).
        """
        specs: dict[ProviderKey, ProviderSpec] = {}
        found = [
            *at_least("heartbeat_timeout_ms", self.heartbeat_timeout_ms, 100),
            *at_least("provider_pool.max_queue", self.provider_pool.max_queue, 0),
            *at_least("provider_pool.queue_timeout_ms", self.provider_pool.queue_timeout_ms, 1),
            *at_least("provider_pool.retry.max_attempts", self.provider_pool.retry.max_attempts, 1),
            *self.provider_pool.outlier.problems(),
            *at_least("max_body_bytes", self.max_body_bytes, 1),
            *_fits_a_run_frame(self.max_body_bytes),
            *at_least("max_ws_message_bytes", self.max_ws_message_bytes, 1),
            *at_least("max_answer_bytes", self.max_answer_bytes, 1),
            *_holds_an_answer(self.max_answer_bytes, self.answer_budget_bytes),
            *at_least("node_listen_backlog", self.node_listen_backlog, 1),
            *at_least("header_timeout_ms", self.header_timeout_ms, 1),
            *at_least("max_chunk_extension_bytes", self.max_chunk_extension_bytes, 0),
            *at_least("node_handshake_timeout_ms", self.node_handshake_timeout_ms, 1),
            *at_least("node_max_pending", self.node_max_pending, 1),
            *at_least("node_max_pending_per_address", self.node_max_pending_per_address, 1),
            *at_least("node_reject_backoff_base_ms", self.node_reject_backoff_base_ms, 0),
            *at_least("node_reject_backoff_max_ms", self.node_reject_backoff_max_ms, self.node_reject_backoff_base_ms),
            *self.overload.problems(),
            *(self.ha.problems() if self.ha else ()),
            *self.ui.problems(self.admin_token, self.admin_token_env),
            *self._listen_problems(),
            *(tls_problems("node_tls", self.node_tls.ssl_context) if self.node_tls else ()),
            *(tls_problems("tls", self.tls.ssl_context) if self.tls else ()),
            *secret_problems("admin_token", self.admin_token, "admin_token_env", self.admin_token_env, required=False),
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
            elif not split_keys(os.environ.get(self.api_keys_env, "")):
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
            yield from node.problems(where)
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
            yield from model.problems(where)
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


def admits_by_tokens(config: EdgeConfig) -> bool:
    """Whether some provider of ``config`` admits by a token budget: requests then carry their tokens."""
    return config._tables.admits_by_tokens


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


def _spec_problems(where: str, error: ConfigError) -> Iterator[tuple[str, str]]:
    """The library's own ProviderSpec rules ([long-state], capacity) a provider broke (``error``,
    from building its spec), at that provider's keys."""
    for problem in error.problems:
        field, sep, message = problem.removeprefix("provider.").partition(": ")
        if sep and field.isidentifier():
            yield f"{where}.{field}", message
        else:
            yield where, problem


def _fits_a_run_frame(max_body_bytes: int) -> Iterator[tuple[str, str]]:
    """A body of ``max_body_bytes`` must fit in one ``run`` frame a node accepts (docs/wire.md, Size limit)."""
    largest = max_body_bytes_for(MAX_MESSAGE_BYTES)
    if max_body_bytes > largest:
        yield (
            "max_body_bytes",
            f"must be <= {largest} (a node's message limit less a run's other fields), got {max_body_bytes}",
        )


def _holds_an_answer(max_answer_bytes: int, answer_budget_bytes: int) -> Iterator[tuple[str, str]]:
    """The budget of the answers held must take one answer of ``max_answer_bytes`` (docs/security.md)."""
    if answer_budget_bytes < max_answer_bytes:
        yield (
            "answer_budget_bytes",
            f"must be >= max_answer_bytes ({max_answer_bytes}: one answer must fit), got {answer_budget_bytes}",
        )
