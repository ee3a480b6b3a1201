"""The JSON messages of the Edge–Node wire protocol, v6 and v7 (contract: ``docs/wire.md``).

Every message is a frozen attrs value. Field types are checked by the codec when
a frame is decoded; the rules that involve values (allowed statuses, endpoints and
codes, "code required iff status != ok") are attrs validators, so they hold both
for decoded messages and for messages built in Python: an invalid message cannot
be constructed, hence never encoded.

Base64 payloads (``TunnelChunk.data``, ``TunnelRequest.body``) are *not* checked
when decoding, to keep the per-chunk cost low; :meth:`TunnelChunk.payload` and
:meth:`TunnelRequest.body_bytes` check them when the bytes are needed.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Final, Literal, Union, final, get_args

import attrs

from ._engine import EngineView
from ._errors import ProtocolError

MAX_MESSAGE_BYTES: Final = 8 * 1024 * 1024
"""Default limit for one text frame, in UTF-8 bytes."""

MAX_NODE_ID_CHARS: Final = 128
"""The longest ``register.node_id`` (docs/wire.md); the Edge's config refuses a longer node id too."""


def valid_node_id(node_id: str) -> bool:
    """Whether ``node_id`` may name a node: at most :data:`MAX_NODE_ID_CHARS` characters, each printable."""
    return len(node_id) <= MAX_NODE_ID_CHARS and node_id.isprintable()


RUN_ENVELOPE_BYTES: Final = 64 * 1024
"""Room a ``run`` frame keeps for its fields other than the client's body (ids, the upstream
model, the epoch): a body of at most ``MAX_MESSAGE_BYTES - RUN_ENVELOPE_BYTES`` bytes always fits
in a v5 frame (:func:`max_body_bytes_for`)."""


def max_body_bytes_for(max_message_bytes: int = MAX_MESSAGE_BYTES) -> int:
    """The largest client body a v5 ``run`` frame of at most ``max_message_bytes`` carries."""
    return max_message_bytes - RUN_ENVELOPE_BYTES


ERROR_CODES: Final = (
    "concurrency_limit",
    "upstream_error",
    "upstream_unreachable",
    "bad_request",
    "cancelled",
    "stale_epoch",
    "upstream_too_large",
    "deadline_exceeded",
    "stream_stalled",
)
"""The codes a ``run_end`` / ``tunnel_end`` with ``status != "ok"`` carries; ``deadline_exceeded`` and
``stream_stalled`` (v6) only to a peer of v6 (a v5 peer gets :func:`~iop_wire.end_code_for`'s)."""

FailureKind = Literal[
    "client_error",
    "rate_limited",
    "provider_error",
    "unreachable",
    "node_busy",
    "node_refused",
    "cancelled",
    "stale_leader",
    "deadline",
]
"""Whose failure a ``run_end`` with ``status != "ok"`` is, derived by :func:`failure_kind`.

- ``client_error``: the backend refused the request itself (a 4xx other than 401,
  403, 407, 408 and 429): the client's mistake, the same on any provider. Never
  retried, never counted against the provider's health; the Edge answers with the
  backend's status and error body.
- ``rate_limited``: the backend answered 429. Not a health failure; the Edge
  answers 429 with ``Retry-After``.
- ``provider_error``: the backend failed: a 5xx, a 401/403/407/408 (the node's
  credentials or the backend's own deadline, nothing the client can fix), an
  unreadable answer, an answer past the node's bounds (``upstream_too_large``),
  or an error in the middle of a stream.
- ``unreachable``: the backend could not be reached, timed out, or dropped the connection.
- ``node_busy``: the node's local gate was full; nothing was sent upstream.
- ``node_refused``: the node cannot serve this run (unknown provider, endpoint the
  adapter does not serve): a mismatch between Edge and Node configs.
- ``cancelled``: the run was cancelled.
- ``stale_leader``: the run carried an older leader's epoch than the node has
  seen (``stale_epoch``): the Edge that sent it no longer leads.
- ``deadline``: the run's deadline (v6 ``run.deadline_ms``) passed first
  (``deadline_exceeded``): the client's budget, not the provider's failure.

A stalled stream (``stream_stalled``, v6: the backend sent part of its answer, then nothing
for the provider's read timeout) is a ``provider_error``.
"""

FAILURE_KINDS: Final[tuple[FailureKind, ...]] = get_args(FailureKind)
"""Every :data:`FailureKind`, in documentation order."""

PROVIDER_FAILURES: Final[frozenset[FailureKind]] = frozenset({"provider_error", "unreachable"})
"""The failure kinds that are the provider's fault (health, failover); the others are not."""

PROVIDER_STATUSES_4XX: Final = frozenset({401, 403, 407, 408})
"""Backend 4xx statuses that are the provider's failure, not the client's (see :data:`FailureKind`)."""

UPSTREAM_BODY_LIMIT: Final = 64 * 1024
"""The most characters of a backend's error body a node puts into ``run_end.upstream_body``."""

END_MESSAGE_LIMIT: Final = 1024
"""Characters of a ``run_end`` / ``tunnel_end`` ``message`` a node sends at most (it cuts a longer
one): an error message may quote what a client sent (a 4 MB array), and an end frame over the
Edge's message limit would cut every run on the connection."""


def failure_kind(code: str | None, upstream_status: int | None) -> FailureKind:
    """Classify a failed run from its wire ``code`` and the backend's HTTP status.

    Args:
        code: the ``run_end`` error code (one of :data:`ERROR_CODES`).
        upstream_status: the backend's HTTP status, when it answered with one.

    Returns:
        The :data:`FailureKind`; an unknown code counts as ``provider_error``.
    """
    if code == "upstream_error" and upstream_status is not None:
        if upstream_status == 429:
            return "rate_limited"
        if 400 <= upstream_status < 500 and upstream_status not in PROVIDER_STATUSES_4XX:
            return "client_error"
        return "provider_error"
    return _KIND_OF_CODE.get(code, "provider_error")


_KIND_OF_CODE: Final[dict[str | None, FailureKind]] = {
    "cancelled": "cancelled",
    "concurrency_limit": "node_busy",
    "bad_request": "node_refused",
    "upstream_unreachable": "unreachable",
    "stale_epoch": "stale_leader",
    "deadline_exceeded": "deadline",
    "stream_stalled": "provider_error",
}


REJECT_CODES: Final = ("bad_token", "protocol_mismatch", "unknown_node", "duplicate", "bad_message")
"""The codes of a ``rejected`` answer to ``register``."""

HEALTH_STATES: Final = ("ready", "not_ready", "stalled")
"""The states of a ``provider_health`` report."""

END_STATUSES: Final = ("ok", "error", "cancelled")
"""The statuses of ``run_end`` and ``tunnel_end``."""

ENDPOINTS: Final = ("chat/completions", "completions", "embeddings")
"""The OpenAI endpoints a ``run`` can target."""


def _one_of(allowed: tuple[str, ...]) -> Any:
    """An attrs validator: the value is one of ``allowed``."""

    def validate(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
        if value not in allowed:
            raise ValueError(f"{attribute.name} must be one of {', '.join(allowed)}; got {value!r}")

    return validate


def _validate_end_code(instance: RunEnd | TunnelEnd, attribute: attrs.Attribute[Any], code: str | None) -> None:
    """The ``code`` of a ``run_end`` / ``tunnel_end``: required iff ``status != "ok"``."""
    status = instance.status
    if status == "ok":
        if code is not None:
            raise ValueError(f"code must be omitted when status is 'ok'; got {code!r}")
    elif code is None:
        raise ValueError(f"code is required when status is {status!r}")
    elif code not in ERROR_CODES:
        raise ValueError(f"code must be one of {', '.join(ERROR_CODES)}; got {code!r}")
    elif status == "cancelled" and code != "cancelled":
        raise ValueError(f"code must be 'cancelled' when status is 'cancelled'; got {code!r}")


def _encode_base64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _decode_base64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        # ValueError: non-ASCII characters in ``text``.
        raise ProtocolError(f"{what} is not valid base64: {exc}") from None


# --------------------------------------------------------------------------- Node -> Edge


@final
@attrs.frozen
class ProviderInfo:
    """One provider a node offers, as announced in :class:`Register` (untagged)."""

    id: str
    adapter: str
    capacity: int


@final
@attrs.frozen
class Register:
    """``register``: the node's first message on every connection.

    ``token`` never appears in ``repr()``.
    """

    node_id: str
    token: str = attrs.field(repr=False)
    protocol: int
    providers: tuple[ProviderInfo, ...]


@final
@attrs.frozen
class Heartbeat:
    """``heartbeat``: sent by the node every heartbeat interval after ``registered``."""

    seq: int


@final
@attrs.frozen
class RunEnd:
    """``run_end``: the last message of a run.

    ``status`` is ``"ok"``, ``"error"`` or ``"cancelled"``; ``code`` (one of
    :data:`ERROR_CODES`) is required iff ``status != "ok"``, and is
    ``"cancelled"`` when ``status`` is ``"cancelled"``. When the backend answered
    with an error status, ``upstream_status`` is that status and ``upstream_body``
    its body as text (at most :data:`UPSTREAM_BODY_LIMIT` characters); both are
    optional, so a frame without them decodes as before.
    """

    run_id: str
    status: str = attrs.field(validator=_one_of(END_STATUSES))
    code: str | None = attrs.field(default=None, validator=_validate_end_code)
    message: str | None = None
    upstream_status: int | None = None
    upstream_body: str | None = None

    @property
    def failure(self) -> FailureKind | None:
        """Whose failure this end is (:func:`failure_kind`); None when ``status`` is ``"ok"``."""
        if self.status == "ok":
            return None
        return failure_kind(self.code, self.upstream_status)


@final
@attrs.frozen
class InFlight:
    """``in_flight``: the node's answer to :class:`Leader`: its runs in flight per provider.

    ``runs`` counts the runs and tunnel requests holding a permit of the node's
    gate that the connection it is sent on did not send (another Edge's, a
    warm-up's), as ``[provider, count]`` pairs (providers with none left out);
    ``epoch`` echoes the leader's. While any is left, the node sends it again at
    each change; each replaces the last. ``long_runs``: how many of those
    runs are long (their ``run`` said so), as pairs the same way; left out of the
    frame when empty.
    """

    epoch: int
    runs: tuple[tuple[str, int], ...]
    long_runs: tuple[tuple[str, int], ...] = ()


@final
@attrs.frozen
class ProviderHealth:
    """``provider_health`` (v6): one provider's health as the node's watcher finds it, at each change (docs/wire.md).

    ``engine`` (v7): the engine's own view, with a ``ready`` report; left out of the frame when None.
    """

    provider: str
    state: str = attrs.field(validator=_one_of(HEALTH_STATES))
    reason: str = ""
    capacity: int | None = None
    engine: EngineView | None = None


@final
@attrs.frozen
class TunnelStart:
    """``tunnel_start``: the upstream answered a tunnel request with this status and headers."""

    run_id: str
    status: int
    headers: tuple[tuple[str, str], ...]


@final
@attrs.frozen
class TunnelChunk:
    """``tunnel_chunk``: raw upstream body bytes, base64 in ``data``."""

    run_id: str
    data: str

    @classmethod
    def from_bytes(cls, run_id: str, raw: bytes) -> TunnelChunk:
        """Build a chunk carrying ``raw`` (base64-encodes it)."""
        return cls(run_id, _encode_base64(raw))

    def payload(self) -> bytes:
        """The raw bytes of this chunk.

        Raises:
            ProtocolError: ``data`` is not valid base64.
        """
        return _decode_base64(self.data, f"tunnel_chunk {self.run_id!r}: data")


@final
@attrs.frozen
class TunnelEnd:
    """``tunnel_end``: the last message of a tunnel request (same status/code rules as :class:`RunEnd`)."""

    run_id: str
    status: str = attrs.field(validator=_one_of(END_STATUSES))
    code: str | None = attrs.field(default=None, validator=_validate_end_code)
    message: str | None = None


# --------------------------------------------------------------------------- Edge -> Node


@final
@attrs.frozen
class Registered:
    """``registered``: the Edge accepted the registration as ``generation``.

    The node heartbeats every ``min(its configured interval, heartbeat_interval_ms)``.
    """

    node_id: str
    generation: int
    heartbeat_interval_ms: int


@final
@attrs.frozen
class Rejected:
    """``rejected``: the Edge refused the registration, then closes with 1008."""

    code: str = attrs.field(validator=_one_of(REJECT_CODES))
    reason: str
    retryable: bool


@final
@attrs.frozen
class Leader:
    """``leader``: the Edge leads its HA group at ``epoch`` (docs/ha.md).

    Sent on every connection when the Edge wins an election, and right after
    ``registered`` while it leads. The node raises its fence to ``epoch`` and
    answers :class:`InFlight`.
    """

    epoch: int


@final
@attrs.frozen
class Run:
    """``run``: execute one OpenAI request on ``provider``.

    ``body["model"]`` is already the upstream model name. For ``chat/completions`` and
    ``completions`` ``body["stream"]`` equals ``stream``; an ``embeddings`` run is never a
    stream and its body carries no ``stream`` key. ``epoch`` (only from an Edge
    with ``ha:``): the sending leader's epoch; a node that has seen a higher one
    refuses the run with ``stale_epoch``. Left out of the frame when None.
    ``long``: the Edge admitted it as a long-context request (it holds one of
    the provider's long slots there); left out of the frame when false.
    ``model``: the upstream model name; ``body`` is then the client's body as it sent
    it (its own ``model``, ``stream`` or none), and the node runs :meth:`upstream_body`.
    Left out of the frame when None (``body`` is then already the upstream's).
    ``deadline_ms`` (v6): what was left of the request's deadline when the run was sent, in
    milliseconds (at least 1); the node bounds the backend call by it and ends the run
    ``deadline_exceeded`` when it passes. Left out of the frame when None (no deadline).
    """

    run_id: str
    provider: str
    endpoint: str = attrs.field(validator=_one_of(ENDPOINTS))
    body: dict[str, Any]
    stream: bool
    epoch: int | None = None
    long: bool = False
    model: str | None = None
    deadline_ms: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.ge(1)))

    def for_upstream(self) -> Run:
        """This run as its node serves it: from v5 (``model`` set) with :meth:`upstream_body` as its
        body and no ``model``; before v5 the run itself."""
        return self if self.model is None else attrs.evolve(self, body=self.upstream_body(), model=None)

    def upstream_body(self) -> dict[str, Any]:
        """The body to send upstream: ``body`` itself before v5; from v5 (``model`` set) a copy with
        ``model`` put in, and for the completion endpoints ``stream`` set to :attr:`stream`."""
        if self.model is None:
            return self.body
        body = dict(self.body)
        body["model"] = self.model
        if self.endpoint != "embeddings":
            body["stream"] = self.stream
        return body


@final
@attrs.frozen
class Cancel:
    """``cancel``: stop the run or tunnel ``run_id`` (ignored if it already ended)."""

    run_id: str


@final
@attrs.frozen
class TunnelRequest:
    """``tunnel_request``: one raw HTTP request to a provider's native API; ``body`` is base64."""

    run_id: str
    provider: str
    method: str
    path: str
    headers: tuple[tuple[str, str], ...] = ()
    body: str = ""
    epoch: int | None = None
    """As :attr:`Run.epoch`."""

    @classmethod
    def from_bytes(
        cls,
        run_id: str,
        provider: str,
        method: str,
        path: str,
        headers: tuple[tuple[str, str], ...] = (),
        body: bytes = b"",
        epoch: int | None = None,
    ) -> TunnelRequest:
        """Build a tunnel request whose body is ``body`` (base64-encodes it)."""
        return cls(run_id, provider, method, path, headers, _encode_base64(body), epoch)

    def body_bytes(self) -> bytes:
        """The raw request body.

        Raises:
            ProtocolError: ``body`` is not valid base64.
        """
        return _decode_base64(self.body, f"tunnel_request {self.run_id!r}: body")


NodeMessage = Union[  # noqa: UP007 (a runtime object: the codec's cattrs hooks are keyed on it)
    Register, Heartbeat, RunEnd, TunnelStart, TunnelChunk, TunnelEnd, InFlight, ProviderHealth
]
"""Every message a node sends."""

EdgeMessage = Union[Registered, Rejected, Run, Cancel, TunnelRequest, Leader]  # noqa: UP007 (a runtime object: the codec's cattrs hooks are keyed on it)
"""Every message the Edge sends."""

Message = Union[NodeMessage, EdgeMessage]  # noqa: UP007 (a runtime object: the codec's cattrs hooks are keyed on it)
"""Every message of the protocol."""

MESSAGE_TYPES: Final[dict[type[Any], str]] = {
    Register: "register",
    Heartbeat: "heartbeat",
    RunEnd: "run_end",
    TunnelStart: "tunnel_start",
    TunnelChunk: "tunnel_chunk",
    TunnelEnd: "tunnel_end",
    InFlight: "in_flight",
    ProviderHealth: "provider_health",
    Registered: "registered",
    Rejected: "rejected",
    Run: "run",
    Cancel: "cancel",
    TunnelRequest: "tunnel_request",
    Leader: "leader",
}
"""The ``"type"`` tag of each message class."""
