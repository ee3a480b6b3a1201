"""The queue page recovers by itself and shows history from its first second, in a real headless
Chromium against real Edge, Node and mock backend processes (and, for a token rotated by a
reload, the Edge's page app over an admission core, :mod:`page_server`).

[queue-page]: with ``ui.max_viewers: 1`` and the one slot held by another stream, the page is
refused (429): it says so, and when it tries again, and dims what it shows; within 5 s of the
slot freeing it is live.
Its charts then hold the seconds before it opened (kept by the Edge and sent on open), drawn.
Loading it logs no console error but the refusals themselves (no favicon 404). When the Edge
goes, the page says so at once. A page whose stream is refused 401 (its token no longer
accepted) says so, keeps trying, and is live once its token is accepted again.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import trio
from page_driver import link, run, shows
from page_server import serve_page
from selenium import webdriver

from e2e.harness import FAST, Stack, edge_config, node_config, open_stack
from iop_admission import Admission, ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy
from iop_edge.config import UiConfig

VIEWER = "viewer-recovery-sentinel"
RECOVERS_WITHIN = 5.0
"""The issue's bound: the page is live again within 5 s of a viewer slot freeing."""
HISTORY = 6
"""Samples (seconds) the Edge has kept before the page opens."""


async def start(stack: Stack) -> None:
    await stack.start_backend(latency_ms=20, tokens_per_second=200)
    ui = {"enabled": True, "viewer_token": VIEWER, "update_interval_ms": 250, "max_viewers": 1}
    await stack.start_edge(edge_config(ui=ui))
    await stack.start_node(node_config(heartbeat_interval_ms=200))


async def hold_the_slot(port: int, samples: int = HISTORY) -> trio.SocketStream:
    """Open ``/ui/stream`` and read it until a view shows ``samples`` kept; keep it open."""
    sock = await trio.open_tcp_stream("127.0.0.1", port)
    await sock.send_all(f"GET /ui/stream?token={VIEWER} HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n".encode())
    received = b""
    while True:
        received += await sock.receive_some(65536)
        for event in received.split(b"\n\n"):
            data = event.partition(b"data: ")[2]
            if data.startswith(b"{") and b"event: history" not in event:  # a view
                recent = json.loads(data)["recent"]
                if (recent[-1][0] if recent else 0) >= samples:
                    return sock
        received = received[received.rfind(b"\n\n") + 2 :]


def why(browser: webdriver.Chrome) -> str:
    """What the header says beside the connection label."""
    text: str = browser.find_element("id", "why").text
    return text


STALE = "return document.body.classList.contains('stale')"

CHART = """
const c = document.getElementById("chart"), g = c.getContext("2d");
const pixels = g.getImageData(0, 0, c.width, c.height).data;
let lines = 0;  // coloured pixels: the series drawn (the labels are grey)
for (let i = 0; i < pixels.length; i += 4) {
  const [r, g, b, a] = pixels.slice(i, i + 4);
  if (a > 0 && Math.max(r, g, b) - Math.min(r, g, b) > 80) lines += 1;
}
return [Number(c.dataset.samples), lines];
"""


@pytest.mark.req("queue-page")
async def test_a_refused_page_comes_back_with_history(tmp_path: Path, browser: webdriver.Chrome) -> None:
    with trio.fail_after(90):
        async with open_stack(tmp_path) as stack:
            await start(stack)
            assert stack.http_port is not None
            for _ in range(3):  # grants to chart
                assert (await stack.chat(FAST, max_tokens=3)).status_code == 200
            held = await hold_the_slot(stack.http_port)

            await run(browser.get, f"{stack.base_url}/ui?token={VIEWER}")
            await shows(browser, lambda b: link(b) == "reconnecting" and "429" in why(b), 10)
            told = await run(why, browser)
            assert "at most 1 viewers at once" in told and "next try in" in told
            assert await run(browser.execute_script, STALE)  # nothing shown is current: dimmed
            logged = await run(browser.get_log, "browser")
            assert all("429" in entry["message"] for entry in logged if entry["level"] == "SEVERE"), logged
            assert not any("favicon" in entry["message"] for entry in logged)

            await held.aclose()  # the slot frees
            await shows(browser, lambda b: link(b) == "live", RECOVERS_WITHIN)
            assert await run(why, browser) == ""
            assert not await run(browser.execute_script, STALE)

            samples, drawn = await run(browser.execute_script, CHART)
            assert samples >= HISTORY  # each from the Edge: the page was refused until now
            assert drawn > 0

            assert stack.edge is not None
            stack.edge.process.kill()  # the Edge goes: the page says so at once, and keeps trying
            await shows(browser, lambda b: link(b) == "reconnecting" and "the Edge" in why(b), RECOVERS_WITHIN)


@pytest.mark.req("queue-page")
async def test_a_page_refused_for_its_token_comes_back(browser: webdriver.Chrome) -> None:
    gpu0 = ProviderKey("node-a", "gpu0")
    spec = ProviderSpec(capacity=1, long_context_capacity=1, context_window_tokens=8192, total_context_tokens=8192)
    admission = Admission(
        PoolConfig(
            policy=QueuePolicy(max_queue=10, queue_timeout=30.0),
            providers={gpu0: spec},
            models={"m": ModelGroup(candidates=(gpu0,))},
        )
    )
    ui = UiConfig(enabled=True, viewer_token=VIEWER, max_viewers=1, update_interval_ms=250)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            url, parts = await serve_page(nursery, admission, ui)
            held = await hold_the_slot(int(url.rsplit(":", 1)[1]), samples=0)
            await run(browser.get, f"{url}/ui?token={VIEWER}")
            await shows(browser, lambda b: link(b) == "reconnecting" and "429" in why(b), 10)
            parts.ui = attrs.evolve(ui, viewer_token="rotated-by-a-reload")  # the page's token is refused now
            await held.aclose()
            await shows(browser, lambda b: link(b) == "reconnecting" and "refused (401)" in why(b), RECOVERS_WITHIN)
            assert "a viewer or admin token is required" in await run(why, browser)
            parts.ui = ui  # accepted again
            await shows(browser, lambda b: link(b) == "live", RECOVERS_WITHIN)
            nursery.cancel_scope.cancel()
