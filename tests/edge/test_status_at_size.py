"""``/status`` filters and per-node metrics, for large fleets.

[status-at-size] ``/status?node=`` and ``/status?model=`` return only that part;
``metrics_per_provider: false`` labels the provider gauges by node only.
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import time
import weakref
from pathlib import Path

import attrs
import cattrs
import pytest
import trio
import trio.testing

from edge.harness import BIG, FAST, EdgeLayout, fake_node, running_edge
from iop_admission import (
    PROVIDER_FIELDS,
    Admission,
    ModelGroup,
    PoolConfig,
    ProviderKey,
    ProviderSnapshot,
    ProviderSpec,
    QueuePolicy,
)
from iop_edge import EdgeService, release_in_slices, rows_in_slices, snapshot_in_slices
from iop_edge.config import load_edge_config
from iop_edge.metrics import EdgeMetrics
from iop_edge.status import (
    EdgeStatus,
    NodeStatus,
    OverloadStatus,
    StatusRows,
    parse_status,
    status_document,
    status_json,
    status_json_rows,
)
from iop_io import off_loop, paced, run_in_turns, run_off_loop, yield_to_loop
from iop_io.off_loop import SWITCH_INTERVAL

OVERLOAD = OverloadStatus(
    shedding=False,
    loop_lag_ms=0.5,
    open_connections=2,
    refused_connections=0,
    shed_requests=0,
    waiting=0,
    service_time_ms=1000.0,
)


def _admission(providers: int) -> Admission:
    keys = [ProviderKey(f"node-{i}", "p0") for i in range(providers)]
    return Admission(
        PoolConfig(
            policy=QueuePolicy(max_queue=8, queue_timeout=5.0),
            providers={key: ProviderSpec(capacity=2) for key in keys},
            models={"all": ModelGroup(candidates=tuple(keys))},
        )
    )


def _keys(document: dict[str, object]) -> tuple[list[tuple[str, str]], list[str]]:
    providers = document["providers"]
    nodes = document["nodes"]
    assert isinstance(providers, list) and isinstance(nodes, list)
    return [(p["node_id"], p["provider_id"]) for p in providers], [n["node_id"] for n in nodes]


@pytest.mark.req("status-at-size")
async def test_status_filters_by_node_and_by_model(tmp_path: Path) -> None:
    """[status-at-size] ?node= keeps that node and its providers; ?model= the providers the key
    lists and their nodes; both: the intersection; an unknown id: empty lists, 200."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge):

            async def get(query: str) -> tuple[list[tuple[str, str]], list[str]]:
                response = await edge.http.get(f"/status{query}")
                assert response.status_code == 200
                return _keys(response.json())

            assert await get("") == ([("node-a", "gpu0"), ("node-b", "gpu1")], ["node-a", "node-b"])
            assert await get("?node=node-b") == ([("node-b", "gpu1")], ["node-b"])
            assert await get(f"?model={FAST}") == ([("node-a", "gpu0")], ["node-a"])
            assert await get(f"?model={BIG}&node=node-a") == ([("node-a", "gpu0")], ["node-a"])
            assert await get("?model=nope") == ([], [])
            assert await get("?node=nope") == ([], [])
            filtered = (await edge.http.get("/status?node=node-a")).json()
            assert filtered["nodes"][0]["connected"] is True
            assert filtered["queue_depth"] == 0


def _spans_yaml(providers: dict[str, int]) -> str:
    """An ``edge.yaml`` whose nodes carry ``providers[node]`` providers each; model ``m`` lists them all."""
    lines = ["listen: 127.0.0.1:0", "node_listen: 127.0.0.1:0", "admin_token: admin-secret-token", "nodes:"]
    for node, count in providers.items():
        lines += [f"  - id: {node}", f"    token: {node}-token-0123456789", "    providers:" + ("" if count else " []")]
        lines += [f"      - {{id: p{i}, capacity: {i + 1}}}" for i in range(count)]
    lines += ["models:", "  - id: m", "    candidates:"]
    lines += [f"      - {{node: {node}, provider: p{i}}}" for node, count in providers.items() for i in range(count)]
    return "\n".join(lines) + "\n"


@pytest.mark.req("status-at-size")
async def test_status_of_one_node_reads_its_rows_only_and_is_the_filtered_whole(tmp_path: Path) -> None:
    """[status-at-size] ``?node=`` reads only that node's providers (its span of the pool's order),
    and gets exactly the rows the whole status filtered by node gives, for nodes with two, none
    and three providers and an unknown one; after a reload that lengthens the first node (every
    span after it moves), still."""
    path = tmp_path / "edge.yaml"
    path.write_text(_spans_yaml({"a": 2, "b": 0, "c": 3}))
    service = EdgeService(load_edge_config(path), config_path=path)
    for layout in ({"a": 2, "b": 0, "c": 3}, {"a": 4, "b": 0, "c": 3}):
        path.write_text(_spans_yaml(layout))
        assert await service.reload() == []
        whole = await service.status_rows()
        for node in ("a", "b", "c", "nope"):
            part = await service.status_rows(node=node)
            assert part.providers == [r for r in whole.providers if r["node_id"] == node]
            assert [r["provider_id"] for r in part.providers] == [f"p{i}" for i in range(layout.get(node, 0))]
            assert [r["node_id"] for r in part.nodes] == ([node] if node in layout else [])
            assert part.snapshot == whole.snapshot
        assert service.config.provider_span("c") == (layout["a"], 3)


@pytest.mark.req("status-at-size")
async def test_node_rows_are_what_cattrs_makes_of_the_node_status(tmp_path: Path) -> None:
    """[status-at-size] the registry's plain node rows (what ``/status`` writes) are what cattrs
    makes of :class:`NodeStatus` objects, field for field and in field order, for a connected
    node and one never connected; an unknown id is a never-connected node."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge, fake_node(edge):
            registry = edge.service.registry
            ids = ["node-a", "node-b", "nope"]
            rows = registry.node_rows(ids)
            converter = cattrs.Converter(forbid_extra_keys=True)
            objects = converter.structure(rows, list[NodeStatus])
            assert converter.unstructure(objects, list[NodeStatus]) == rows
            assert [list(row) for row in rows] == [[f.name for f in attrs.fields(NodeStatus)]] * 3
            assert [(r["connected"], r["generation"], r["last_heartbeat_age"] is None) for r in rows] == [
                (True, 1, False),
                (False, 0, True),
                (False, 0, True),
            ]


@pytest.mark.req("status-at-size")
async def test_metrics_per_node_instead_of_per_provider(tmp_path: Path) -> None:
    """[status-at-size] metrics_per_provider: false -> one series per node and gauge."""
    layout = EdgeLayout(extra=("metrics_per_provider: false",))
    with trio.fail_after(10):
        async with running_edge(tmp_path, layout) as edge, fake_node(edge):
            text = (await edge.http.get("/metrics")).text
            assert 'iop_capacity{node="node-a"} 1.0' in text
            assert 'iop_connected{node="node-a"} 1.0' in text
            assert 'iop_connected{node="node-b"} 0.0' in text
            assert 'provider="gpu0"' not in text
        async with running_edge(tmp_path) as edge:
            assert 'iop_capacity{node="node-a",provider="gpu0"} 1.0' in (await edge.http.get("/metrics")).text


@pytest.mark.req("status-at-size")
async def test_metrics_edge_wide_instead_of_per_node(tmp_path: Path) -> None:
    """[status-at-size] metrics_per_node: false -> one series per gauge, summed over every provider;
    no series carries a node's or provider's name, not even the node counters."""
    layout = EdgeLayout(extra=("metrics_per_node: false",))
    with trio.fail_after(10):
        async with running_edge(tmp_path, layout) as edge, fake_node(edge):
            text = (await edge.http.get("/metrics")).text
            assert "\niop_capacity 2.0\n" in text  # node-a/gpu0 and node-b/gpu1, capacity 1 each
            assert "\niop_connected 1.0\n" in text  # only node-a is connected
            assert 'iop_node_connects_total{node=""} 1.0' in text
            assert "iop_generation" not in text
            assert "node-a" not in text and "gpu0" not in text


@pytest.mark.req("status-at-size")
@pytest.mark.parametrize("providers", [0, 1, 3, 450])
def test_status_json_is_the_status_document_in_compact_json(providers: int) -> None:
    """[status-at-size] the body written a run of items at a time is byte for byte the compact
    JSON of the document (the contract ``iop status`` reads back), empty lists and runs that
    do not fill a call included; the document's rows are what cattrs makes of them."""
    admission = _admission(max(providers, 1))
    admission.connect("node-0")
    snapshot = admission.snapshot(count=providers)
    nodes = tuple(NodeStatus(f"nöde-{i}", i % 2 == 0, i, 0.25 * i if i % 2 else None, i) for i in range(providers))
    status = EdgeStatus(snapshot, nodes, OVERLOAD)
    body = status_json(status)
    document = status_document(status)
    assert body == json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()
    assert parse_status(json.loads(body)) == status
    plain = cattrs.Converter()
    assert document["providers"] == plain.unstructure(snapshot.providers, list[ProviderSnapshot])
    assert document["nodes"] == plain.unstructure(nodes, list[NodeStatus])


@pytest.mark.req("status-at-size")
async def test_status_written_from_rows_is_the_status_of_the_objects() -> None:
    """[status-at-size] the providers read as plain rows (in slices) are what cattrs makes of the
    snapshot's objects, and the body written from them is the body of the objects, byte for byte;
    a provider with a lease and one disconnected included."""
    admission = _admission(7)
    for i in range(6):
        admission.connect(f"node-{i}")
    async with admission.lease("all"):
        head, rows = await rows_in_slices(admission, size=3)
        snapshot = admission.snapshot()
    assert head == attrs.evolve(snapshot, providers=())
    assert rows == cattrs.Converter().unstructure(snapshot.providers, list[ProviderSnapshot])
    assert [list(row) for row in rows] == [list(PROVIDER_FIELDS)] * 7
    nodes = tuple(NodeStatus(f"node-{i}", i < 6, 1, 0.5 if i < 6 else None, 0) for i in range(7))
    status = StatusRows(head, rows, cattrs.Converter().unstructure(nodes, list[NodeStatus]), OVERLOAD)
    assert status.model() == EdgeStatus(snapshot, nodes, OVERLOAD)
    assert status_json_rows(status) == status_json(status.model())


@pytest.mark.req("status-at-size")
def test_status_json_spells_tiny_floats_differently_but_keeps_their_value() -> None:
    """[status-at-size] a heartbeat age of 10 us is written ``0.00001`` (the json module writes
    ``1e-05``): the same number, read back the same."""
    admission = _admission(1)
    status = EdgeStatus(admission.snapshot(), (NodeStatus("node-0", True, 1, 1e-05, 0),), OVERLOAD)
    body = status_json(status)
    assert b'"last_heartbeat_age":0.00001,' in body
    assert json.loads(body) == status_document(status)
    assert parse_status(json.loads(body)) == status


@pytest.mark.req("status-at-size")
async def test_metrics_written_off_the_loop_read_the_state_at_the_call() -> None:
    """[status-at-size] render_off_loop gives what render gives, read when it was called: a lease
    granted while the text is being written does not show in it."""
    admission = _admission(2)
    metrics = EdgeMetrics(admission)
    metrics.follow_front_door(lambda: OVERLOAD)
    with trio.fail_after(10):
        expected, content_type = metrics.render()
        body, off_loop_type = await metrics.render_off_loop()
        assert (body, off_loop_type) == (expected, content_type)
        assert 'iop_in_flight{node="node-0",provider="p0"} 0.0' in body.decode()
        admission.connect("node-0")
        rendered: list[bytes] = []
        async with trio.open_nursery() as nursery:

            async def scrape() -> None:
                rendered.append((await metrics.render_off_loop())[0])

            nursery.start_soon(scrape)
            await trio.testing.wait_all_tasks_blocked()  # the scrape has its reading and waits for its thread
            async with admission.lease("all"):
                assert 'iop_in_flight{node="node-0",provider="p0"} 1.0' in metrics.render()[0].decode()
                while not rendered:
                    await trio.sleep(0.001)
        (text,) = [body.decode() for body in rendered]
        assert 'iop_connected{node="node-0",provider="p0"} 1.0' in text
        assert 'iop_in_flight{node="node-0",provider="p0"} 0.0' in text


@pytest.mark.req("reload-off-loop")
async def test_off_loop_work_shortens_the_switch_interval_and_pauses_gc_until_the_last_ends() -> None:
    """[reload-off-loop] while any off-loop work runs: short GIL switch interval, no automatic
    garbage collection; both restored when the last of two overlapping pieces ends."""
    switch, collecting = sys.getswitchinterval(), gc.isenabled()
    first_may_end, second_may_end = trio.Event(), trio.Event()
    seen: list[tuple[float, bool]] = []

    def work(may_end: trio.Event) -> None:
        seen.append((sys.getswitchinterval(), gc.isenabled()))
        trio.from_thread.run(may_end.wait)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_off_loop, lambda: work(first_may_end))
            nursery.start_soon(run_off_loop, lambda: work(second_may_end))
            while len(seen) < 2:
                await trio.sleep(0.001)
            first_may_end.set()
            await trio.sleep(0.01)
            assert (sys.getswitchinterval(), gc.isenabled()) == (min(switch, SWITCH_INTERVAL), False)
            second_may_end.set()
    assert seen == [(min(switch, SWITCH_INTERVAL), False)] * 2
    assert (sys.getswitchinterval(), gc.isenabled()) == (switch, collecting)


@pytest.mark.req("status-at-size")
@pytest.mark.parametrize("size", [1, 2, 3, 500])
async def test_snapshot_read_in_slices_is_the_whole_snapshot(size: int) -> None:
    """[status-at-size] slices of any size, joined, are the snapshot read in one go (nothing
    changed meanwhile); snapshot(first=, count=) lists exactly those positions."""
    admission = _admission(5)
    admission.connect("node-3")
    whole = admission.snapshot()
    assert await snapshot_in_slices(admission, size) == whole
    assert admission.snapshot(first=1, count=2).providers == whole.providers[1:3]
    assert admission.snapshot(first=4, count=10).providers == whole.providers[4:]


@pytest.mark.req("status-at-size")
async def test_a_refresh_between_slices_starts_the_reading_again() -> None:
    """[status-at-size] rows are never mixed from two configs: a refresh after the first slice
    makes the reading start over, under the new config (here 3 providers instead of 5)."""
    admission = _admission(5)
    smaller = _admission(3).config

    class RefreshedAfterFirstSlice:
        reads = 0

        @property
        def config(self) -> PoolConfig:
            return admission.config

        def snapshot(self, **window: int) -> object:
            self.reads += 1
            taken = admission.snapshot(**window)
            if self.reads == 1:
                admission.refresh(smaller)
            return taken

    reader = RefreshedAfterFirstSlice()
    snapshot = await snapshot_in_slices(reader, 2)  # type: ignore[arg-type]
    assert snapshot == admission.snapshot()
    assert [p.node_id for p in snapshot.providers] == ["node-0", "node-1", "node-2"]
    assert reader.reads == 3  # one slice of the old config, then two of the new


@pytest.mark.req("reload-off-loop")
async def test_objects_kept_from_off_loop_work_join_the_oldest_generation() -> None:
    """[reload-off-loop] what a reload made is not left young (a young collection over a
    10,000-node config would hold the loop): it is in the oldest generation afterwards, still
    collectable (nothing stays frozen)."""
    assert gc.isenabled()  # as in any process that does not turn it off
    with trio.fail_after(10):
        kept = await run_off_loop(lambda: [[index] for index in range(100)], keeps_objects=True)
    assert gc.get_freeze_count() == 0
    oldest = {id(obj) for obj in gc.get_objects(generation=2)}
    assert id(kept) in oldest and all(id(item) in oldest for item in kept)


@pytest.mark.req("reload-off-loop")
async def test_off_loop_work_waits_at_yield_to_loop_while_the_loop_runs_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    """[reload-off-loop] work that calls yield_to_loop() waits there while the loop has tasks to
    run (here: one that never waits), and goes on once the loop waits for I/O."""
    monkeypatch.setattr(off_loop, "MAX_PAUSE", 60.0)  # the test's bound, not the pause's
    entered, passed = threading.Event(), threading.Event()

    def work() -> None:
        entered.set()
        yield_to_loop()
        passed.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_off_loop, work)
            while not entered.is_set():
                await trio.lowlevel.checkpoint()
            for _ in range(1000):
                await trio.lowlevel.checkpoint()
                yield_to_loop()  # on the loop's own thread: returns at once
            assert not passed.is_set()
        assert passed.is_set()  # the nursery waited for the work, the loop waiting for I/O


@pytest.mark.req("reload-off-loop")
async def test_off_loop_work_goes_on_when_the_loop_is_never_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """[reload-off-loop] a loop that always has a task to run does not stop the work for good:
    each yield_to_loop() waits at most MAX_PAUSE, then the work runs on a while."""
    monkeypatch.setattr(off_loop, "MAX_PAUSE", 0.001)
    done = threading.Event()

    def work() -> int:
        for _ in range(100):
            yield_to_loop()
        done.set()
        return 100

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_off_loop, work)
            while not done.is_set():
                await trio.lowlevel.checkpoint()


def test_yield_to_loop_outside_off_loop_work_returns_at_once() -> None:
    """Called anywhere but in work run by run_off_loop (a plain thread here) it does nothing."""
    calls: list[None] = []
    thread = threading.Thread(target=lambda: calls.extend(None for _ in paced(range(3))))
    thread.start()
    thread.join(10)
    assert calls == [None] * 3


async def _ticking(ticks: list[int]) -> None:
    """Count the loop's turns (this task's steps) in ``ticks[0]``."""
    while True:
        ticks[0] += 1
        await trio.lowlevel.checkpoint()


@pytest.mark.req("reload-off-loop")
async def test_work_in_turns_runs_only_while_the_loop_waits_for_it() -> None:
    """[reload-off-loop] run_in_turns: the loop runs nothing while a slice of the work runs (here a
    slice that sleeps without the GIL: the loop could run, and does not), gives the loop a turn
    after each slice (one checkpoint), and returns the work's result."""
    ticks = [0]
    during: list[int] = []
    steps: list[str] = []
    results: list[str] = []

    def work() -> str:
        for _ in range(5):
            before = ticks[0]
            time.sleep(0.01)  # without the GIL
            during.append(ticks[0] - before)
            yield_to_loop()
        return "done"

    class Steps(trio.abc.Instrument):
        def before_task_step(self, task: trio.lowlevel.Task) -> None:
            if task.name.endswith("in_turns"):
                steps.append(task.name)

    async def in_turns(nursery: trio.Nursery) -> None:
        results.append(await run_in_turns(work))
        nursery.cancel_scope.cancel()

    instrument = Steps()
    trio.lowlevel.add_instrument(instrument)
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_ticking, ticks)
                nursery.start_soon(in_turns, nursery)
    finally:
        trio.lowlevel.remove_instrument(instrument)
    assert results == ["done"]
    assert during == [0] * 5
    assert len(steps) == 6  # its first step, then one after the loop's turn following each slice
    assert ticks[0] >= 1


@pytest.mark.req("reload-off-loop")
async def test_work_in_turns_raises_what_the_work_raises() -> None:
    """[reload-off-loop] an exception of the work comes out of run_in_turns on the loop."""

    def work() -> None:
        yield_to_loop()
        raise ValueError("bad file")

    with trio.fail_after(10), pytest.raises(ValueError, match="bad file"):
        await run_in_turns(work)


@pytest.mark.req("reload-off-loop")
async def test_work_in_turns_cancelled_stops_at_its_next_turn() -> None:
    """[reload-off-loop] cancelled, run_in_turns returns at once; the work stops where it waits for
    its next turn (its clean-up runs), and nothing is left running."""
    ended = threading.Event()
    slices: list[int] = []

    def work() -> None:
        try:
            while True:
                slices.append(1)
                yield_to_loop()
        finally:
            ended.set()

    with trio.fail_after(10):
        with trio.move_on_after(0.05):
            await run_in_turns(work)
        assert await trio.to_thread.run_sync(ended.wait, 10)  # its loop is over
    assert slices


class _Leaf:
    __slots__ = ("__weakref__",)


async def _freed_per_step(holder: list[object], refs: list[weakref.ref[_Leaf]], size: int) -> list[int]:
    """Run ``release_in_slices(holder, size)`` in a task of its own; how many of ``refs``' objects
    each of its steps freed."""
    freed = [0]
    for ref in refs:
        weakref.finalize(ref(), lambda: freed.__setitem__(0, freed[0] + 1))
    steps: list[int] = []

    class Steps(trio.abc.Instrument):
        def before_task_step(self, task: trio.lowlevel.Task) -> None:
            self.before = freed[0]

        def after_task_step(self, task: trio.lowlevel.Task) -> None:
            if task.name.endswith("releasing"):
                steps.append(freed[0] - self.before)

    async def releasing() -> None:
        await release_in_slices(holder, size=size)

    instrument = Steps()
    trio.lowlevel.add_instrument(instrument)
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(releasing)
    finally:
        trio.lowlevel.remove_instrument(instrument)
    assert holder == [] and freed[0] == len(refs) and all(ref() is None for ref in refs)
    return steps


@pytest.mark.req("reload-off-loop")
async def test_release_in_slices_frees_a_big_structure_a_slice_per_turn() -> None:
    """[reload-off-loop] the old config is freed a slice per loop turn: no turn frees more than the
    slice size (plus the few objects around the big containers), and in the end everything is."""
    leaves = [_Leaf() for _ in range(5000)]
    refs = [weakref.ref(leaf) for leaf in leaves]
    holder: list[object] = [{"leaves": tuple(leaves), "by_id": {id(leaf): leaf for leaf in leaves}, "one": [leaves[0]]}]
    del leaves
    steps = await _freed_per_step(holder, refs, 1000)
    assert max(steps) <= 1000 and len(steps) >= 6


@pytest.mark.req("reload-off-loop")
async def test_release_in_slices_walks_and_frees_small_containers_a_slice_per_turn() -> None:
    """[reload-off-loop] a structure whose containers are all smaller than a slice (a config of
    1,000 nodes) is walked and freed a slice per loop turn too: it was freed in one step
    (10-25 ms of the loop at 1,000 nodes)."""
    groups = [(_Leaf(), [_Leaf() for _ in range(400)]) for _ in range(10)]
    refs = [weakref.ref(leaf) for one, many in groups for leaf in (one, *many)]
    holder: list[object] = [{"groups": groups}]
    del groups
    steps = await _freed_per_step(holder, refs, 1000)
    assert max(steps) <= 1000 and len(steps) >= 2 * len(refs) // 1000
