"""A node's ``provider_health`` reports, fed to the admission core [health-probe].

The node watches its providers (readiness probes, the stall watchdog: docs/node.md,
Health) and reports each change on every connection of wire v6 or later. The Edge
decides nothing here: each report goes to ``admission.report_health``, the core's
input beside the failures of runs, so the ejection, probe and panic rules stay in
one place (docs/admission.md, Health). A report is tied to the connection it came
on: the core drops one whose node has reconnected since (its generation), and a
report for a provider the node did not register is dropped with a warning.

From wire v7 a ``ready`` report may carry the engine's own view (``engine``): its KV use
and preemption count go to the core with the report (they may cut a budgeted provider's
token budget: docs/admission.md, The engine's view). Such a report comes at most once a
probe while the engine is busy: logged at DEBUG unless its state, reason or capacity
changed.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from iop_admission import ProviderKey, ProviderReport
from iop_wire import END_MESSAGE_LIMIT, ProviderHealth

if TYPE_CHECKING:
    from iop_edge.nodes.link import NodeLink

logger = logging.getLogger("iop_edge.nodes")


def apply_report(link: NodeLink, report: ProviderHealth) -> None:
    """Feed one ``provider_health`` of ``link``'s node to the admission core. Synchronous."""
    if report.provider not in link.providers:
        logger.warning(
            "node %s reported the health of %r, a provider it did not register", link.node_id, report.provider
        )
        return
    key = ProviderKey(link.node_id, report.provider)
    told_core = provider_report(report, link.generation)
    reason = told_core.reason
    detail = f": {reason!r}" if reason else ""  # quoted: the node's text, never a line of its own in the log
    told = f" (its backend's own capacity: {report.capacity})" if report.capacity is not None else ""
    words = (report.state, reason, report.capacity)
    if link.told.get(report.provider) == words:  # the engine's view alone changed
        log = logger.debug
    else:
        log = logger.info if report.state == "ready" else logger.warning
        link.told[report.provider] = words
    log("provider %s reported %s%s%s", key, report.state, detail, told)
    link.host.report_health(key, told_core)


def provider_report(report: ProviderHealth, generation: int) -> ProviderReport:
    """What the core is told of a node's ``provider_health`` on connection ``generation``: its state,
    reason (cut to :data:`END_MESSAGE_LIMIT`), its backend's capacity when at least 1 (a report can
    only lower the configured one), and its engine's KV use and preemptions when it sent the view."""
    capacity = report.capacity if report.capacity is None or report.capacity >= 1 else None
    engine = report.engine
    kv_use, preemptions = (None, None) if engine is None else (engine.kv_use, engine.preemptions)
    return ProviderReport(report.state, report.reason[:END_MESSAGE_LIMIT], capacity, generation, kv_use, preemptions)
