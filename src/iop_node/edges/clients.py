"""One :class:`~iop_node.EdgeClient` per Edge URL, all sharing the node's one runtime [warm-standby].

With ``edge_urls`` (docs/ha.md) the node keeps a registered connection to every
Edge of an HA group: the leader sends runs, the standbys hold the node's
registration warm so that the one elected next admits at once. Every connection
takes its permits from the same :class:`~iop_node.NodeRuntime` gate, so the
node's capacity holds whichever Edge sends runs, even two Edges that both
believe they lead; the runtime's epoch fence refuses a run of an older leader
than one already seen ([epoch-fencing]).
"""

from __future__ import annotations

import random
from typing import final

import attrs
import trio

from iop_node._errors import RegistrationRejected
from iop_node._runtime import NodeRuntime
from iop_node.config import NodeConfig
from iop_node.edges.client import EdgeClient


@final
@attrs.define(eq=False)
class EdgeClients:
    """Keeps the node connected and registered to every Edge of ``config.urls``.

    Attributes:
        config: the node's config.
        runtime: gate, adapters and epoch fence, shared by every connection.
        rng: jitter source (each client gets its own, seeded from it).
        clients: one client per Edge URL, in the order of ``config.urls``.
    """

    config: NodeConfig
    runtime: NodeRuntime
    rng: random.Random = attrs.field(factory=random.Random)
    clients: tuple[EdgeClient, ...] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.clients = tuple(
            EdgeClient(self.config, self.runtime, rng=random.Random(self.rng.random()), url=url)
            for url in self.config.urls
        )

    async def run(self) -> None:
        """Run every client until :meth:`shutdown`; checkpoints.

        Raises:
            RegistrationRejected: an Edge rejected the registration for good (bad
                token, unknown node, protocol): the other clients are shut down
                first, as the node's configuration is wrong for the group.
        """
        rejected: list[RegistrationRejected] = []

        async def keep(client: EdgeClient) -> None:
            try:
                await client.run()
            except RegistrationRejected as exc:
                rejected.append(exc)
                self.shutdown()

        async with trio.open_nursery() as nursery:
            if self.runtime.health is not None:  # [health-probe]: it probes while a connection is registered
                nursery.start_soon(self.runtime.health.serve)
            async with trio.open_nursery() as connections:
                for client in self.clients:
                    connections.start_soon(keep, client)
            nursery.cancel_scope.cancel()
        if rejected:
            raise rejected[0]

    def shutdown(self) -> None:
        """Stop every client (:meth:`EdgeClient.shutdown`). Idempotent."""
        for client in self.clients:
            client.shutdown()
