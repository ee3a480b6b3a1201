"""The answers of an Edge with ``ha:`` that does not lead, or cannot prove it still does: ``503 not_leader``
(``leader_stepped_down`` for a request whose run had been sent).

[ha-election] [ha-step-down] A standby, a leader that stepped down, and a leader woken from a
pause past its own count of its lease (before its election task has run) answer alike:
``Retry-After`` one TTL, and ``x-iop-leader`` when another Edge is known to lead.
"""

from __future__ import annotations

import math

from iop_edge.api.rejections import RequestRejected, canned
from iop_edge.front_door.head_refusal import COMPLETION_TARGETS
from iop_edge.ha import EdgeHa
from iop_edge.listener.server import CannedResponse


def standby_refusal(ha: EdgeHa, *, ran: bool = False) -> RequestRejected:
    """[ha-election] A standby's (or a stepped-down leader's) 503: retry after a TTL, at the leader
    (named when another Edge is known to lead, never this one).

    ``ran``: the request's run had been sent when this Edge stepped down, so it may have run:
    ``leader_stepped_down``; otherwise ``not_leader``, which always means it did not run."""
    leader = ha.other_leader()
    where = f"; the leader is {leader}" if leader else "; no Edge leads at the moment"
    code, what = ("leader_stepped_down", "this Edge stopped leading while the request ran (it may have run)")
    if not ran:
        code, what = "not_leader", "this Edge does not lead"
    return RequestRejected(
        503,
        code,
        what + where,
        type="service_unavailable",
        retry_after=ha.retry_after(),
        leader=leader,
    )


def lost_unled(rejection: RequestRejected, ha: EdgeHa | None) -> RequestRejected:
    """A run its node dropped (``node_disconnected``: it was sent, it may have run) while this Edge
    cannot prove it leads -- a leader woken from a pause whose nodes dropped it meanwhile -- is
    ``leader_stepped_down`` with ``x-iop-leader`` [ha-step-down], as every request of a term that
    ended under way; never retried either way."""
    if ha is not None and rejection.code == "node_disconnected" and not ha.admits():
        return standby_refusal(ha, ran=True)
    return rejection


def ran_earlier(rejection: RequestRejected, ran: bool) -> RequestRejected:
    """An attempt's refusal, told as the request's: when an earlier attempt's run had been sent
    (``ran``), a ``not_leader`` of this one (this Edge could not stamp its run, or a node refused it
    as ``stale_epoch``) becomes ``leader_stepped_down`` -- the earlier run may have run, and
    ``not_leader`` promises the request never did [ha-step-down]."""
    if ran and rejection.code == "not_leader":
        rejection.code = rejection.reason = "leader_stepped_down"
        rejection.message = f"an earlier attempt's run was sent (it may have run); then: {rejection.message}"
    return rejection


def not_leader_on_head(ha: EdgeHa | None, method: bytes, target: bytes) -> tuple[CannedResponse, float] | None:
    """A completion request's ``503 not_leader`` on its head when this Edge has ``ha:`` and cannot prove it
    leads [ha-step-down]; the connection is not paused (the client should go elsewhere now)."""
    if ha is None or method != b"POST" or target not in COMPLETION_TARGETS or ha.admits():
        return None
    rejection = standby_refusal(ha)
    head, body = canned(rejection)
    return CannedResponse(rejection.status, head, body, rejection.retry_after), -math.inf
