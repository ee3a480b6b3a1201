"""The ``/status`` document: one typed model, written by the Edge and read by ``iop status``.

The document is the admission snapshot (:class:`iop_admission.Snapshot`, its
fields at the top level) plus ``nodes``, one :class:`NodeStatus` per configured
node, and ``overload``, the front door's :class:`OverloadStatus`. The Edge serves :func:`status_document` of an :class:`EdgeStatus`; the CLI
reads it back with :func:`parse_status`, strictly: a missing field and a field
the model does not know are both errors. A field added on one side and not the
other therefore fails loudly in the tests instead of vanishing from the CLI.
"""

from __future__ import annotations

from typing import Any, final

import attrs
import cattrs
import orjson
from cattrs.errors import AttributeValidationNote

from iop_admission import ProviderRow, ProviderSnapshot, Snapshot

__all__ = [
    "EdgeStatus",
    "NodeRow",
    "NodeStatus",
    "OverloadStatus",
    "StatusRows",
    "parse_status",
    "status_document",
    "status_json",
    "status_json_rows",
]


@final
@attrs.frozen
class NodeStatus:
    """One configured node as the Edge's registry sees it.

    Attributes:
        connected: a registered connection is live.
        generation: the node's current generation (0: never registered).
        last_heartbeat_age: seconds since the last message from the node; None
            while disconnected.
        active_runs: runs the connection carries right now.
    """

    node_id: str
    connected: bool
    generation: int
    last_heartbeat_age: float | None
    active_runs: int


Failures = dict[str, dict[str, int]]
"""``/status``'s ``failures``: requests failed since the Edge started, by model key and error class
([error-classes], ``docs/openai-api.md``)."""

NodeRow = dict[str, Any]
"""A :class:`NodeStatus`'s fields as a plain dict, in field order: what cattrs makes of one,
made without the object (``/status`` writes 10,000 of them)."""


@final
@attrs.frozen(kw_only=True)
class OverloadStatus:
    """The Edge's front door: shedding, loop lag, connections.

    Attributes:
        shedding: new completion requests are being shed now.
        loop_lag_ms: the event loop's last lag sample.
        open_connections: HTTP connections open now.
        refused_connections: connections closed at accept (the cap) so far.
        shed_requests: requests answered ``503 overloaded`` so far.
        waiting: requests of this Edge waiting for a lease now.
        service_time_ms: the recent service time behind ``Retry-After``.
        paused_connections: connections left unread now after a refusal (pacing).
    """

    shedding: bool
    loop_lag_ms: float
    open_connections: int
    refused_connections: int
    shed_requests: int
    waiting: int
    service_time_ms: float
    paused_connections: int = 0


@final
@attrs.frozen
class HaStatus:
    """``/status``'s ``ha`` block, present when the Edge runs with ``ha:`` (docs/ha.md)."""

    role: str
    """``leader`` or ``standby`` (this Edge)."""
    leader: str | None
    """The leading Edge's advertised address, when known."""
    epoch: int
    """The leader's epoch (the election key's create revision)."""
    since: float | None
    """When this Edge last saw leadership change (Unix time), or None before any change."""
    elections_won: int
    step_downs: int


@final
@attrs.frozen
class EdgeStatus:
    """The whole ``/status`` document: the admission snapshot, the nodes in config order, the overload state."""

    snapshot: Snapshot
    nodes: tuple[NodeStatus, ...]
    overload: OverloadStatus
    ha: HaStatus | None = None
    failures: Failures = attrs.field(factory=dict)


@final
@attrs.frozen
class StatusRows:
    """What ``/status`` writes, with the providers and nodes as plain rows (no
    :class:`ProviderSnapshot` or :class:`NodeStatus` objects).

    ``snapshot``: the admission snapshot's Edge-wide fields, its ``providers``
    empty; ``providers``: its rows (:meth:`iop_admission.Admission.provider_rows`);
    ``nodes``: the nodes' rows (:data:`NodeRow`).
    """

    snapshot: Snapshot
    providers: list[ProviderRow]
    nodes: list[NodeRow]
    overload: OverloadStatus
    ha: HaStatus | None = None
    failures: Failures = attrs.field(factory=dict)

    def model(self) -> EdgeStatus:
        """The same status as an :class:`EdgeStatus` (the rows made objects)."""
        providers = tuple(ProviderSnapshot(**row) for row in self.providers)
        nodes = tuple(NodeStatus(**row) for row in self.nodes)
        snapshot = attrs.evolve(self.snapshot, providers=providers)
        return EdgeStatus(snapshot, nodes, self.overload, self.ha, self.failures)


_converter = cattrs.Converter(forbid_extra_keys=True)


_ROWS_PER_CALL = 200
"""List items written per call of the JSON encoder by :func:`status_json` (each call holds the GIL
briefly)."""


def status_document(status: EdgeStatus) -> dict[str, Any]:
    """The JSON-ready ``/status`` body: the snapshot's fields, then ``nodes``."""
    document: dict[str, Any] = _converter.unstructure(status.snapshot)
    document["nodes"] = _converter.unstructure(status.nodes, tuple[NodeStatus, ...])
    document["overload"] = _converter.unstructure(status.overload)
    document["failures"] = status.failures
    if status.ha is not None:
        document["ha"] = _converter.unstructure(status.ha)
    return document


def status_json_rows(status: StatusRows) -> bytes:
    """:func:`status_json` of ``status.model()``, the same bytes, written from the rows as they are."""
    document: dict[str, Any] = _converter.unstructure(status.snapshot)
    document["providers"] = status.providers
    document["nodes"] = status.nodes
    document["overload"] = _converter.unstructure(status.overload)
    document["failures"] = status.failures
    if status.ha is not None:
        document["ha"] = _converter.unstructure(status.ha)
    return _write(document)


def status_json(status: EdgeStatus) -> bytes:
    """:func:`status_document` as compact UTF-8 JSON, its lists written :data:`_ROWS_PER_CALL` items at a time.

    The document ``json.dumps(status_document(status), separators=(",", ":"),
    ensure_ascii=False)`` writes, byte for byte but for the spelling of very
    small or large floats (``0.00001`` for ``1e-05``; the same number). orjson
    writes it: at 10,000 providers the whole function takes half the CPU it
    took with the json module's encoder. Each call of the encoder is one C call that holds the GIL,
    stalling an event loop in another thread, so the lists go
    :data:`_ROWS_PER_CALL` items per call, not the whole document in one.
    """
    return _write(status_document(status))


def _write(document: dict[str, Any]) -> bytes:
    """``document`` as compact JSON, its lists :data:`_ROWS_PER_CALL` items per encoder call."""
    parts = []
    for key, value in document.items():
        name = orjson.dumps(key)
        if isinstance(value, list | tuple) and value:
            step = _ROWS_PER_CALL
            items = [orjson.dumps(value[i : i + step])[1:-1] for i in range(0, len(value), step)]
            parts.append(name + b":[" + b",".join(items) + b"]")
        else:
            parts.append(name + b":" + orjson.dumps(value))
    return b"{" + b",".join(parts) + b"}"


def parse_status(document: object) -> EdgeStatus:
    """Read a decoded ``/status`` body back into the model.

    Raises:
        TypeError: the document is not a JSON object.
        cattrs.ClassValidationError: fields missing, unknown or of the wrong type, all
            of them (``cattrs.transform_error`` words each as ``... @ $.path``).
    """
    if not isinstance(document, dict):
        raise TypeError(f"expected a JSON object, got {type(document).__name__}")
    errors: list[Exception] = []
    snapshot: Snapshot | None = None
    try:
        top = {k: v for k, v in document.items() if k not in _PARTS}
        snapshot = _converter.structure(top, Snapshot)
    except cattrs.ClassValidationError as exc:
        errors.extend(exc.exceptions)  # their notes name the snapshot's fields, at the top level
    nodes = _part(document, "nodes", tuple[NodeStatus, ...], errors)
    overload = _part(document, "overload", OverloadStatus, errors)
    ha = _part(document, "ha", HaStatus, errors) if "ha" in document else None
    failures = _part(document, "failures", Failures, errors)
    if errors or snapshot is None or nodes is None or overload is None or failures is None:
        raise cattrs.ClassValidationError("While structuring the /status document", errors, EdgeStatus)
    return EdgeStatus(snapshot, nodes, overload, ha, failures)


_PARTS = ("nodes", "overload", "ha", "failures")


def _part(document: dict[str, Any], key: str, kind: Any, errors: list[Exception]) -> Any:
    """``document[key]`` structured as ``kind``; None (and the error in ``errors``) if it is not one."""
    try:
        return _converter.structure(document[key], kind)
    except (KeyError, TypeError, ValueError, cattrs.BaseValidationError) as exc:
        exc.__notes__ = [*getattr(exc, "__notes__", []), AttributeValidationNote(key, key, kind)]
        errors.append(exc)
        return None
