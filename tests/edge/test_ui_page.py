"""The live queue page over real sockets: off by default, behind a token, a capped number
of viewers, and a stream that follows admission -- never a prompt.

[queue-page]
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import h11
import httpx
import pytest
import trio
import trio.testing

from edge.harness import ADMIN_TOKEN, FAST, Edge, EdgeLayout, eventually, fake_node, running_edge

VIEWER = "viewer-3f9a-sentinel"
PROMPT = "prompt-text-8d2e-must-not-show"


def _layout(max_viewers: int = 4) -> EdgeLayout:
    return EdgeLayout(
        extra=(f"ui: {{enabled: true, viewer_token: {VIEWER}, max_viewers: {max_viewers}, update_interval_ms: 100}}",)
    )


class _Stream:
    """``GET /ui/stream`` read with h11 over a plain socket, as far as a test needs; every byte kept."""

    def __init__(self, sock: trio.SocketStream, query: str) -> None:
        self.sock = sock
        self.h11 = h11.Connection(h11.CLIENT)
        self.query = query
        self.raw = b""
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self._pending = b""

    async def open(self) -> None:
        request = h11.Request(method="GET", target=f"/ui/stream?{self.query}", headers=[("host", "127.0.0.1")])
        await self.sock.send_all(self.h11.send(request) + self.h11.send(h11.EndOfMessage()))
        while True:
            event = await self._next()
            if isinstance(event, h11.Response):
                self.status, self.headers = event.status_code, dict(event.headers)
                return

    async def until(self, holds: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        while True:
            while b"\n\n" in self._pending:
                event, self._pending = self._pending.split(b"\n\n", 1)
                if event.startswith(b"data: "):
                    view: dict[str, Any] = json.loads(event[len(b"data: ") :])
                    if holds(view):
                        return view
            event = await self._next()
            if isinstance(event, h11.Data):
                self.raw += bytes(event.data)
                self._pending += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                raise AssertionError("the stream ended")

    async def _next(self) -> h11.Event | type[h11.NEED_DATA]:
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = await self.sock.receive_some(65536)
            self.h11.receive_data(data)


@asynccontextmanager
async def _stream(edge: Edge, token: str = VIEWER) -> AsyncIterator[_Stream]:
    async with await trio.open_tcp_stream("127.0.0.1", edge.http_port) as sock:
        stream = _Stream(sock, f"token={token}")
        await stream.open()
        yield stream


def _gpu0(view: dict[str, Any]) -> dict[str, Any]:
    return next(p for p in view["providers"]["rows"] if p["provider"] == "gpu0")


@pytest.mark.req("queue-page")
async def test_the_page_is_off_by_default(tmp_path: Path) -> None:
    """[queue-page] without ``ui.enabled`` neither path exists, whatever the token."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge:
            for path in ("/ui", "/ui/stream"):
                response = await edge.http.get(path, headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
                assert response.status_code == 404


@pytest.mark.req("queue-page")
async def test_the_page_wants_a_token_and_ships_its_assets(tmp_path: Path) -> None:
    """[queue-page] no token or a wrong one: 401; the viewer token (query) or the admin token
    (bearer): the page, script and style inlined, locked down by its content security policy."""
    with trio.fail_after(10):
        async with running_edge(tmp_path, _layout()) as edge:
            assert (await edge.http.get("/ui")).status_code == 401
            assert (await edge.http.get("/ui", params={"token": "nope"})).status_code == 401
            assert (await edge.http.get("/ui/stream")).status_code == 401
            assert (await edge.http.post("/ui", params={"token": VIEWER})).status_code == 405
            page = await edge.http.get("/ui", params={"token": VIEWER})
            assert page.status_code == 200
            assert page.headers["content-type"].startswith("text/html")
            assert "script-src 'sha256-" in page.headers["content-security-policy"]
            assert page.headers["cache-control"] == "no-store"
            assert 'fetch("/ui/stream?"' in page.text and "/*SCRIPT*/" not in page.text
            assert "http://" not in page.text and "https://" not in page.text  # nothing from elsewhere
            assert VIEWER not in page.text and ADMIN_TOKEN not in page.text
            admin = await edge.http.get("/ui", headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
            assert admin.status_code == 200


@pytest.mark.req("queue-page")
async def test_the_stream_follows_admission_and_never_shows_the_prompt(tmp_path: Path) -> None:
    """[queue-page] a run shows in flight; a request queued behind the capacity-1 provider shows
    with its position and reason and leaves when granted; grants are counted per model key; a
    dropped node shows offline; the raw stream never holds the prompt sent."""
    with trio.fail_after(20):
        async with running_edge(tmp_path, _layout()) as edge, _stream(edge) as views:
            assert views.status == 200
            assert views.headers[b"content-type"] == b"text/event-stream"
            first = await views.until(lambda v: True)
            assert first["totals"]["queue_depth"] == 0
            async with fake_node(edge) as node, trio.open_nursery() as nursery:
                await views.until(lambda v: _gpu0(v)["health"] == "online")
                results: list[httpx.Response] = []

                async def post() -> None:
                    results.append(await edge.chat(FAST, PROMPT))

                nursery.start_soon(post)
                running = await node.next_run()
                await views.until(lambda v: _gpu0(v)["in_flight"] == 1)
                nursery.start_soon(post)
                await eventually(lambda: edge.queue_depth == 1)
                view = await views.until(lambda v: v["waiters"]["matched"] == 1)
                (waiter,) = view["waiters"]["rows"]
                assert (waiter["position"], waiter["model"], waiter["reason"]) == (1, FAST, "all_candidates_full")
                assert waiter["tenant"] == "default"
                await node.answer(running)
                second = await node.next_run()
                await views.until(lambda v: v["waiters"]["matched"] == 0 and _gpu0(v)["in_flight"] == 1)
                await node.answer(second)
                done = await views.until(lambda v: _gpu0(v)["in_flight"] == 0)
                assert done["activity"][FAST] == {"grants": 2, "refusals": 0}
                assert [r.status_code for r in results] == [200, 200]
                await node.drop()
            await views.until(lambda v: _gpu0(v)["health"] == "offline")
    assert PROMPT.encode() not in views.raw
    assert VIEWER.encode() not in views.raw and ADMIN_TOKEN.encode() not in views.raw


@pytest.mark.req("queue-page")
async def test_viewers_are_capped(tmp_path: Path) -> None:
    """[queue-page] ``ui.max_viewers`` streams at once; one more is refused 429 until one leaves."""
    with trio.fail_after(10):
        async with running_edge(tmp_path, _layout(max_viewers=1)) as edge:
            async with _stream(edge) as first:
                assert first.status == 200
                refused = await edge.http.get("/ui/stream", params={"token": VIEWER})
                assert refused.status_code == 429
                assert refused.json()["error"]["code"] == "too_many_viewers"
                assert (await edge.http.get("/ui", params={"token": VIEWER})).status_code == 200
            for _ in range(100):  # bounded: the server sees the first stream go within a few tries
                async with _stream(edge) as again:
                    if again.status == 200:
                        break
                await trio.testing.wait_all_tasks_blocked(cushion=0.002)
            assert again.status == 200
