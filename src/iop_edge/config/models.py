"""``models[]`` of ``edge.yaml``: a model key, its candidates and the bounds of its requests' deadlines.

A request's deadline ([deadline], ``docs/openai-api.md``) is what its client asked for
(``X-Request-Timeout``, or the ``openai`` client's read timeout), else the model's
``default_deadline_ms`` (none by default: the request is bounded by the queue's timeout and
the Node's upstream timeouts only, as before deadlines existed), never more than
``max_deadline_ms``. ``min_attempt_ms`` is the least time left for which a failed attempt is
tried again on another candidate.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import ClassVar, final

import attrs

from iop_admission import ProviderKey
from iop_edge.config.schema import at_least, queue_hints
from iop_edge.token_count import TokenizerError, load_tokenizer

DEFAULT_MAX_DEADLINE_MS = 3_600_000
"""``max_deadline_ms`` when not set: a client may ask for an hour at most."""
DEFAULT_MIN_ATTEMPT_MS = 1_000
"""``min_attempt_ms`` when not set: a retry needs a second left for its first token."""


@final
@attrs.frozen(kw_only=True)
class EdgeCandidate:
    """``models[].candidates[]``: one provider that may serve the model."""

    node: str
    provider: str
    upstream_model: str | None = None

    config_key_hints: ClassVar[Mapping[str, str]] = queue_hints("a candidate")

    @property
    def key(self) -> ProviderKey:
        """The provider's identity."""
        return ProviderKey(self.node, self.provider)


@final
@attrs.frozen(kw_only=True)
class EdgeModel:
    """``models[]``: an external model key and its candidates, in preference order.

    Attributes:
        default_deadline_ms: a request's deadline when its client gives none (None: no deadline).
        max_deadline_ms: the longest deadline a request gets, whatever its client asked for.
        min_attempt_ms: a failed attempt is retried only while at least this much of the
            request's deadline is left.
        tokenizer: the model's tokenizer file (a ``tokenizer.json`` or a ``.gguf``): a token
            budget's reservations count prompts with it ([token-ledger]); None: their UTF-8 bound.
    """

    id: str
    candidates: tuple[EdgeCandidate, ...]
    long_context_threshold_tokens: int | None = None
    first_token_timeout_ms: int | None = None
    default_deadline_ms: int | None = None
    max_deadline_ms: int = DEFAULT_MAX_DEADLINE_MS
    min_attempt_ms: int = DEFAULT_MIN_ATTEMPT_MS
    tokenizer: str | None = None

    config_key_hints: ClassVar[Mapping[str, str]] = queue_hints("a model")

    def problems(self, where: str) -> Iterator[tuple[str, str]]:
        """The problems of the model's own keys (its candidates are checked against the nodes elsewhere)."""
        if self.long_context_threshold_tokens is not None:
            yield from at_least(f"{where}.long_context_threshold_tokens", self.long_context_threshold_tokens, 1)
        if self.first_token_timeout_ms is not None:
            yield from at_least(f"{where}.first_token_timeout_ms", self.first_token_timeout_ms, 1)
        yield from at_least(f"{where}.max_deadline_ms", self.max_deadline_ms, 1)
        yield from at_least(f"{where}.min_attempt_ms", self.min_attempt_ms, 0)
        default = self.default_deadline_ms
        if default is not None:
            yield from at_least(f"{where}.default_deadline_ms", default, 1)
            if default > self.max_deadline_ms:
                yield f"{where}.default_deadline_ms", f"must be at most max_deadline_ms ({self.max_deadline_ms})"
        if self.tokenizer is not None:
            try:
                load_tokenizer(self.tokenizer)  # read once here, then kept (the Edge counts with it)
            except TokenizerError as exc:
                yield f"{where}.tokenizer", str(exc)

    def deadline_seconds(self, asked: float | None) -> float | None:
        """A request's deadline in seconds from now: ``asked`` (its client's), else the default,
        never more than ``max_deadline_ms``; None: the request has no deadline."""
        if asked is None:
            return None if self.default_deadline_ms is None else self.default_deadline_ms / 1000
        return min(asked, self.max_deadline_ms / 1000)
