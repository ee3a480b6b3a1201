"""The live queue page shows what the operator configured, never what clients invent: 2,000
requests for made-up model names, answered 404 by a real Edge, leave the view's size as it was.

[queue-page]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from edge.harness import BIG, FAST, EdgeLayout, eventually, running_edge
from iop_edge.ui.view import ViewFilter

MADE_UP = 2000
CLIENTS = 8


def _made_up(i: int) -> str:
    return f"made-up-model-{i:05d}-<b>{'x' * 200}</b>"


def _without_recent(view: bytes) -> dict[str, Any]:
    """The view less its chart samples (they grow for five seconds after the start)."""
    document: dict[str, Any] = json.loads(view)
    del document["recent"]
    return document


@pytest.mark.req("queue-page")
async def test_made_up_model_names_never_reach_the_view(tmp_path: Path) -> None:
    """[queue-page] every refusal is counted, in one ``unknown_model`` row; no made-up name is kept
    or shown; the view (what every viewer is sent each update) keeps its size."""
    layout = EdgeLayout(extra=("ui: {enabled: true, viewer_token: v, update_interval_ms: 100}",))
    with trio.fail_after(120):
        async with running_edge(tmp_path, layout) as edge:
            page = edge.service.api.queue_page
            before = await page.view(ViewFilter())

            async def client(first: int) -> None:
                for i in range(first, MADE_UP, CLIENTS):
                    response = await edge.chat(_made_up(i), max_tokens=1)
                    assert response.status_code == 404
                    assert response.json()["error"]["code"] == "model_not_found"

            async with trio.open_nursery() as nursery:
                for first in range(CLIENTS):
                    nursery.start_soon(client, first)

            await eventually(lambda: page.memory.activity.unknown()["refusals"] == MADE_UP)
            after = await page.view(ViewFilter())
    assert b"made-up" not in after
    was, now = _without_recent(before), _without_recent(after)
    assert set(now["activity"]) <= {BIG, FAST}
    assert now["unknown_model"] == {"grants": 0, "refusals": MADE_UP}
    assert len(json.dumps(now)) - len(json.dumps(was)) <= len(str(MADE_UP))  # the count's digits, no more
