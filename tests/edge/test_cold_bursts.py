"""Cold-connection bursts through a real Edge and Node ([overload-cheap-reject], [tenant-quotas]; issue 38).

A real Edge on 127.0.0.1 (capacity 4, ``provider_pool.max_queue: 16``) and an in-process Node whose
mock provider answers each run after 40 ms. A burst is every client opening a fresh connection at the
same moment and sending one request; the next burst starts once the Edge has drained. Two bursts
of the issue, 20 times each:

- a sheddable flood: 40 clients of tenant ``s`` (band -1) and 10 of tenant ``n`` (band 0);
- a quota flood: 40 clients of tenant ``f`` (its ``max_queue`` 8, below the pool's) and 8 of ``l``.

Neither ``n`` nor ``l`` can fill the queue alone (nor ``l`` with ``f``'s whole quota), so admission
queues each of their requests -- evicting an ``s`` waiter when the queue is full. Any 429 to them
is a wrong refusal (the Edge's head check used to give up to 10 of 20 in a burst). Bounded: 20
bursts of at most 50 requests each, every wait under one ``fail_after`` against a hang.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import h11
import pytest
import trio

from edge.harness import FAST, Edge, EdgeLayout, eventually, h11_answer, node_config, real_node, running_edge
from iop_node.config import ProviderConfig

BURSTS = 20
HANG = 300.0
"""Seconds after which the test is taken for hung: a bound, never a budget (a busy machine is slow)."""

SHEDDABLE_FLOOD = "{name: s, priority: -1, api_keys: [s-key]}, {name: n, api_keys: [n-key]}"
QUOTA_FLOOD = "{name: f, max_queue: 8, api_keys: [f-key]}, {name: l, api_keys: [l-key]}"


def layout(tenants: str) -> EdgeLayout:
    return EdgeLayout(gpu0_capacity=4, gpu0_long_capacity=4, max_queue=16, extra=(f"tenants: [{tenants}]",))


def request_bytes(key: str) -> tuple[bytes, bytes]:
    """A ``POST /v1/chat/completions`` with ``key``, on a connection that closes after it: its head
    and its body, sent apart as most HTTP clients do (httpx, urllib3)."""
    body = json.dumps({"model": FAST, "max_tokens": 4, "messages": [{"role": "user", "content": key}]}).encode()
    client = h11.Connection(h11.CLIENT)
    headers = [
        ("host", "127.0.0.1"),
        ("authorization", f"Bearer {key}"),
        ("content-type", "application/json"),
        ("content-length", str(len(body))),
        ("connection", "close"),
    ]
    head = client.send(h11.Request(method="POST", target="/v1/chat/completions", headers=headers))
    return head or b"", (client.send(h11.Data(data=body)) or b"") + (client.send(h11.EndOfMessage()) or b"")


async def ask(port: int, key: str, raw: tuple[bytes, bytes], answers: list[tuple[str, int, str]]) -> None:
    """Open a fresh connection, send ``raw`` (head, then body), read the answer: ``(key, status, error
    code)`` in ``answers``."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(raw[0])
        await trio.lowlevel.checkpoint()  # the other clients send their heads too
        await stream.send_all(raw[1])
        response, body = await h11_answer(h11.Connection(h11.CLIENT), stream)
    code = json.loads(body)["error"]["code"] if response.status_code != 200 else ""
    answers.append((key, response.status_code, code))


async def bursts(edge: Edge, clients: dict[str, int]) -> collections.Counter[tuple[str, int, str]]:
    """:data:`BURSTS` bursts of ``clients`` (key -> clients), the flood's first; every answer counted."""
    seen: collections.Counter[tuple[str, int, str]] = collections.Counter()
    raws = {key: request_bytes(key) for key in clients}
    for _ in range(BURSTS):
        answers: list[tuple[str, int, str]] = []
        async with trio.open_nursery() as nursery:
            for key, count in clients.items():
                for _ in range(count):
                    nursery.start_soon(ask, edge.http_port, key, raws[key], answers)
        assert len(answers) == sum(clients.values())
        seen.update(answers)
        await edge.assert_drained()
        door = edge.service.front_door
        assert (door.passing, door.passing_of) == (0, {})  # every request in transit arrived, by its tenant
    return seen


def refused(seen: collections.Counter[tuple[str, int, str]], key: str) -> dict[tuple[int, str], int]:
    return {(status, code): n for (k, status, code), n in seen.items() if k == key and status != 200}


async def run_bursts(
    tmp_path: Path, tenants: str, clients: dict[str, int]
) -> collections.Counter[tuple[str, int, str]]:
    with trio.fail_after(HANG):
        async with running_edge(tmp_path, layout(tenants)) as edge:
            provider = ProviderConfig(id="gpu0", adapter="mock", capacity=4, latency_ms=40)
            async with real_node(edge, node_config(edge, "node-a", [provider])):
                await eventually(lambda: edge.service.admission.is_connected("node-a"))
                return await bursts(edge, clients)


@pytest.mark.req("overload-cheap-reject", "tenant-quotas")
async def test_cold_bursts_of_a_sheddable_flood_refuse_no_band_0_request(tmp_path: Path) -> None:
    """[tenant-quotas] 20 bursts of 40 band -1 clients and 10 band 0 clients on fresh connections:
    every band 0 request is served (0 refused), the flood is refused only with its own codes, and
    the Edge is drained after each burst."""
    seen = await run_bursts(tmp_path, SHEDDABLE_FLOOD, {"s-key": 40, "n-key": 10})
    assert refused(seen, "n-key") == {}
    assert seen["n-key", 200, ""] == 10 * BURSTS
    assert refused(seen, "s-key")  # the bursts did overflow the queue
    assert set(refused(seen, "s-key")) <= {(429, "tenant_shed"), (429, "queue_full")}
    assert sum(n for (key, status, _), n in seen.items() if key == "s-key") == 40 * BURSTS


@pytest.mark.req("overload-cheap-reject", "tenant-quotas")
async def test_cold_bursts_of_a_tenant_at_its_quota_refuse_no_light_tenant_request(tmp_path: Path) -> None:
    """[tenant-quotas] 20 bursts of 40 clients of a tenant whose max_queue (8) is below the pool's (16)
    and 8 clients of a light tenant: every light request is served (0 refused), the flooding tenant
    is refused only with its quota's code or queue_full."""
    seen = await run_bursts(tmp_path, QUOTA_FLOOD, {"f-key": 40, "l-key": 8})
    assert refused(seen, "l-key") == {}
    assert seen["l-key", 200, ""] == 8 * BURSTS
    assert refused(seen, "f-key")  # the bursts did overflow the tenant's quota
    assert set(refused(seen, "f-key")) <= {(429, "tenant_max_queue"), (429, "queue_full")}


@pytest.mark.req("overload-cheap-reject")
async def test_a_request_that_never_asks_leaves_its_tenant_count(tmp_path: Path) -> None:
    """[overload-cheap-reject] A request let through on its head that ends before asking for a lease
    (a malformed body, a missing model) stops counting as in transit for its own tenant."""
    with trio.fail_after(HANG):
        async with running_edge(tmp_path, layout(SHEDDABLE_FLOOD)) as edge:
            headers = {"authorization": "Bearer n-key", "content-type": "application/json"}
            bad = await edge.http.post("/v1/chat/completions", content=b"{", headers=headers)
            no_model = await edge.http.post("/v1/chat/completions", json={}, headers=headers)
            door = edge.service.front_door
            assert (bad.status_code, no_model.status_code) == (400, 400)
            assert (door.passing, door.passing_of) == (0, {})
