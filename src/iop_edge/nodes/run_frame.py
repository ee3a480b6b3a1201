"""A run's request frame for its node, checked before the run is registered (issue 37's seam).

A frame the node's WebSocket cannot carry must fail its own run, never the connection: the
socket frames text as UTF-8 (a lone surrogate makes that raise), and the node closes the
connection (1009) on a message over its limit, cutting every run on it. So the Edge builds
and checks the frame first, and only a frame that passes is registered and queued.
"""

from __future__ import annotations

from iop_edge.nodes.runs import RunNotSent
from iop_wire import MAX_MESSAGE_BYTES, Run, TunnelRequest, encode, encode_run, run_for


def run_frame(message: Run | TunnelRequest, body_json: str | None, node_id: str, protocol: int) -> str:
    """The text frame of ``message`` for node ``node_id``: UTF-8 text within the node's message
    limit (:data:`iop_wire.MAX_MESSAGE_BYTES`), in the node's wire version ``protocol``.

    ``message`` has the current version's shape; ``body_json`` (a :class:`Run` with an empty
    body): the client's body text, carried as is (:func:`iop_wire.encode_run`). A node of the
    previous version gets the run as it reads it (:func:`iop_wire.run_for`).

    Raises:
        RunNotSent: 400 when it is not text (a lone surrogate, a value JSON cannot hold), 413
            ``request_too_large`` past the limit.
    """
    try:
        if type(message) is Run:
            message, body_json = run_for(protocol, message, body_json)
        if body_json is not None and type(message) is Run:
            frame = encode_run(message, body_json)
        else:
            frame = encode(message)
        size = len(frame) if frame.isascii() else len(frame.encode("utf-8"))
    except (ValueError, TypeError) as exc:  # UnicodeEncodeError is a ValueError
        raise RunNotSent(f"the request cannot be sent to a node: {exc}") from None
    if size > MAX_MESSAGE_BYTES:
        reason = f"the request is {size} bytes on the wire to node {node_id} (v{protocol})"
        raise RunNotSent(f"{reason}, over its {MAX_MESSAGE_BYTES}-byte limit", status=413, code="request_too_large")
    return frame
