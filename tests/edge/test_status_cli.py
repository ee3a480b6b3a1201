"""``iop status``: provider table from ``GET /status``, --watch, and exit codes ([snapshot-source], [offline-snapshot]).

Most tests give the CLI an ``httpx.MockTransport``; one serves a real
admission snapshot from a tiny hypercorn (trio) app on 127.0.0.1 port 0, and
one connects to a closed port. Real-socket tests run the synchronous CLI in a
worker thread, bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import functools
import importlib.resources
import io
import json
import socket
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from rich.console import Console

from iop_admission import Admission, ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy, TenantSpec
from iop_edge import EdgeService, load_edge_config, status_cli
from iop_edge.status import EdgeStatus, NodeStatus, OverloadStatus, parse_status
from iop_edge.status import status_document as edge_status_document
from iop_edge.status_cli import main

GPU0 = ProviderKey("node-a", "gpu0")
GPU1 = ProviderKey("node-b", "gpu1")


def two_node_admission() -> Admission:
    """node-a/gpu0 (capacity 2, priority 5) connected; node-b/gpu1 configured but never connected."""
    spec = functools.partial(
        ProviderSpec, long_context_capacity=1, context_window_tokens=32768, total_context_tokens=32768
    )
    return Admission(
        PoolConfig(
            policy=QueuePolicy(max_queue=64, queue_timeout=30.0),
            providers={GPU0: spec(capacity=2, priority=5), GPU1: spec(capacity=1)},
            models={
                "ornith:35b": ModelGroup(candidates=(GPU0, GPU1)),
                "ornith-fast": ModelGroup(candidates=(GPU0,)),
            },
        )
    )


def status_document(admission: Admission, *, heartbeat_age: float = 0.5, active_runs: int = 0) -> dict[str, Any]:
    """What the Edge serves on /status for ``admission`` with nodes node-a and node-b."""
    nodes = tuple(
        NodeStatus(
            node_id=node,
            connected=admission.is_connected(node),
            generation=admission.generation(node),
            last_heartbeat_age=heartbeat_age if admission.is_connected(node) else None,
            active_runs=active_runs if admission.is_connected(node) else 0,
        )
        for node in ("node-a", "node-b")
    )
    overload = OverloadStatus(
        shedding=False,
        loop_lag_ms=0.4,
        open_connections=1,
        refused_connections=0,
        shed_requests=0,
        waiting=0,
        service_time_ms=1000.0,
    )
    return edge_status_document(EdgeStatus(admission.snapshot(), nodes, overload))


def recording_console() -> Console:
    return Console(record=True, width=120, file=io.StringIO(), color_system=None)


def serving(*documents: dict[str, Any]) -> tuple[httpx.MockTransport, list[httpx.Request]]:
    """A transport answering GET /status with ``documents`` in turn (the last one repeats)."""
    requests: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        requests.append(request)
        if request.url.path != "/status":
            return httpx.Response(404)
        return httpx.Response(200, json=documents[min(len(requests), len(documents)) - 1])

    return httpx.MockTransport(handle), requests


def rows(text: str) -> list[list[str]]:
    """The whitespace-split lines of the rendered output."""
    return [line.split() for line in text.splitlines()]


@pytest.mark.req("snapshot-source", "offline-snapshot")
def test_table_shows_every_provider_and_the_summary() -> None:
    """[snapshot-source] [offline-snapshot] one row per configured provider, offline ones included."""
    admission = two_node_admission()
    admission.connect("node-a")
    transport, requests = serving(status_document(admission, heartbeat_age=2.0, active_runs=3))
    console = recording_console()

    assert (
        main(["status", "--edge", "http://edge.test:8080/", "--api-key", "k1"], transport=transport, console=console)
        == 0
    )

    assert [str(r.url) for r in requests] == ["http://edge.test:8080/status"]
    assert requests[0].headers["authorization"] == "Bearer k1"
    text = console.export_text()
    out = rows(text)
    # node provider status health in-flight long queued priority
    assert ["node-a", "gpu0", "available", "online", "0/2", "0/1", "0", "(0)", "5"] in out
    assert ["node-b", "gpu1", "unavailable", "offline", "0/1", "0/1", "0", "(0)", "0"] in out
    assert "queue 0/64  timeout 30s  events dropped 0" in text
    assert "node-a (connected, gen 1, heartbeat 2.0s ago, 3 runs), node-b (disconnected, gen 0)" in text


@pytest.mark.req("snapshot-source")
async def test_table_counts_live_leases_and_candidate_pressure() -> None:
    """[snapshot-source] in-flight and queued (candidate pressure) as admission reads them."""
    admission = two_node_admission()
    admission.connect("node-a")
    async with admission.lease("ornith-fast"), admission.lease("ornith:35b", long=True):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_lease_once, admission)
            await trio.testing.wait_all_tasks_blocked()
            document = status_document(admission)
            nursery.cancel_scope.cancel()
    console = recording_console()
    assert main(["status"], transport=serving(document)[0], console=console) == 0
    text = console.export_text()
    assert ["node-a", "gpu0", "available", "online", "2/2", "1/1", "1", "(0)", "5"] in rows(text)
    assert "queue 1/64  timeout 30s" in text


async def _lease_once(admission: Admission) -> None:
    async with admission.lease("ornith-fast"):
        pass


def test_watch_refreshes_until_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """--watch shows each new snapshot; the hidden --count ends it after N refreshes."""
    admission = two_node_admission()
    before = status_document(admission)
    admission.connect("node-a")
    after = status_document(admission)
    transport, requests = serving(before, after)
    console = recording_console()
    slept: list[float] = []

    code = main(
        ["status", "--watch", "--interval", "0.5", "--count", "2"],
        transport=transport,
        console=console,
        sleep=slept.append,
    )

    assert (code, len(requests), slept) == (0, 2, [0.5])
    assert ["node-a", "gpu0", "available", "online", "0/2", "0/1", "0", "(0)", "5"] in rows(console.export_text())


def test_watch_ends_with_exit_0_on_ctrl_c() -> None:
    """Ctrl-C during --watch is the normal way out: exit 0."""
    document = status_document(two_node_admission())
    calls = 0

    def handle(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return httpx.Response(200, json=document)

    code = main(
        ["status", "--watch", "--interval", "0"],
        transport=httpx.MockTransport(handle),
        console=recording_console(),
        sleep=lambda _: None,
    )
    assert (code, calls) == (0, 3)


@pytest.mark.parametrize(
    ("respond", "message"),
    [
        (
            lambda r: httpx.Response(503, text="starting"),
            "iop status: the Edge at http://127.0.0.1:8080/status answered HTTP 503\n",
        ),
        (
            lambda r: httpx.Response(200, text="<html>"),
            "iop status: unreadable /status document from http://127.0.0.1:8080/status: ",
        ),
        (
            lambda r: httpx.Response(200, json={"queue_depth": 0}),
            "iop status: unreadable /status document from http://127.0.0.1:8080/status: required field missing @ $.max_queue",
        ),
        (
            lambda r: httpx.Response(200, json={**status_document(two_node_admission()), "ejected": []}),
            "iop status: unreadable /status document from http://127.0.0.1:8080/status: extra fields found (ejected) @ $\n",
        ),
        (
            lambda r: httpx.Response(
                200,
                json={**status_document(two_node_admission()), "nodes": [{"node_id": "node-a", "connected": False}]},
            ),
            "iop status: unreadable /status document from http://127.0.0.1:8080/status: required field missing @ $.nodes[0].generation",
        ),
        (
            lambda r: httpx.Response(200, json=[1]),
            "iop status: unreadable /status document from http://127.0.0.1:8080/status: ",
        ),
    ],
)
def test_bad_answers_exit_1_with_one_line(
    respond: Callable[[httpx.Request], httpx.Response], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Non-200 or an unreadable document: exit 1, one line on stderr, nothing on stdout."""
    console = recording_console()
    assert main(["status"], transport=httpx.MockTransport(respond), console=console) == 1
    err = capsys.readouterr().err
    assert err.startswith(message)
    assert err.count("\n") == 1
    assert console.export_text() == ""


def test_watch_exits_1_when_the_edge_goes_away(capsys: pytest.CaptureFixture[str]) -> None:
    """An Edge that stops answering during --watch ends it with exit 1."""
    document = status_document(two_node_admission())
    answers = iter([httpx.Response(200, json=document), httpx.Response(502)])
    code = main(
        ["status", "--watch"],
        transport=httpx.MockTransport(lambda r: next(answers)),
        console=recording_console(),
        sleep=lambda _: None,
    )
    assert code == 1
    assert capsys.readouterr().err == "iop status: the Edge at http://127.0.0.1:8080/status answered HTTP 502\n"


async def test_unreachable_edge_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    """A closed port on 127.0.0.1: exit 1 with 'cannot reach' on stderr."""
    with socket.socket() as probe:  # bound, never listening: connections are refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        with trio.fail_after(10):
            code = await trio.to_thread.run_sync(
                functools.partial(main, ["status", "--edge", f"http://127.0.0.1:{port}"], console=recording_console()),
                abandon_on_cancel=True,
            )
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith(f"iop status: cannot reach the Edge at http://127.0.0.1:{port}/status: ")
    assert err.count("\n") == 1


async def test_against_a_real_http_server() -> None:
    """End to end over a socket: a hypercorn (trio) app serves a live admission snapshot."""
    admission = two_node_admission()
    admission.connect("node-a")
    admission.connect("node-a")  # generation 2

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = json.dumps(status_document(admission)).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = config.errorlog = None
    console = recording_console()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(functools.partial(serve, app, config))
            code = await trio.to_thread.run_sync(
                functools.partial(main, ["status", "--edge", binds[0]], console=console),
                abandon_on_cancel=True,
            )
            nursery.cancel_scope.cancel()
    assert code == 0
    text = console.export_text()
    assert ["node-a", "gpu0", "available", "online", "0/2", "0/1", "0", "(0)", "5"] in rows(text)
    assert "node-a (connected, gen 2, heartbeat 0.5s ago, 0 runs)" in text


@pytest.mark.parametrize(
    "argv", [[], ["status", "--interval", "-1"], ["status", "--timeout", "0"], ["status", "--count", "0"]]
)
def test_bad_arguments_are_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """No subcommand or an impossible value: argparse's usage error, exit 2, no request made."""
    transport, requests = serving({})
    with pytest.raises(SystemExit) as exit_info:
        main(argv, transport=transport)
    assert exit_info.value.code == 2
    assert "usage: iop" in capsys.readouterr().err
    assert requests == []


async def test_the_edges_status_document_reads_back_whole() -> None:
    """The Edge writes /status from the model the CLI reads: every field survives the round trip
    (the CLI's own classes used to drop ``active_runs``)."""
    with importlib.resources.as_file(importlib.resources.files("iop_stack") / "examples" / "edge.yaml") as path:
        service = EdgeService(load_edge_config(path))
    document = json.loads(json.dumps(service.status()))
    assert edge_status_document(parse_status(document)) == document
    assert document["nodes"] == [
        {"node_id": "node-a", "connected": False, "generation": 0, "last_heartbeat_age": None, "active_runs": 0}
    ]


@pytest.mark.req("status-at-size")
def test_summary_first_filters_passed_on_and_rows_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """[status-at-size] the summary line comes first; --node / --model go to the Edge as query
    parameters; beyond ROWS providers the table stops and says how to see the rest."""
    admission = two_node_admission()
    admission.connect("node-a")
    transport, requests = serving(status_document(admission, heartbeat_age=1.0, active_runs=0))
    console = recording_console()
    assert main(["status", "--node", "node-a", "--model", "m x"], transport=transport, console=console) == 0
    assert [str(r.url) for r in requests] == ["http://127.0.0.1:8080/status?node=node-a&model=m+x"]
    text = console.export_text()
    first = text.splitlines()[0]
    assert first == "providers 2 (1 available, 1 unavailable, 0 disabled), in flight 0/2; nodes 1/2 connected"
    assert "more providers" not in text

    monkeypatch.setattr(status_cli, "ROWS", 1)
    console = recording_console()
    assert main(["status"], transport=transport, console=console) == 0
    text = console.export_text()
    assert "... and 1 more providers: narrow with --node / --model, or show --all" in text
    assert "node-a (connected, gen 1, heartbeat 1.0s ago, 0 runs), and 1 more" in text
    console = recording_console()
    assert main(["status", "--all"], transport=transport, console=console) == 0
    assert "more providers" not in console.export_text()


@pytest.fixture
def still_clock() -> trio.testing.MockClock:
    """Virtual time that does not move: the ejection's time left is exact."""
    return trio.testing.MockClock()


@pytest.mark.req("outlier-ejection")
async def test_table_shows_ejection_time_left_failures_and_panic(still_clock: trio.testing.MockClock) -> None:
    """[outlier-ejection] an ejected provider's health shows the time left and the failure count;
    model keys in panic mode are listed."""
    admission = two_node_admission()
    admission.connect("node-a")
    for _ in range(3):  # the default outlier policy: 3 failures in a row eject for 5 s
        async with admission.lease("ornith-fast") as lease:
            admission.report_failure(lease)
    console = recording_console()
    assert main(["status"], transport=serving(status_document(admission))[0], console=console) == 0
    text = console.export_text()
    assert "ejected (5.0s left, 3 failures)" in text
    assert "panic mode (every candidate ejected, admitted anyway): ornith:35b, ornith-fast" in text


@pytest.mark.req("tenant-edge")
async def test_status_shows_a_tenants_table_read_back_from_the_document() -> None:
    """``iop status`` lists each tenant (band, weight, waiting/max_queue, in-flight/max_in_flight, share,
    grants, cost charged) from /status's ``tenants``; without tenants there is no such table."""
    admission = two_node_admission()
    plain = recording_console()
    plain.print(status_cli.render_status(parse_status(json.loads(json.dumps(status_document(admission))))))
    assert "tenants" not in plain.export_text()
    config = admission.config
    tenants = (TenantSpec("chat", weight=2.0, priority=1, max_in_flight=3), TenantSpec("batch", max_queue=5))
    admission.refresh(
        PoolConfig(policy=config.policy, providers=config.providers, models=config.models, tenants=tenants)
    )
    admission.connect("node-a")
    async with admission.lease("ornith-fast", tenant="chat"):
        document = json.loads(json.dumps(status_document(admission)))
        console = recording_console()
        console.print(status_cli.render_status(parse_status(document)))
    table = rows(console.export_text())
    assert ["tenant", "band", "weight", "waiting", "in-flight", "share", "grants", "charged"] in table
    assert ["chat", "1", "2", "0/-", "1/3", "100%", "1", "1"] in table
    assert ["batch", "0", "1", "0/5", "0/-", "0%", "0", "0"] in table
    assert ["default", "0", "1", "0/-", "0/-", "0%", "0", "0"] in table


@pytest.mark.req("error-classes")
def test_failures_by_model_and_class_are_listed() -> None:
    """[error-classes] /status's failures come back whole and are listed in the classes' own words;
    with none, no line."""
    admission = two_node_admission()
    document = status_document(admission)
    assert "failed since" not in _rendered(document)
    document["failures"] = {"ornith:35b": {"deadline_exceeded": 3, "cancelled": 1}, "ornith-fast": {"queue_timeout": 2}}
    assert parse_status(document).failures == document["failures"]
    text = _rendered(document)
    assert "failed since start: ornith-fast queue_timeout 2; ornith:35b cancelled 1, deadline_exceeded 3" in text


def _rendered(document: dict[str, Any]) -> str:
    console = recording_console()
    assert main(["status"], transport=serving(document)[0], console=console) == 0
    return console.export_text()
