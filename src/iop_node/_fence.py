"""The node's epoch fence [epoch-fencing]: the highest leader epoch seen, across every Edge connection.

Edges of an HA group (docs/ha.md) put their leader's epoch on each run (wire
v3). The node keeps one fence for all its connections, in its
:class:`~iop_node.NodeRuntime`: a run of an older epoch than one already seen
comes from an Edge that no longer leads (paused, or cut off from etcd) and is
refused with ``stale_epoch`` before it takes a permit.
"""

from __future__ import annotations

import logging
from typing import final

import attrs

from ._errors import StaleEpoch

logger = logging.getLogger("iop_node")


@final
@attrs.define
class EpochFence:
    """The highest epoch seen, and how many runs it refused.

    Attributes:
        seen: the highest epoch seen in a ``leader`` message or a run (0: none yet).
        refused: runs and tunnel requests refused as ``stale_epoch`` so far.
    """

    seen: int = 0
    refused: int = 0

    def check(self, epoch: int | None) -> None:
        """Let a run of ``epoch`` through (raising the fence to it), or refuse it. Does not checkpoint.

        Raises:
            StaleEpoch: ``epoch`` is older than the fence.
        """
        if not self.admits(epoch):
            logger.warning("run of epoch %s refused: this node has seen epoch %d", epoch, self.seen)
            raise StaleEpoch(f"run of epoch {epoch}; this node has seen epoch {self.seen}")

    def admits(self, epoch: int | None) -> bool:
        """Whether a run of ``epoch`` may run; raises the fence to it when it may.

        A run without an epoch (an Edge without ``ha:``, a v1/v2 connection) is
        never fenced. Does not checkpoint.
        """
        if epoch is None:
            return True
        if epoch < self.seen:
            self.refused += 1
            return False
        self.seen = epoch
        return True

    def raise_to(self, epoch: int) -> None:
        """A leader announced ``epoch``: the fence never goes down."""
        self.seen = max(self.seen, epoch)
