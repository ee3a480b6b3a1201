"""The queue page on a wall screen, in a real headless Chromium.

[queue-page]: a busy fleet (long model names and node ids, many tenants, every wait reason,
offline nodes) at 1280, 1366, 1600, 1920 and 3840 wide, in the normal view and in wall mode:
no two visible tables, charts or key figures overlap, none runs past the viewport, the page
never scrolls sideways, no header is cut, and every cell cut short carries its whole text
in its tooltip (a reason: its whole sentence). Screenshots of both views at 1920x1080 go to ``docs/``.

The fleet is an admission core served by the Edge's own page app (:mod:`page_server`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from page_driver import link, run, shows
from page_server import serve_page
from screen import HEIGHT, WIDTH, set_viewport
from selenium import webdriver

from iop_admission import Admission, ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy, TenantSpec
from iop_edge.config import UiConfig

VIEWER = "viewer-wall-layout-sentinel"
DOCS = Path(__file__).resolve().parents[1] / "docs"
SIZES = ((1280, 720), (1366, 768), (1600, 900), (1920, 1080), (3840, 2160))
NODES = [
    ProviderKey(f"gpu-rack-{i // 8:02d}-node-{i:04d}.inference.west.example.internal", "nvidia-h100-80gb-slot-0")
    for i in range(24)
]
MODELS = [
    "meta-llama/Llama-3.3-70B-Instruct-Turbo-FP8-128k-context-for-the-support-assistant",
    "mistralai/Mixtral-8x22B-Instruct-v0.1-long-running-batch-summaries",
    "qwen2.5-coder-32b-instruct",
    "ornith:35b",
    "embeddings/bge-m3-multilingual-dense-sparse-colbert",
]
TENANTS = [f"tenant-{i:02d}-analytics-nightly-reports-eu-west-{'x' * (i % 5)}" for i in range(30)]
OFFLINE = 3  # the last nodes never connect


def busy_fleet() -> Admission:
    """24 providers of capacity 1 (the last three offline), five long-named model keys on
    overlapping providers, thirty long-named tenants in three bands, some with quotas."""
    models = {
        name: ModelGroup(candidates=tuple(NODES[(5 * i + j) % len(NODES)] for j in range(8)))
        for i, name in enumerate(MODELS)
    }
    tenants = tuple(
        TenantSpec(
            name,
            priority=i % 3,
            weight=1.0 + i % 4,
            max_in_flight=1 if i % 4 == 0 else None,
            max_queue=50 if i % 5 == 0 else None,
        )
        for i, name in enumerate(TENANTS)
    )
    spec = ProviderSpec(capacity=1, long_context_capacity=1, context_window_tokens=32768, total_context_tokens=32768)
    admission = Admission(
        PoolConfig(
            policy=QueuePolicy(max_queue=500, queue_timeout=1e9),
            providers=dict.fromkeys(NODES, spec),
            models=models,
            tenants=tenants,
        )
    )
    for key in NODES[: len(NODES) - OFFLINE]:
        admission.connect(key.node_id)
    return admission


async def hold(admission: Admission, model: str, tenant: str, long: bool) -> None:
    async with admission.lease(model, tenant=tenant, long=long):
        await trio.sleep_forever()


BOXES = """
const boxes = [];
for (const e of document.querySelectorAll("table, canvas, .figure")) {
  const r = e.getBoundingClientRect();
  if (!e.checkVisibility() || r.width === 0 || r.height === 0) continue;  // hidden, or in a closed <details>
  boxes.push({name: e.id || e.closest("[id]").id, left: r.left + scrollX, top: r.top + scrollY,
              right: r.right + scrollX, bottom: r.bottom + scrollY, spill: r.width - e.parentElement.clientWidth});
}
const bad = [];
for (const c of document.querySelectorAll("td, th")) {
  if (c.checkVisibility() && c.clientWidth < 2 * parseFloat(getComputedStyle(c).fontSize)) bad.push("squeezed: " + c.textContent);
  if (!c.checkVisibility() || c.scrollWidth <= c.clientWidth + 1) continue;
  const cut = getComputedStyle(c).whiteSpace === "nowrap" && c.tagName === "TD" && c.title !== "";
  if (!cut) bad.push(c.closest("table").id + ": " + c.textContent);
}
return {boxes, bad, inner: innerWidth, width: document.documentElement.clientWidth, scrollWidth: document.documentElement.scrollWidth,
        rows: document.querySelectorAll("#waiters tbody tr").length, tenants: document.querySelectorAll("#tenants tbody tr").length};
"""


def overlaps(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["left"] < b["right"] and b["left"] < a["right"] and a["top"] < b["bottom"] and b["top"] < a["bottom"]


def check_layout(found: dict[str, Any], width: int) -> None:
    """Nothing overlaps, nothing is past the viewport's sides (its scroll bar left out) or wider than
    its section, no column is squeezed under two characters, no cell spills out uncut."""
    boxes, inside = found["boxes"], found["width"]
    assert found["inner"] == width and found["scrollWidth"] <= inside, (found["scrollWidth"], inside)
    for box in boxes:
        assert box["left"] >= 0 and box["right"] <= inside + 0.5 and box["spill"] <= 0.5, box
    clashes = [(a["name"], b["name"]) for i, a in enumerate(boxes) for b in boxes[i + 1 :] if overlaps(a, b)]
    assert not clashes
    assert not found["bad"]


@pytest.mark.req("queue-page")
async def test_the_layout_holds_from_1280_to_3840_wide(browser: webdriver.Chrome) -> None:
    admission = busy_fleet()
    ui = UiConfig(enabled=True, viewer_token=VIEWER, update_interval_ms=500)
    with trio.fail_after(150):
        async with trio.open_nursery() as nursery:
            for i in range(90):  # 21 run, the rest wait: for every reason
                nursery.start_soon(
                    hold, admission, MODELS[i % len(MODELS)], TENANTS[(7 * i) % len(TENANTS)], i % 6 == 0
                )
                await trio.testing.wait_all_tasks_blocked()
            url, _ = await serve_page(nursery, admission, ui)
            for wall in (False, True):
                await run(browser.get, f"{url}/ui?token={VIEWER}" + ("&wall=1" if wall else ""))
                await shows(browser, lambda b: link(b) == "live", 15)
                for width, height in SIZES:
                    await run(set_viewport, browser, width, height)
                    found = await run(browser.execute_script, BOXES)
                    assert found["rows"] > 50 and found["tenants"] == len(TENANTS) + 1
                    check_layout(found, width)
                await run(set_viewport, browser, WIDTH, HEIGHT)
                await trio.sleep(1.2)  # the charts redraw at the new size with the next view
                await run(browser.save_screenshot, str(DOCS / ("ui-wall.png" if wall else "ui-busy.png")))
            nursery.cancel_scope.cancel()
