"""``provider_health.engine`` (wire v7): what an engine itself says of its KV cache and queue (docs/wire.md)."""

from __future__ import annotations

from typing import Any, Final, final

import attrs

MAX_ENGINE_COUNT: Final = 2**53
"""The largest count an :class:`EngineView` carries (tokens, sequences, preemptions): an engine's
figure above it is not a figure (and no JSON reader past it keeps integers exact)."""


def _count(instance: object, attribute: attrs.Attribute[Any], value: int | None) -> None:
    """An attrs validator: None, or an integer in ``[0, MAX_ENGINE_COUNT]``."""
    if value is not None and not 0 <= value <= MAX_ENGINE_COUNT:
        raise ValueError(f"{attribute.name} must be in [0, {MAX_ENGINE_COUNT}]; got {value!r}")


def _fraction(instance: object, attribute: attrs.Attribute[Any], value: float | None) -> None:
    """An attrs validator: None, or a number in ``[0, 1]`` (NaN and infinities are not)."""
    if value is not None and not 0.0 <= value <= 1.0:
        raise ValueError(f"{attribute.name} must be a number in [0, 1]; got {value!r}")


@final
@attrs.frozen
class EngineView:
    """``provider_health.engine`` (v7): what the engine itself says of its KV cache and queue, each
    field None when the engine does not say it (docs/wire.md; docs/node.md, Health).

    ``kv_use``: the cache in use, 0 to 1 (vLLM's ``kv_cache_usage_perc``; llama.cpp's
    ``kv_tokens / kv_capacity``). ``kv_tokens`` and ``kv_capacity``: the tokens the cache holds
    and can hold (llama.cpp's ``/slots``: the running slots' prompt and generated tokens, every
    slot's ``n_ctx``). ``preemptions``: sequences the engine preempted since it started (vLLM's
    ``num_preemptions_total``). ``running`` and ``waiting``: its requests running and queued.
    """

    kv_use: float | None = attrs.field(default=None, validator=_fraction)
    kv_tokens: int | None = attrs.field(default=None, validator=_count)
    kv_capacity: int | None = attrs.field(default=None, validator=_count)
    preemptions: int | None = attrs.field(default=None, validator=_count)
    running: int | None = attrs.field(default=None, validator=_count)
    waiting: int | None = attrs.field(default=None, validator=_count)
