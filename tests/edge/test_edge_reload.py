"""Live config refresh of a running Edge: POST /admin/reload and EdgeService.reload().

[refresh-consistency] [cross-model-tests]: the YAML file in ``tmp_path`` is
rewritten while requests of both model keys are queued or running on the
shared provider ``node-a/gpu0``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import attrs
import httpx
import pytest
import trio
import trio.testing

from edge.harness import ADMIN_TOKEN, BIG, FAST, Edge, EdgeLayout, eventually, fake_node, running_edge, start_chat
from iop_edge import _service

ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}

RELOADS_WITHIN = 60
"""A generous bound on a test of reloads: each reload runs the config reader in its own process, niced,
which a loaded machine starts slowly."""


async def _reload(edge: Edge, layout: EdgeLayout) -> None:
    edge.rewrite(layout)
    response = await edge.http.post("/admin/reload", headers=ADMIN)
    assert response.status_code == 200, response.text
    assert response.json() == {"status": "reloaded"}


@pytest.mark.req("refresh-consistency")
async def test_capacity_up_dispatches_queued_waiter_at_once(tmp_path: Path) -> None:
    """[refresh-consistency] raising gpu0's capacity grants the queued request of the other key at once."""
    with trio.fail_after(RELOADS_WITHIN):
        async with running_edge(tmp_path) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, "first", BIG)
                first = await node.next_run()
                start_chat(nursery, edge, results, "second", FAST)
                await eventually(lambda: edge.queue_depth == 1)
                await _reload(edge, EdgeLayout(gpu0_capacity=2, gpu0_long_capacity=1))
                second = await node.next_run()  # while the first still runs
                assert edge.provider("node-a", "gpu0")["in_flight"] == 2
                await node.answer(second)
                await node.answer(first)
            assert {r.status_code for r in results.values()} == {200}
            await edge.assert_drained()


@pytest.mark.req("reload-off-loop")
async def test_an_applied_reload_logs_each_step_and_the_worker_cpu(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """[reload-off-loop] a reload that applied logs each step's time, the CPU time its reader
    process used (parse, pool and lookups) and its worker thread's (prepare and certificates)."""
    caplog.set_level(logging.INFO, logger="iop_edge")
    with trio.fail_after(RELOADS_WITHIN):
        async with running_edge(tmp_path) as edge:
            await _reload(edge, EdgeLayout())
    (line,) = [record.getMessage() for record in caplog.records if "config reloaded" in record.getMessage()]
    steps = ("read", "rebuild", "prepare", "tls", "refresh", "swap", "release", "reader CPU", "worker CPU")
    assert re.fullmatch(
        r"config reloaded from \S+ \(" + ", ".join(f"{step} [0-9]+\\.[0-9] ms" for step in steps) + r"\)", line
    ), line


@pytest.mark.req("refresh-consistency")
async def test_capacity_down_keeps_running_and_blocks_new(tmp_path: Path) -> None:
    """[refresh-consistency] lowering capacity below in-flight keeps both running requests; a new
    one waits until in-flight falls below the new capacity."""
    with trio.fail_after(RELOADS_WITHIN):
        async with running_edge(tmp_path, EdgeLayout(gpu0_capacity=2)) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, "a", BIG)
                start_chat(nursery, edge, results, "b", FAST)
                runs = [await node.next_run(), await node.next_run()]
                edge.rewrite(EdgeLayout(gpu0_capacity=1))
                assert await edge.service.reload() == []
                assert edge.provider("node-a", "gpu0")["capacity"] == 1
                assert edge.provider("node-a", "gpu0")["in_flight"] == 2
                start_chat(nursery, edge, results, "c", FAST)
                await eventually(lambda: edge.queue_depth == 1)
                await node.answer(runs[0])
                done = runs[0].body["messages"][0]["content"]  # "a" or "b": they race
                await eventually(lambda: done in results)
                await trio.testing.wait_all_tasks_blocked()
                assert edge.queue_depth == 1  # in_flight 1 is not below capacity 1
                await node.answer(runs[1])
                third = await node.next_run()
                assert third.body["messages"][0]["content"] == "c"
                await node.answer(third)
            assert {r.status_code for r in results.values()} == {200}
            await edge.assert_drained()


@pytest.mark.req("refresh-consistency")
async def test_disable_and_enable(tmp_path: Path) -> None:
    """[refresh-consistency] disabling gpu0: its running request is kept, the waiter with no other
    candidate is answered unavailable at once; re-enabling brings gpu0 back for new requests."""
    with trio.fail_after(RELOADS_WITHIN):
        async with running_edge(tmp_path, EdgeLayout(queue_timeout_ms=600_000)) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, "running", BIG)
                running = await node.next_run()
                start_chat(nursery, edge, results, "waiter", FAST)
                await eventually(lambda: edge.queue_depth == 1)
                edge.rewrite(EdgeLayout(gpu0_enabled=False, queue_timeout_ms=600_000))
                assert await edge.service.reload() == []
                await eventually(lambda: "waiter" in results)
                assert results["waiter"].status_code == 503
                assert results["waiter"].json()["error"]["code"] == "unavailable"
                gpu0 = edge.provider("node-a", "gpu0")
                assert (gpu0["status"], gpu0["in_flight"]) == ("disabled", 1)
                await node.answer(running)
            assert results["running"].status_code == 200
            assert (await edge.chat(FAST)).status_code == 503
            await _reload(edge, EdgeLayout(queue_timeout_ms=600_000))
            assert edge.provider("node-a", "gpu0")["status"] == "available"
            async with trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, "again", FAST)
                await node.answer(await node.next_run())
            assert results["again"].status_code == 200
            await edge.assert_drained()


@pytest.mark.req("refresh-consistency", "queue-ownership")
async def test_new_queue_timeout_applies_to_queued_waiters(tmp_path: Path) -> None:
    """[refresh-consistency] [queue-ownership] a shorter queue timeout applies to a waiter already
    queued (deadline = enqueue time + new timeout): it gets 429 queue_timeout."""
    with trio.fail_after(RELOADS_WITHIN):
        async with running_edge(tmp_path, EdgeLayout(queue_timeout_ms=600_000)) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, "running", BIG)
                running = await node.next_run()
                start_chat(nursery, edge, results, "waiter", FAST)
                await eventually(lambda: edge.queue_depth == 1)
                await _reload(edge, EdgeLayout(queue_timeout_ms=150))
                await eventually(lambda: "waiter" in results)
                await node.answer(running)
            waiter = results["waiter"]
            assert waiter.status_code == 429
            assert waiter.json()["error"]["code"] == "queue_timeout"
            assert waiter.headers["retry-after"] == "1"
            assert (await edge.status())["queue_timeout"] == 0.15
            await edge.assert_drained()


@pytest.mark.req("refresh-consistency", "queue-ownership")
async def test_lower_max_queue_applies_to_new_requests(tmp_path: Path) -> None:
    """[refresh-consistency] [queue-ownership] max_queue lowered to 1 with one waiter queued: the
    waiter stays, the next request of either key gets 429 queue_full."""
    with trio.fail_after(RELOADS_WITHIN):
        async with running_edge(tmp_path) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, "running", BIG)
                running = await node.next_run()
                start_chat(nursery, edge, results, "waiter", FAST)
                await eventually(lambda: edge.queue_depth == 1)
                await _reload(edge, EdgeLayout(max_queue=1))
                for model in (BIG, FAST):
                    full = await edge.chat(model)
                    assert full.status_code == 429
                    assert full.json()["error"]["code"] == "queue_full"
                    assert full.headers["retry-after"] == "1"
                assert edge.queue_depth == 1
                await node.answer(running)
                await node.answer(await node.next_run())
            assert results["waiter"].status_code == 200
            await edge.assert_drained()


@pytest.mark.req("refresh-consistency")
async def test_invalid_file_rejected_with_every_error(tmp_path: Path) -> None:
    """[refresh-consistency] an invalid file: 400 config_rejected listing every error; nothing changes."""
    with trio.fail_after(RELOADS_WITHIN):
        async with running_edge(tmp_path) as edge, fake_node(edge) as node:
            before = edge.service.admission.snapshot()
            config_before = edge.service.config
            text = EdgeLayout().yaml()
            text = text.replace("capacity: 1, long_context_capacity: 1", "capacity: 0, long_context_capacity: 1", 1)
            text = text.replace("heartbeat_timeout_ms: 15000", "heartbeat_timeout_ms: 50")
            text = text.replace("provider_pool: {max_queue: 8,", "provider_pool: {max_queue: -1,")
            edge.config_path.write_text(text)
            response = await edge.http.post("/admin/reload", headers=ADMIN)
            assert response.status_code == 400
            body = response.json()
            assert body["error"]["code"] == "config_rejected"
            assert response.headers["x-iop-reject-reason"] == "config_rejected"
            errors = body["errors"]
            joined = "\n".join(errors)
            assert len(errors) >= 3, errors
            assert "heartbeat_timeout_ms" in joined
            assert "max_queue" in joined
            assert "capacity" in joined
            assert all(str(edge.config_path) in error for error in errors)
            assert edge.service.admission.snapshot() == before
            assert edge.service.config is config_before
            # the old config still serves
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, "still", FAST)
                await node.answer(await node.next_run())
            assert results["still"].status_code == 200
            # service.reload() reports the same errors
            assert await edge.service.reload() == errors
            # an unknown key is reported with its line
            edge.config_path.write_text(EdgeLayout().yaml() + "bogus_key: 1\n")
            response = await edge.http.post("/admin/reload", headers=ADMIN)
            assert response.status_code == 400
            assert any("bogus_key" in error for error in response.json()["errors"])
            assert edge.service.config is config_before


async def test_reload_endpoint_auth(tmp_path: Path) -> None:
    """/admin/reload: 401 for a wrong or missing bearer; 404 when no admin_token is configured."""
    with trio.fail_after(RELOADS_WITHIN):
        async with running_edge(tmp_path) as edge:
            for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": ADMIN_TOKEN}):
                response = await edge.http.post("/admin/reload", headers=headers)
                assert response.status_code == 401
                assert response.json()["error"]["code"] == "unauthorized"
        async with running_edge(tmp_path, EdgeLayout(admin_token=None)) as edge:
            response = await edge.http.post("/admin/reload", headers=ADMIN)
            assert response.status_code == 404


@pytest.mark.req("reload-off-loop")
async def test_reload_reads_off_the_loop_and_reloads_are_serialized(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """[reload-off-loop] while a reload reads the file (held after its reader process ran) the Edge
    answers requests; a second reload waits for the first, then reads the file itself (the new
    capacity); both apply."""
    real_read = _service.run_reader
    first_read, release_first = trio.Event(), trio.Event()
    reads: list[bytes] = []

    async def held_read(path: str) -> bytes:
        output = await real_read(path)
        reads.append(output)
        if len(reads) == 1:
            first_read.set()
            await release_first.wait()
        return output

    monkeypatch.setattr(_service, "run_reader", held_read)
    with trio.fail_after(60):
        async with running_edge(tmp_path) as edge:
            results: list[list[str]] = []

            async def reload() -> None:
                results.append(await edge.service.reload())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(reload)
                await first_read.wait()
                edge.rewrite(EdgeLayout(gpu0_capacity=3))
                nursery.start_soon(reload)
                # The loop serves while the first reload is held.
                assert (await edge.http.get("/healthz")).status_code == 200
                await trio.testing.wait_all_tasks_blocked()
                assert len(reads) == 1, "the second reload read before the first one ended"
                assert edge.provider("node-a", "gpu0")["capacity"] == 1
                release_first.set()
            assert results == [[], []]
            assert len(reads) == 2
            assert edge.provider("node-a", "gpu0")["capacity"] == 3


@pytest.mark.req("reload-off-loop")
async def test_reload_applies_whole_when_the_pool_was_refreshed_after_it_was_prepared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """[reload-off-loop] the pool's refresh is prepared against the config in force; if another
    refresh lands before it is applied, the reload still puts its file in force."""
    real_in_turns = _service.run_in_turns
    prepared, release = trio.Event(), trio.Event()

    async def held_in_turns(work: Callable[[], object]) -> object:
        result = await real_in_turns(work)
        prepared.set()
        await release.wait()
        return result

    monkeypatch.setattr(_service, "run_in_turns", held_in_turns)
    with trio.fail_after(60):
        async with running_edge(tmp_path) as edge:
            admission = edge.service.admission
            first = admission.config
            edge.rewrite(EdgeLayout(gpu0_capacity=3))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(edge.service.reload)
                await prepared.wait()
                spec = first.providers[next(iter(first.providers))]
                other = {key: attrs.evolve(spec, capacity=2) for key in first.providers}
                admission.refresh(attrs.evolve(first, providers=other))  # in force now: not what was prepared against
                release.set()
            assert edge.provider("node-a", "gpu0")["capacity"] == 3
            assert edge.service.config.pool_config() == admission.config


@pytest.mark.req("reload-off-loop")
@pytest.mark.parametrize("step", ["run_reader", "run_in_turns"])
async def test_reload_cancelled_while_reading_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """[reload-off-loop] a reload cancelled while its reader runs, or while it prepares the pool's
    changes, returns at once and applies nothing; the next reload works."""
    entered = trio.Event()

    async def held(*args: object) -> object:
        entered.set()
        await trio.sleep_forever()

    with trio.fail_after(60):
        async with running_edge(tmp_path) as edge:
            config_before = edge.service.config
            edge.rewrite(EdgeLayout(gpu0_capacity=3))
            with monkeypatch.context() as patch:
                patch.setattr(_service, step, held)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(edge.service.reload)
                    await entered.wait()
                    nursery.cancel_scope.cancel()
            assert edge.service.config is config_before
            assert await edge.service.reload() == []  # the lock was released
            assert edge.provider("node-a", "gpu0")["capacity"] == 3
