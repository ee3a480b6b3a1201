"""The ``/status`` document: one typed model, written by the Edge and read by ``iop status``.

The document is the admission snapshot (:class:`iop_admission.Snapshot`, its
fields at the top level) plus ``nodes``, one :class:`NodeStatus` per configured
node. The Edge serves :func:`status_document` of an :class:`EdgeStatus`; the CLI
reads it back with :func:`parse_status`, strictly: a missing field and a field
the model does not know are both errors. A field added on one side and not the
other therefore fails loudly in the tests instead of vanishing from the CLI.
"""

from __future__ import annotations

from typing import Any, final

import attrs
import cattrs
from cattrs.errors import AttributeValidationNote

from iop_admission import Snapshot

__all__ = ["EdgeStatus", "NodeStatus", "parse_status", "status_document"]


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


@final
@attrs.frozen
class EdgeStatus:
    """The whole ``/status`` document: the admission snapshot and the nodes, in config order."""

    snapshot: Snapshot
    nodes: tuple[NodeStatus, ...]


_converter = cattrs.Converter(forbid_extra_keys=True)


def status_document(status: EdgeStatus) -> dict[str, Any]:
    """The JSON-ready ``/status`` body: the snapshot's fields, then ``nodes``."""
    document: dict[str, Any] = _converter.unstructure(status.snapshot)
    document["nodes"] = _converter.unstructure(status.nodes, tuple[NodeStatus, ...])
    return document


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
    nodes: tuple[NodeStatus, ...] | None = None
    try:
        snapshot = _converter.structure({k: v for k, v in document.items() if k != "nodes"}, Snapshot)
    except cattrs.ClassValidationError as exc:
        errors.extend(exc.exceptions)  # their notes name the snapshot's fields, at the top level
    try:
        nodes = _converter.structure(document["nodes"], tuple[NodeStatus, ...])
    except (KeyError, TypeError, ValueError, cattrs.BaseValidationError) as exc:
        exc.__notes__ = [
            *getattr(exc, "__notes__", []),
            AttributeValidationNote("nodes", "nodes", tuple[NodeStatus, ...]),
        ]
        errors.append(exc)
    if errors or snapshot is None or nodes is None:
        raise cattrs.ClassValidationError("While structuring the /status document", errors, EdgeStatus)
    return EdgeStatus(snapshot, nodes)
