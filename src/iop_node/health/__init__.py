"""The Node's watch over its providers [health-probe]: readiness probes, the stall watchdog, the idle canary.

:class:`~iop_node.health.watcher.HealthWatcher` reports to every Edge what it finds
(``provider_health``, wire v6); the Edge's admission core decides. See docs/node.md, Health.
"""

from iop_node.health.progress import Progress
from iop_node.health.readiness import ProbeResult, Readiness
from iop_node.health.watcher import HealthReport, HealthWatcher

__all__ = ["HealthReport", "HealthWatcher", "ProbeResult", "Progress", "Readiness"]
