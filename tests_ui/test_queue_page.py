"""The live queue page in a real headless Chromium, against real Edge and Node processes.

[queue-page]: the page loads; a provider's in-flight count changes within 1 s of a request
starting and ending; a request queued behind the capacity-1 provider shows with its position
and reason and leaves when granted; a node that goes away shows offline within 1 s; the
prompt sent is nowhere in the DOM or in the raw stream; without the token the page is refused;
without tenants nothing tenant shows. Screenshots go to ``docs/``.

The tenant test does not start Edge and Node processes: it serves the Edge's own page app
(:class:`iop_edge.QueuePage`) from a tiny hypercorn (trio) server over a real admission core
configured with ``PoolConfig.tenants`` (:mod:`page_server`), so that it holds waiters of
every tenant reason at once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing
from page_driver import run, shows
from page_server import serve_page
from selenium import webdriver
from selenium.webdriver.common.by import By

from e2e.harness import FAST, Requests, Stack, edge_config, node_config, open_stack, provider
from iop_admission import (
    Admission,
    ModelGroup,
    PoolConfig,
    ProviderKey,
    ProviderReport,
    ProviderSpec,
    QueuePolicy,
    TenantSpec,
)
from iop_edge.config import UiConfig

VIEWER = "viewer-ui-tier-sentinel"
PROMPT = "prompt-text-c41f-must-never-show"
DOCS = Path(__file__).resolve().parents[1] / "docs"
WITHIN = 1.0
"""The issue's bound: the page shows a change within 1 s of it happening at the Edge."""


async def start(stack: Stack) -> None:
    await stack.start_backend(latency_ms=50, tokens_per_second=10)
    ui = {"enabled": True, "viewer_token": VIEWER, "update_interval_ms": 250}
    await stack.start_edge(edge_config(queue_timeout_ms=60_000, ui=ui))
    await stack.start_node(node_config(heartbeat_interval_ms=200))


def table(browser: webdriver.Chrome, table_id: str) -> list[list[str]]:
    """The cells of a table's body, read in one step (the page replaces rows as views arrive)."""
    script = (
        f"return [...document.querySelectorAll('#{table_id} tbody tr')].map(r => [...r.cells].map(c => c.textContent))"
    )
    rows: list[list[str]] = browser.execute_script(script)
    return rows


def gpu0_cells(browser: webdriver.Chrome) -> list[str]:
    return next((cells for cells in table(browser, "providers") if cells[:2] == ["node-a", "gpu0"]), ["", "", "", ""])


def waiter_rows(browser: webdriver.Chrome) -> list[list[str]]:
    return table(browser, "waiters")


async def raw_stream(port: int, events: int) -> bytes:
    """The first ``events`` events of ``/ui/stream``, as the bytes on the wire."""
    async with await trio.open_tcp_stream("127.0.0.1", port) as sock:
        request = f"GET /ui/stream?token={VIEWER} HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
        await sock.send_all(request.encode())
        received = b""
        while received.count(b"\n\n") < events + 1:  # the head ends with a blank line too
            received += await sock.receive_some(65536)
        return received


@pytest.mark.req("queue-page")
async def test_the_queue_page_follows_the_edge(tmp_path: Path, browser: webdriver.Chrome) -> None:
    with trio.fail_after(90):
        async with open_stack(tmp_path) as stack, trio.open_nursery() as nursery:
            await start(stack)
            url = f"{stack.base_url}/ui"

            await run(browser.get, url)
            refused = await run(lambda: browser.page_source)
            assert "unauthorized" in refused and "IOP queue" not in refused

            await run(browser.get, f"{url}?token={VIEWER}")
            await shows(browser, lambda b: b.find_element(By.ID, "link").text == "live", 10)
            await shows(browser, lambda b: gpu0_cells(b)[2:4] == ["online", "0 / 1"], 10)

            requests = Requests(stack, nursery)
            requests.start("running", FAST, max_tokens=30, messages=[{"role": "user", "content": PROMPT}])
            await stack.wait_status(lambda s: provider(s, "gpu0")["in_flight"] == 1)
            await shows(browser, lambda b: gpu0_cells(b)[3] == "1 / 1", WITHIN)

            requests.start("waiting", FAST, max_tokens=5, messages=[{"role": "user", "content": PROMPT}])
            await stack.wait_status(lambda s: s["queue_depth"] == 1)
            await shows(browser, lambda b: len(waiter_rows(b)) == 1, WITHIN)
            (row,) = await run(waiter_rows, browser)
            assert row[1:3] == ["1", FAST]
            assert row[7] == "all candidates full"
            # No tenants configured: no tenant column, filter or table on the page.
            for hidden in (
                "#waiters th.tenant-col",
                "#waiters td.tenant-col",
                "#filters .tenant-col",
                "#tenants-section",
            ):
                assert not await run(lambda h=hidden: browser.find_element(By.CSS_SELECTOR, h).is_displayed())
            assert "tenant quota" not in await run(lambda: browser.find_element(By.ID, "reasons").text)
            assert stack.http_port is not None
            raw = await raw_stream(stack.http_port, 2)
            dom = await run(lambda: browser.page_source)
            assert PROMPT not in dom and PROMPT.encode() not in raw
            assert VIEWER not in dom and VIEWER.encode() not in raw
            await run(browser.save_screenshot, str(DOCS / "ui.png"))

            await stack.wait_status(lambda s: s["queue_depth"] == 0, timeout=30)
            await shows(browser, lambda b: not waiter_rows(b), WITHIN)
            await requests.answered(timeout=30)
            await stack.wait_status(lambda s: provider(s, "gpu0")["in_flight"] == 0)
            await shows(browser, lambda b: gpu0_cells(b)[3] == "0 / 1", WITHIN)
            assert [r.status_code for r in requests.answers.values()] == [200, 200]

            assert stack.node is not None
            stack.node.process.kill()
            await stack.wait_status(lambda s: provider(s, "gpu0")["health"] == "offline", timeout=5)
            await shows(browser, lambda b: gpu0_cells(b)[2] == "offline", WITHIN)
            await run(browser.save_screenshot, str(DOCS / "ui-offline.png"))
            dom = await run(lambda: browser.page_source)
            assert PROMPT not in dom


GPU0 = ProviderKey("node-a", "gpu0")


def pool() -> PoolConfig:
    """One provider of capacity 2 for model key ``m``; ``gold`` in a higher band, ``team-a``
    capped at one request in flight, ``team-b`` of weight 2."""
    return PoolConfig(
        policy=QueuePolicy(max_queue=100, queue_timeout=1e9),
        providers={
            GPU0: ProviderSpec(
                capacity=2, long_context_capacity=1, context_window_tokens=32768, total_context_tokens=32768
            )
        },
        models={"m": ModelGroup(candidates=(GPU0,))},
        tenants=(
            TenantSpec("gold", priority=1),
            TenantSpec("team-a", max_in_flight=1),
            TenantSpec("team-b", weight=2.0),
        ),
    )


@pytest.mark.req("queue-page")
async def test_the_page_shows_tenants_when_the_core_has_them(browser: webdriver.Chrome) -> None:
    admission = Admission(pool())
    admission.connect(GPU0.node_id)

    async def request(tenant: str) -> None:
        async with admission.lease("m", tenant=tenant):
            await trio.sleep_forever()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for tenant in ("team-a", "team-b", "team-a", "team-b", "gold"):  # two run, three wait
                nursery.start_soon(request, tenant)
                await trio.testing.wait_all_tasks_blocked()
            url, _ = await serve_page(
                nursery, admission, UiConfig(enabled=True, viewer_token=VIEWER, update_interval_ms=250)
            )
            await run(browser.get, f"{url}/ui?token={VIEWER}")
            await shows(browser, lambda b: len(table(b, "waiters")) == 3, 10)
            assert [(row[6], row[7]) for row in await run(table, browser, "waiters")] == [
                ("team-a", "tenant quota"),
                ("team-b", "higher band ahead"),
                ("gold", "all candidates full"),
            ]
            for shown in ("#waiters th.tenant-col", "#filters .tenant-col", "#tenants-section"):
                assert await run(lambda s=shown: browser.find_element(By.CSS_SELECTOR, s).is_displayed())
            tenants = {row[0]: row[1:] for row in await run(table, browser, "tenants")}
            assert tenants == {
                "gold": ["1", "1", "1", "0 / ∞", "∞", "0.0 %"],
                "team-a": ["0", "1", "1", "1 / 1", "∞", "50.0 %"],
                "team-b": ["0", "2", "1", "1 / ∞", "∞", "50.0 %"],
                "default": ["0", "1", "0", "0 / ∞", "∞", "0.0 %"],
            }
            await run(browser.save_screenshot, str(DOCS / "ui-tenants.png"))
            nursery.cancel_scope.cancel()


@pytest.mark.req("queue-page", "health-probe")
async def test_the_page_shows_what_a_node_reports_of_its_backend(browser: webdriver.Chrome) -> None:
    """A stalled report ejects the provider: its health cell says so, with the node's reason as the
    tooltip; a ready report of the backend's own 1 slot shows beside the configured capacity."""
    admission = Admission(pool())
    generation = admission.connect(GPU0.node_id)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            url, _ = await serve_page(
                nursery, admission, UiConfig(enabled=True, viewer_token=VIEWER, update_interval_ms=250)
            )
            await run(browser.get, f"{url}/ui?token={VIEWER}")
            admission.report_health(
                GPU0, ProviderReport("stalled", "no byte from the backend for 6.0 s", None, generation)
            )
            await shows(browser, lambda b: gpu0_cells(b)[2].startswith("ejected"), 10)
            health = await run(lambda: browser.find_element(By.CSS_SELECTOR, "#providers tbody tr td:nth-child(3)"))
            assert (await run(lambda: health.text)).endswith("· stalled")
            assert await run(health.get_attribute, "title") == "stalled: no byte from the backend for 6.0 s"
            admission.report_health(GPU0, ProviderReport("ready", "", 1, generation))
            await shows(browser, lambda b: gpu0_cells(b)[3] == "0 / 2 (backend 1)", 10)
            nursery.cancel_scope.cancel()
