"""The queue page's memory: the chart series of the last minutes and the activity per model key,
bounded whatever clients send; kept by ``QueuePage.run`` from the Edge's start.

[queue-page]
"""

from __future__ import annotations

import json

import attrs
import pytest
import trio
import trio.testing

from iop_admission import Admission, ModelGroup, ModelNotFound, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy
from iop_edge import QueuePage
from iop_edge.config import UiConfig
from iop_edge.ui.history import HISTORY_SECONDS, RECENT, Activity, ChartHistory
from iop_edge.ui.parts import PageAlone
from iop_edge.ui.view import ViewFilter

GPU0 = ProviderKey("node-a", "gpu0")


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


@pytest.mark.req("queue-page")
def test_the_history_keeps_the_last_minutes_only():
    """[queue-page] one sample a second, numbered; the oldest go once five minutes are kept."""
    history = ChartHistory()
    for second in range(HISTORY_SECONDS + 50):
        history.add(second, 2 * second, 1, 0)
    samples = history.samples()
    assert len(history) == len(samples) == HISTORY_SECONDS
    assert samples[0] == (51, 50, 100, 1, 0)
    assert samples[-1] == (HISTORY_SECONDS + 50, HISTORY_SECONDS + 49, 2 * (HISTORY_SECONDS + 49), 1, 0)
    assert history.samples(RECENT) == samples[-RECENT:]
    assert ChartHistory().samples(RECENT) == []


@pytest.mark.req("queue-page")
def test_activity_has_a_row_per_configured_key_and_one_for_the_rest():
    """[queue-page] a made-up name never becomes a row: 2,000 of them are one ``unknown_model`` count;
    a key a reload removed is forgotten."""
    configured = {"fast", "big"}
    activity = Activity()
    activity.count("fast", True, configured)
    activity.count("fast", False, configured)
    activity.count("big", True, configured)
    for i in range(2000):
        activity.count(f"made-up-{i}-<script>", False, configured)
    activity.count(None, False, configured)
    assert activity.by_model() == {"fast": {"grants": 1, "refusals": 1}, "big": {"grants": 1, "refusals": 0}}
    assert activity.by_model("big") == {"big": {"grants": 1, "refusals": 0}}
    assert activity.unknown() == {"grants": 0, "refusals": 2001}
    assert (activity.grants, activity.refusals, len(activity)) == (2, 2002, 2)
    activity.keep_only({"fast"})
    assert activity.by_model() == {"fast": {"grants": 1, "refusals": 1}}
    activity.count("big", True, {"fast"})  # no longer configured: counted with the rest
    assert (len(activity), activity.unknown()["grants"]) == (1, 1)


async def _hold(admission: Admission, model: str) -> None:
    async with admission.lease(model):
        await trio.sleep_forever()


def _admission() -> Admission:
    return Admission(
        PoolConfig(
            policy=QueuePolicy(max_queue=10, queue_timeout=1e9),
            providers={
                GPU0: ProviderSpec(
                    capacity=1, long_context_capacity=1, context_window_tokens=8192, total_context_tokens=8192
                )
            },
            models={"m": ModelGroup(candidates=(GPU0,))},
        )
    )


@pytest.mark.req("queue-page")
async def test_the_page_remembers_from_the_start_and_only_while_enabled(autojump_clock: trio.testing.MockClock):
    """[queue-page] ``QueuePage.run`` samples once a second from the start, before any viewer: in
    flight, waiting, the second's grants and refusals; made-up model names are counted, never kept;
    a view carries the last samples; while the page is disabled nothing is kept."""
    admission = _admission()
    admission.connect(GPU0.node_id)
    parts = PageAlone(admission, UiConfig(enabled=True, viewer_token="v"))
    page = QueuePage(parts)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(page.run)
        await trio.sleep(2.5)
        nursery.start_soon(_hold, admission, "m")  # granted
        nursery.start_soon(_hold, admission, "m")  # waits
        for i in range(50):
            with pytest.raises(ModelNotFound):
                async with admission.lease(f"made-up-{i}"):
                    pass
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(1)
        assert [s[1:] for s in page.memory.history.samples()] == [(0, 0, 0, 0), (0, 0, 0, 0), (1, 1, 1, 50)]
        parts.ui = attrs.evolve(parts.ui, enabled=False)
        await trio.sleep(10)
        assert len(page.memory.history) == 3
        parts.ui = attrs.evolve(parts.ui, enabled=True)
        await trio.sleep(3.2)  # it sees the config at its next look (14 s), then samples at 15 and 16 s
        assert [s[0] for s in page.memory.history.samples()] == [1, 2, 3, 4, 5]
        # The view is built in a worker thread: the mock clock runs on meanwhile, so it is read last.
        recent = [list(sample) for sample in page.memory.history.samples(RECENT)]
        view = json.loads(await page.view(ViewFilter()))
        assert view["activity"] == {"m": {"grants": 1, "refusals": 0}}
        assert view["unknown_model"] == {"grants": 0, "refusals": 50}
        assert view["recent"] == recent  # the samples as the view was asked for
        assert "made-up" not in json.dumps(view)
        nursery.cancel_scope.cancel()


@pytest.mark.req("queue-page")
async def test_a_large_pool_is_read_every_few_seconds(autojump_clock: trio.testing.MockClock):
    """[queue-page] the in-flight total reads every provider: past 2,000 providers, every few
    seconds (4,001: every third sample), the last total kept between; waiting is exact every second."""
    keys = [ProviderKey(f"node-{i:05d}", "gpu0") for i in range(4001)]
    spec = ProviderSpec(capacity=1, long_context_capacity=1, context_window_tokens=8192, total_context_tokens=8192)
    admission = Admission(
        PoolConfig(
            policy=QueuePolicy(max_queue=10, queue_timeout=1e9),
            providers=dict.fromkeys(keys, spec),
            models={"m": ModelGroup(candidates=(keys[0],)), "all": ModelGroup(candidates=tuple(keys[1:]))},
        )
    )
    for key in keys:
        admission.connect(key.node_id)
    page = QueuePage(PageAlone(admission, UiConfig(enabled=True, viewer_token="v")))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(page.run)
        await trio.sleep(0.5)
        nursery.start_soon(_hold, admission, "all")
        await trio.sleep(1)
        nursery.start_soon(_hold, admission, "m")  # runs on node-00000
        nursery.start_soon(_hold, admission, "m")  # waits
        await trio.sleep(3)
        assert [s[1:3] for s in page.memory.history.samples()] == [(1, 0), (1, 1), (1, 1), (2, 1)]
        nursery.cancel_scope.cancel()
