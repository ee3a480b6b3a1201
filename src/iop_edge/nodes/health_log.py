"""What the backends' health did to the providers, in the Edge's log: :class:`HealthLog`.

Admission decides ejections, restorations and an engine's cut of a token budget
([outlier-ejection], [token-ledger]) and emits them as events; this observer (fed by
:func:`iop_edge.admission_feed.feed`) writes the lines an operator looks for:

- ``ejected`` (WARNING): the provider, how long, after how many consecutive failures;
- ``restored`` (INFO);
- a token budget the engine's report cut below ``total_context_tokens`` (WARNING, once
  when the cut begins: a busy engine's report may move it every second), and the budget
  back in full (INFO). The moves between are DEBUG lines.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import final

from iop_admission import AdmissionEvent, PoolConfig, ProviderKey

__all__ = ["HealthLog"]

logger = logging.getLogger("iop_edge.nodes")


@final
class HealthLog:
    """Log a provider's health events (:meth:`observe`); ``config`` gives the configuration in force."""

    __slots__ = ("_config", "_cut")

    def __init__(self, config: Callable[[], PoolConfig]) -> None:
        self._config = config
        self._cut: set[ProviderKey] = set()  # providers whose budget the engine's report cuts now

    def observe(self, event: AdmissionEvent) -> None:
        kind = event.kind
        if kind == "ejected":
            logger.warning(
                "provider %s ejected for %.1f s after %d consecutive failures",
                event.provider,
                event.duration or 0.0,
                event.failures or 0,
            )
        elif kind == "restored":
            logger.info("provider %s restored", event.provider)
        elif kind == "budget_changed":
            self._budget(event)

    def _budget(self, event: AdmissionEvent) -> None:
        key, budget = event.provider, event.token_budget
        assert key is not None and budget is not None
        spec = self._config().providers.get(key)
        configured = spec.budget if spec is not None else None
        if configured is None or budget >= configured:
            if key in self._cut:
                self._cut.discard(key)
                logger.info("provider %s: token budget back to %d tokens (the engine reports no pressure)", key, budget)
        elif key not in self._cut:
            self._cut.add(key)
            logger.warning(
                "provider %s: token budget cut to %d of %d tokens by the engine's report "
                "(its cache holds more than was reserved, or it preempted)",
                key,
                budget,
                configured,
            )
        else:
            logger.debug("provider %s: token budget %d of %d tokens (%s)", key, budget, configured, event.reason)
