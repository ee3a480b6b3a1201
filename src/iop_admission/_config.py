"""Configuration values of an admission pool.

These are frozen attrs values. A :class:`ProviderSpec` or :class:`QueuePolicy`
checks its own fields when constructed; cross-references (candidates that name
a provider) are checked by :func:`validate_pool`, which :class:`Admission` and
:meth:`Admission.refresh` call before anything changes. Every check reports all
problems at once through :class:`ConfigError`.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar, final

import attrs

from ._errors import ConfigError
from ._fairness import TenantSpec


@final
@attrs.frozen(order=True)
class ProviderKey:
    """Identity of one backend resource: ``(node_id, provider_id)``."""

    node_id: str
    provider_id: str

    def __str__(self) -> str:
        return f"{self.node_id}/{self.provider_id}"


HEALTH_STATES = ("ready", "not_ready", "stalled")
"""The states of a :class:`ProviderReport`."""


@final
@attrs.frozen
class ProviderReport:
    """What the provider's own watch found ([health-probe]): a node's ``provider_health`` report.

    Attributes:
        state: ``ready``; ``not_ready`` (its readiness probe fails: down, a model
            loading); ``stalled`` (its runs went without a byte: a hung engine).
        reason: why, for operators (shown in the snapshot).
        capacity: the backend's own parallelism when below the configured capacity:
            the provider's capacity is lowered to it (never raised); None: the configured one.
        generation: the node generation the report came in; a report of an older one
            changes nothing. None: the current one.
        kv_use: the engine's own KV-cache use, 0 to 1 (vLLM's ``kv_cache_usage_perc``,
            llama.cpp's slots' tokens over their ``n_ctx``); None: the engine does not say.
        preemptions: the engine's count of preempted sequences since it started (vLLM's
            ``num_preemptions_total``); None: the engine does not say.

    With a token budget, a ``ready`` report's ``kv_use`` and ``preemptions`` may lower the
    provider's effective budget, never above the config's ([token-ledger], docs/admission.md,
    The engine's view): :func:`~iop_admission.core.engine_cut`.
    """

    state: str = attrs.field(validator=attrs.validators.in_(HEALTH_STATES))
    reason: str = ""
    capacity: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.ge(1)))
    generation: int | None = None
    kv_use: float | None = attrs.field(
        default=None, validator=attrs.validators.optional([attrs.validators.ge(0.0), attrs.validators.le(1.0)])
    )
    preemptions: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.ge(0)))


@final
@attrs.frozen
class ProviderSpec:
    """Per-provider execution properties (never queue settings: see QueuePolicy).

    Attributes:
        capacity: max concurrent leases on the provider, all model groups together.
        long_context_capacity: max concurrent *long* leases; each also holds one
            capacity unit. 0 means the provider never runs long requests.
        context_window_tokens: context window of one long slot, and of one
            request: a token reservation is bounded by it (0: unbounded).
        total_context_tokens: with ``admit_by="slots"``, a static check only:
            when given it must equal ``context_window_tokens * long_context_capacity``;
            with ``"tokens"`` or ``"both"``, the provider's context-token budget
            ([token-ledger]): the reservations of its running requests never exceed it.
        priority: higher wins among dispatchable candidates.
        enabled: a disabled provider is not eligible; running leases continue.
        admit_by: what bounds the provider's context memory: ``"slots"`` (long
            slots, as before the ledger), ``"tokens"`` (the token budget alone;
            long requests need no slot, ``long_context_capacity`` must be 0) or
            ``"both"`` (a long request needs a long slot and its tokens).
    """

    capacity: int
    long_context_capacity: int = 0
    context_window_tokens: int = 0
    total_context_tokens: int | None = None
    priority: int = 0
    enabled: bool = True
    admit_by: str = "slots"

    @property
    def budget(self) -> int | None:
        """The context-token budget the ledger admits by, or None (``admit_by="slots"``)."""
        return None if self.admit_by == "slots" else self.total_context_tokens

    @property
    def runs_long(self) -> bool:
        """Whether the provider can ever run a long request (a long slot, or a token budget alone)."""
        return self.long_context_capacity >= 1 or self.admit_by == "tokens"

    def __attrs_post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ConfigError(problems)

    def problems(self, where: str = "provider") -> list[str]:
        """Return every problem of this spec, each prefixed with ``where``."""
        out: list[str] = []
        for name in ("capacity", "long_context_capacity", "context_window_tokens", "priority"):
            value = getattr(self, name)
            if not _is_int(value):
                out.append(f"{where}.{name}: must be an integer, got {value!r}")
        if self.total_context_tokens is not None and not _is_int(self.total_context_tokens):
            out.append(f"{where}.total_context_tokens: must be an integer, got {self.total_context_tokens!r}")
        if not isinstance(self.enabled, bool):
            out.append(f"{where}.enabled: must be true or false, got {self.enabled!r}")
        if out:
            return out
        if self.capacity < 1:
            out.append(f"{where}.capacity: must be >= 1, got {self.capacity}")
        if self.long_context_capacity < 0:
            out.append(f"{where}.long_context_capacity: must be >= 0, got {self.long_context_capacity}")
        if self.long_context_capacity > max(self.capacity, 0):  # a bad capacity alone is one problem
            out.append(
                f"{where}.long_context_capacity: must be <= capacity ({self.long_context_capacity} > {self.capacity})"
            )
        if self.context_window_tokens < 0:
            out.append(f"{where}.context_window_tokens: must be >= 0, got {self.context_window_tokens}")
        if self.admit_by not in ADMIT_BY:
            out.append(f"{where}.admit_by: must be one of slots, tokens, both, got {self.admit_by!r}")
        elif self.admit_by != "slots":
            out.extend(self._budget_problems(where))
        elif self.total_context_tokens is not None:
            expected = self.context_window_tokens * self.long_context_capacity
            if self.total_context_tokens != expected:
                out.append(
                    f"{where}.total_context_tokens: must equal context_window_tokens * "
                    f"long_context_capacity = {self.context_window_tokens} * "
                    f"{self.long_context_capacity} = {expected}, got {self.total_context_tokens}"
                )
        return out

    def _budget_problems(self, where: str) -> list[str]:
        out = []
        if self.total_context_tokens is None or self.total_context_tokens < 1:
            out.append(
                f"{where}.total_context_tokens: admit_by {self.admit_by} needs a budget >= 1, "
                f"got {self.total_context_tokens}"
            )
        if self.admit_by == "tokens" and self.long_context_capacity:
            out.append(
                f"{where}.long_context_capacity: must be 0 with admit_by tokens (long requests run by "
                f"their tokens), got {self.long_context_capacity}"
            )
        if self.admit_by == "both" and not self.long_context_capacity:
            out.append(f"{where}.long_context_capacity: admit_by both needs long slots >= 1, got 0")
        return out


ADMIT_BY = ("slots", "tokens", "both")
"""What may bound a provider's context memory (:attr:`ProviderSpec.admit_by`)."""


@final
@attrs.frozen
class QueuePolicy:
    """The one Edge-wide queue policy, shared by every waiter of every model group.

    Attributes:
        max_queue: max waiters at once; 0 means never queue.
        queue_timeout: seconds a waiter may wait, counted from its enqueue time.
    """

    max_queue: int = 64
    queue_timeout: float = 30.0

    def __attrs_post_init__(self) -> None:
        out: list[str] = []
        if not _is_int(self.max_queue) or self.max_queue < 0:
            out.append(f"policy.max_queue: must be an integer >= 0, got {self.max_queue!r}")
        if not _is_seconds(self.queue_timeout):
            out.append(f"policy.queue_timeout: must be a finite number of seconds > 0, got {self.queue_timeout!r}")
        if out:
            raise ConfigError(out)


@final
@attrs.frozen
class RetryPolicy:
    """Failover before the first byte: how many attempts one request may make in all.

    Attributes:
        max_attempts: attempts per request, the first one included; 1 means never retry.
    """

    max_attempts: int = 2

    def __attrs_post_init__(self) -> None:
        if not _is_int(self.max_attempts) or self.max_attempts < 1:
            raise ConfigError([f"retry.max_attempts: must be an integer >= 1, got {self.max_attempts!r}"])


@final
@attrs.frozen
class OutlierPolicy:
    """Passive health: when a provider is ejected, and for how long (seconds).

    Attributes:
        consecutive_failures: provider failures in a row that eject a provider;
            0 turns ejection off.
        base_ejection: the first ejection's length.
        max_ejection: the cap; each ejection in a row doubles the length up to it.
    """

    consecutive_failures: int = 3
    base_ejection: float = 5.0
    max_ejection: float = 300.0

    def __attrs_post_init__(self) -> None:
        out: list[str] = []
        if not _is_int(self.consecutive_failures) or self.consecutive_failures < 0:
            out.append(f"outlier.consecutive_failures: must be an integer >= 0, got {self.consecutive_failures!r}")
        for name in ("base_ejection", "max_ejection"):
            value = getattr(self, name)
            if not _is_seconds(value):
                out.append(f"outlier.{name}: must be a finite number of seconds > 0, got {value!r}")
        if not out and self.max_ejection < self.base_ejection:
            out.append(
                f"outlier.max_ejection: must be >= base_ejection ({self.max_ejection!r} < {self.base_ejection!r})"
            )
        if out:
            raise ConfigError(out)

    def ejection_time(self, streak: int) -> float:
        """Length of the ``streak``-th ejection in a row (1-based): base doubled, capped."""
        return min(self.base_ejection * 2.0 ** min(streak - 1, 64), self.max_ejection)


def _candidates(value: Iterable[ProviderKey]) -> tuple[ProviderKey, ...]:
    if isinstance(value, str | bytes):
        raise TypeError(
            f"ModelGroup candidates must be an iterable of ProviderKey, not a string ({value!r}): "
            f"write ModelGroup([ProviderKey(node_id, provider_id)])"
        )
    candidates = tuple(value)
    for c in candidates:
        if type(c) is not ProviderKey:
            raise TypeError(f"ModelGroup candidate {c!r} is a {type(c).__name__}, not a ProviderKey")
    return candidates


@final
@attrs.frozen
class ModelGroup:
    """An external model key's candidate providers, in preference order."""

    candidates: tuple[ProviderKey, ...] = attrs.field(converter=_candidates)


def _frozen_mapping(value: Mapping[Any, Any]) -> Mapping[Any, Any]:
    return types.MappingProxyType(dict(value))


def _tenant_specs(specs: Iterable[TenantSpec]) -> tuple[TenantSpec, ...]:
    """``PoolConfig.tenants`` as a tuple (a typed converter: ``tuple`` leaves its item type open)."""
    return tuple(specs)


@final
@attrs.frozen
class PoolConfig:
    """Everything an :class:`Admission` needs: queue, retry and outlier policies, providers, model groups.

    ``providers`` and ``models`` are copied into read-only mappings; their order
    is the order the snapshot reports.
    """

    policy: QueuePolicy = attrs.field(factory=QueuePolicy)
    providers: Mapping[ProviderKey, ProviderSpec] = attrs.field(
        factory=dict, converter=_frozen_mapping, eq=attrs.cmp_using(eq=lambda a, b: dict(a) == dict(b))
    )
    models: Mapping[str, ModelGroup] = attrs.field(
        factory=dict, converter=_frozen_mapping, eq=attrs.cmp_using(eq=lambda a, b: dict(a) == dict(b))
    )
    retry: RetryPolicy = attrs.field(factory=RetryPolicy)
    outlier: OutlierPolicy = attrs.field(factory=OutlierPolicy)
    tenants: tuple[TenantSpec, ...] = attrs.field(default=(), converter=_tenant_specs)
    """Configured tenants ([tenant-fair-share]); none: one global FIFO, exactly as before tenants."""


# The last PoolConfig found valid. It is frozen, so it stays valid: validating it
# again (a config checked in a worker thread, then applied on the event loop) is free.
_last_valid: list[PoolConfig] = []


def validate_pool(config: object, *, pause: Callable[[], None] | None = None) -> None:
    """Check a whole :class:`PoolConfig`; raise :class:`ConfigError` listing every problem.

    ``pause``: called every 64 providers and candidates (a worker
    thread's chance to let an event loop in another thread run).
    """
    if not isinstance(config, PoolConfig):
        raise TypeError(f"expected PoolConfig, got {type(config).__name__}")
    if _last_valid and _last_valid[0] is config:
        return
    problems: list[str] = []
    if not isinstance(config.policy, QueuePolicy):
        problems.append(f"policy: expected QueuePolicy, got {type(config.policy).__name__}")
    if not isinstance(config.retry, RetryPolicy):
        problems.append(f"retry: expected RetryPolicy, got {type(config.retry).__name__}")
    if not isinstance(config.outlier, OutlierPolicy):
        problems.append(f"outlier: expected OutlierPolicy, got {type(config.outlier).__name__}")
    clean: set[int] = set()  # ids of specs found sound: one shared by many providers is checked once
    for key, spec in paced(config.providers.items(), pause):
        if not isinstance(key, ProviderKey):
            problems.append(f"providers: key {key!r} is not a ProviderKey")
            continue
        if not isinstance(spec, ProviderSpec):
            problems.append(f"providers[{key}]: expected ProviderSpec, got {type(spec).__name__}")
            continue
        # Specs validate themselves on construction; re-check in case of evolve() tricks.
        if id(spec) in clean:
            continue
        found = spec.problems(f"providers[{key}]")
        if found:
            problems.extend(found)
        else:
            clean.add(id(spec))
    for name, group in config.models.items():
        if not isinstance(name, str) or not name:
            problems.append(f"models: key {name!r} must be a non-empty string")
            continue
        if not isinstance(group, ModelGroup):
            problems.append(f"models[{name!r}]: expected ModelGroup, got {type(group).__name__}")
            continue
        if not group.candidates:
            problems.append(f"models[{name!r}].candidates: must list at least one provider")
        seen: set[ProviderKey] = set()
        for i, key in enumerate(paced(group.candidates, pause)):
            if key in seen:
                problems.append(f"models[{name!r}].candidates[{i}]: {key} is listed twice")
            seen.add(key)
            if key not in config.providers:
                problems.append(f"models[{name!r}].candidates[{i}]: provider {key} is not configured")
    problems.extend(_tenant_problems(config.tenants))
    if problems:
        raise ConfigError(problems)
    _last_valid[:] = [config]


def _tenant_problems(tenants: tuple[object, ...]) -> list[str]:
    problems = []
    names: set[str] = set()
    for i, spec in enumerate(tenants):
        if not isinstance(spec, TenantSpec):
            problems.append(f"tenants[{i}]: expected TenantSpec, got {type(spec).__name__}")
        elif spec.name in names:
            problems.append(f"tenants[{i}]: tenant {spec.name!r} is listed twice")
        else:
            names.add(spec.name)
    return problems


T = TypeVar("T")

PAUSE_EVERY = 64
"""Items between two calls of a ``pause`` callback (:func:`paced`)."""


def paced(items: Iterable[T], pause: Callable[[], None] | None) -> Iterable[T]:
    """``items``, calling ``pause`` before every :data:`PAUSE_EVERY`-th (``items`` itself if None)."""
    if pause is None:
        return items
    return (item for i, item in enumerate(items) if i % PAUSE_EVERY or pause() is None)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_seconds(value: object) -> bool:
    """A finite number of seconds > 0 (bools are not numbers here)."""
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value) and value > 0
