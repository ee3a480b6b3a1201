"""Untrusted bytes from clients into the Edge and onto the wire (issue 37, the client → Edge → wire seam).

Each test runs a real Edge in process, with a fake node (the wire step by step) or a real one
(``adapter: mock``), and checks after each case: the Edge still serves, no traceback was
logged, every admission counter and the node link's run count are back to 0, and a run that
was in flight meanwhile is untouched.
[lease-lifecycle] [contract-spec-sync] [wire-versioning]
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from edge.harness import (
    BIG,
    FAST,
    TOKEN_A,
    Edge,
    EdgeLayout,
    FakeNode,
    eventually,
    fake_node,
    mock_provider,
    node_config,
    real_node,
    running_edge,
)
from iop_edge.api.rejections import RequestRejected
from iop_edge.api.request_body import MAX_DEPTH, read_body
from iop_edge.nodes import run_frame as run_frame_module
from iop_edge.nodes.connection import NodeSocket
from iop_edge.nodes.link import NodeLink
from iop_edge.nodes.runs import RunNotSent
from iop_wire import MAX_MESSAGE_BYTES, PROTOCOL_VERSION, RUN_ENVELOPE_BYTES, Rejected, Run, decode

pytestmark = pytest.mark.req("lease-lifecycle", "contract-spec-sync")

TIMEOUT = 30
BIG_BODY_LAYOUT = EdgeLayout(max_body_bytes=4 * 1024 * 1024, gpu0_capacity=4)


def chat_body(content: Any = "hi", **fields: Any) -> dict[str, Any]:
    return {"model": FAST, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **fields}


async def post(edge: Edge, raw: bytes, path: str = "/v1/chat/completions", **headers: Any) -> httpx.Response:
    return await edge.http.post(path, content=raw, headers={"content-type": "application/json", **headers})


def link_of(edge: Edge, node_id: str = "node-a") -> NodeLink:
    return next(link for link in edge.service.registry.links() if link.node_id == node_id)


def assert_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    tracebacks = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not tracebacks, [r.getMessage() for r in tracebacks]


async def assert_settled(edge: Edge, caplog: pytest.LogCaptureFixture) -> None:
    """The Edge alive (it answers /healthz), every counter 0, no run left on a link, no traceback."""
    assert (await edge.http.get("/healthz")).status_code == 200
    await edge.assert_drained()
    await eventually(lambda: all(link.active_runs == 0 for link in edge.service.registry.links()))
    assert_no_traceback(caplog)


def assert_bad_request(response: httpx.Response, *words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "bad_request"
    for word in words:
        assert word in error["message"], error["message"]


async def in_flight_beside(edge: Edge, node: FakeNode, nursery: trio.Nursery, results: dict[str, Any]) -> Run:
    """Start a chat whose run the fake node holds (the run in flight the cases must not touch)."""

    async def chat() -> None:
        results["other"] = await edge.chat(BIG, "other")

    nursery.start_soon(chat)
    return await node.next_run()


async def finish(node: FakeNode, run: Run, results: dict[str, Any]) -> None:
    await node.answer(run, "still here")
    await eventually(lambda: "other" in results)
    assert results["other"].status_code == 200, results["other"].text
    assert results["other"].json()["choices"][0]["message"]["content"] == "still here"


# ----------------------------------------------------------------- the JSON rules

LONE_SURROGATE = b'{"model":"ornith-fast","messages":[{"role":"user","content":"x\\ud800y"}],"max_tokens":2}'


async def test_lone_surrogate_escape_is_400_and_the_run_in_flight_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The critical case: ``"x\\ud800y"`` (valid JSON, not text) while another run is in flight: 400
    naming the lone surrogate, nothing sent to the node, the other run answered, counters 0."""
    with trio.fail_after(TIMEOUT):
        async with running_edge(tmp_path) as edge, fake_node(edge) as node:
            results: dict[str, Any] = {}
            async with trio.open_nursery() as nursery:
                held = await in_flight_beside(edge, node, nursery, results)
                for _ in range(3):
                    assert_bad_request(await post(edge, LONE_SURROGATE), "lone surrogate")
                assert link_of(edge).active_runs == 1  # only the run in flight
                await finish(node, held, results)
            await assert_settled(edge, caplog)


BAD_BODIES = {
    "lone surrogate in a key": (b'{"model":"ornith-fast","messages":[{"\\udfff":1}]}', "lone surrogate"),
    "embeddings input": (b'{"model":"ornith-fast","input":"\\udfff"}', "lone surrogate"),
    "surrogate as UTF-8 bytes": (b'{"model":"ornith-fast","messages":["\xed\xa0\x80"]}', "UTF-8"),
    "invalid UTF-8": (b'{"model":"ornith-fast","messages":["\xff"]}', "UTF-8"),
    "UTF-16": (json.dumps(chat_body()).encode("utf-16"), "UTF-8"),
    "nested 975 deep": (b'{"model":"ornith-fast","messages":[' + b"[" * 973 + b"]" * 973 + b"]}", "nests"),
    "nested past the limit": (
        b'{"model":"ornith-fast","messages":[' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"]}",
        "nests",
    ),
    "nested 100,000 deep": (b'{"model":"ornith-fast","messages":[' + b"[" * 100_000 + b"]" * 100_000 + b"]}", ""),
    "duplicate key": (b'{"model":"ornith-fast","model":"ornith:35b","messages":[1]}', "duplicate key"),
    "lone surrogate in a body read off the loop": (
        b'{"model":"ornith-fast","messages":[' + b"1," * 100_000 + b'"\\udbff"]}',
        "lone surrogate",
    ),
    "duplicate key in a body read off the loop": (
        b'{"model":"ornith-fast","messages":[' + b'{"a":1},' * 20_000 + b'{"a":1,"a":2}]}',
        "duplicate key",
    ),
    "nesting in a body read off the loop": (
        b'{"model":"ornith-fast","messages":[' + b"[1]," * 30_000 + b"[" * 70 + b"]" * 70 + b"]}",
        "nests",
    ),
    "NaN": (b'{"model":"ornith-fast","messages":[NaN]}', "NaN"),
    "number out of range": (b'{"model":"ornith-fast","messages":[1e999]}', "out of range"),
    "integer of 5000 digits": (b'{"model":"ornith-fast","messages":[' + b"9" * 5000 + b"]}", "not valid JSON"),
}


@pytest.mark.parametrize("case", BAD_BODIES, ids=list(BAD_BODIES))
async def test_body_breaking_a_json_rule_is_400(tmp_path: Path, caplog: pytest.LogCaptureFixture, case: str) -> None:
    """Each JSON rule broken: 400 bad_request naming it (never a 500), and the Edge serves on, drained."""
    raw, words = BAD_BODIES[case]
    path = "/v1/embeddings" if case == "embeddings input" else "/v1/chat/completions"
    layout = EdgeLayout(max_body_bytes=512 * 1024)
    with trio.fail_after(TIMEOUT):
        async with running_edge(tmp_path, layout) as edge, fake_node(edge) as node:
            results: dict[str, Any] = {}
            async with trio.open_nursery() as nursery:
                held = await in_flight_beside(edge, node, nursery, results)
                assert_bad_request(await post(edge, raw, path), words)
                await finish(node, held, results)
            await assert_settled(edge, caplog)


@pytest.mark.parametrize("case", BAD_BODIES, ids=list(BAD_BODIES))
def test_reading_off_the_loop_refuses_the_same(case: str) -> None:
    """The decoder used off the loop (hooks that give the loop its turns) keeps every rule."""
    raw, words = BAD_BODIES[case]
    with pytest.raises(RequestRejected, match=words or None):
        read_body(raw, off_loop=True)
    with pytest.raises(RequestRejected, match=words or None):
        read_body(raw)


async def test_nesting_at_the_limit_and_valid_pairs_pass(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The rules refuse only what they name: nesting of exactly MAX_DEPTH, an escaped surrogate
    pair, a byte-order mark are served."""
    deep: Any = 1
    for _ in range(MAX_DEPTH - 3):  # the top object, "messages" and the message are 3 levels
        deep = [deep]
    bodies = [
        json.dumps(chat_body(deep)).encode(),
        b'{"model":"ornith-fast","messages":[{"role":"user","content":"\\ud83d\\ude00"}],"max_tokens":2}',
        b"\xef\xbb\xbf" + json.dumps(chat_body()).encode(),
    ]
    with trio.fail_after(TIMEOUT):
        async with running_edge(tmp_path) as edge, real_node(edge, node_config(edge, "node-a", [mock_provider()])):
            for raw in bodies:
                response = await post(edge, raw)
                assert response.status_code == 200, response.text
            await assert_settled(edge, caplog)


# ----------------------------------------------------------- relay bytes, never rebuild

FLOATS = b'{"model":"ornith-fast","messages":[{"role":"user","content":"hi"}],"max_tokens":2,"x":['


def floats_body(size: int) -> bytes:
    """A body of exactly ``size`` bytes holding ``"x": [1e15, 1e15, ...]`` (re-encoded: 3.6 times larger)."""
    count = (size - len(FLOATS) - 2 + 1) // 5
    body = FLOATS + b",".join([b"1e15"] * count) + b"]}"
    return body + b" " * (size - len(body))


async def test_large_body_goes_to_a_v5_node_as_sent(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The issue's 4,000,081-byte body of ``1e15``: the run frame is the client's bytes plus the run's
    fields (not a 15 MB re-encoding), and the node's backend gets the upstream model put in."""
    raw = floats_body(4_000_081)
    with trio.fail_after(TIMEOUT):
        async with running_edge(tmp_path, BIG_BODY_LAYOUT) as edge, fake_node(edge) as node:
            results: dict[str, Any] = {}
            async with trio.open_nursery() as nursery:

                async def send() -> None:
                    results["big"] = await post(edge, raw)

                nursery.start_soon(send)
                frame = await node.ws.get_message()
                assert isinstance(frame, str)
                assert len(raw) < len(frame.encode()) < len(raw) + 300
                assert raw.decode().rstrip() in frame  # the client's characters, as sent
                run = decode(frame)
                assert isinstance(run, Run) and run.model == "qwen3:35b-fast"
                assert run.upstream_body()["model"] == "qwen3:35b-fast"
                assert run.upstream_body()["stream"] is False
                await node.answer(run)
            assert results["big"].status_code == 200, results["big"].text
            await assert_settled(edge, caplog)


async def test_large_body_through_a_real_node(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """End to end with a real (v5) node: the 4,000,081-byte body is answered 200, the link stays up."""
    raw = floats_body(4_000_081)
    with trio.fail_after(TIMEOUT):
        async with running_edge(tmp_path, BIG_BODY_LAYOUT) as edge:
            async with real_node(edge, node_config(edge, "node-a", [mock_provider()])):
                generation = link_of(edge).generation
                for _ in range(2):
                    response = await post(edge, raw)
                    assert response.status_code == 200, response.text
                assert link_of(edge).generation == generation  # never cut
                await assert_settled(edge, caplog)


def test_the_default_body_limit_fits_a_run_frame() -> None:
    """The wire's limit derived from max_body_bytes: the largest body the config accepts fits a v5 frame."""
    from iop_wire import max_body_bytes_for

    assert max_body_bytes_for(MAX_MESSAGE_BYTES) == MAX_MESSAGE_BYTES - RUN_ENVELOPE_BYTES
    assert max_body_bytes_for() >= 4 * 1024 * 1024


async def test_body_limit_past_the_wire_limit_is_a_config_error(tmp_path: Path) -> None:
    """Checked at config load: a max_body_bytes that could not fit one run frame is refused."""
    from iop_config import ConfigFileError
    from iop_edge.config import load_edge_config

    path = tmp_path / "edge.yaml"
    path.write_text(EdgeLayout(max_body_bytes=MAX_MESSAGE_BYTES).yaml())
    with pytest.raises(ConfigFileError, match="max_body_bytes"):
        load_edge_config(path)


# ------------------------------------------------------------ one run's failure stays its own


async def test_run_is_registered_only_once_encoded(tmp_path: Path) -> None:
    """A run whose frame is not text is refused by the link before it is registered: nothing to leak."""
    with trio.fail_after(TIMEOUT):
        async with running_edge(tmp_path) as edge, fake_node(edge):
            link = link_of(edge)
            with pytest.raises(RunNotSent, match="surrogate") as refused:
                link.open_run(Run("r-bad", "gpu0", "chat/completions", {"x": "\ud800"}, False))
            assert refused.value.status == 400
            with pytest.raises(RunNotSent):
                link.open_run(Run("r-bad2", "gpu0", "chat/completions", {}, False, model="m"), '{"x":"\ud800"}')
            assert link.active_runs == 0


POISON = "poison-7f3a"
"""A marker in a request whose frame the injected fault fails (the others pass)."""


def _poisoned(frame: object) -> bool:
    return isinstance(frame, str) and POISON in frame


def _inject(monkeypatch: pytest.MonkeyPatch, step: str) -> None:
    """Make the Edge → node writer fail at ``step`` for the poisoned request's frame only."""
    if step == "encode":
        real_encode_run = run_frame_module.encode_run

        def encode_run(run: Run, body_json: str) -> str:
            if POISON in body_json:
                raise ValueError("injected: cannot encode")
            return real_encode_run(run, body_json)

        monkeypatch.setattr(run_frame_module, "encode_run", encode_run)
        return
    real_send_nowait = NodeSocket.send_nowait
    real_send_messages = NodeSocket.send_messages

    def send_nowait(self: NodeSocket, message: str | bytes) -> bool:
        if step == "writer":
            return False  # every frame goes through the writer task
        if _poisoned(message):
            raise ValueError("injected: cannot frame")
        return real_send_nowait(self, message)

    async def send_messages(self: NodeSocket, messages: Iterable[str | bytes]) -> None:
        messages = list(messages)
        if any(_poisoned(m) for m in messages):
            raise ValueError("injected: cannot frame")
        await real_send_messages(self, messages)

    monkeypatch.setattr(NodeSocket, "send_nowait", send_nowait)
    monkeypatch.setattr(NodeSocket, "send_messages", send_messages)


WRITER_FAULTS = {
    "encode": (400, "bad_request"),
    "send_nowait": (502, "upstream_error"),
    "writer": (502, "upstream_error"),
}


@pytest.mark.parametrize("step", WRITER_FAULTS)
async def test_writer_fault_fails_its_run_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """Fault injection: the Edge → node writer fails at each step (encoding the run, the handler's
    own write, the writer task's batched write) for one request. That request gets its typed error
    (400 / 502); the Edge lives, the run in flight and a request sent beside it are served, the
    link is never cut, and every counter is back to 0."""
    _inject(monkeypatch, step)
    status, code = WRITER_FAULTS[step]
    with trio.fail_after(TIMEOUT):
        async with running_edge(tmp_path, EdgeLayout(gpu0_capacity=4)) as edge, fake_node(edge) as node:
            generation = link_of(edge).generation
            results: dict[str, Any] = {}
            async with trio.open_nursery() as nursery:
                held = await in_flight_beside(edge, node, nursery, results)

                async def chat(name: str) -> None:
                    results[name] = await edge.chat(FAST, name)

                nursery.start_soon(chat, POISON)
                nursery.start_soon(chat, "beside")  # queued with it in the writer's batch
                beside = await node.next_run()
                assert beside.body["messages"][0]["content"] == "beside"
                await node.answer(beside, "beside ok")
                await eventually(lambda: POISON in results)
                await finish(node, held, results)
            poisoned = results[POISON]
            assert poisoned.status_code == status, poisoned.text
            assert poisoned.json()["error"]["code"] == code
            assert results["beside"].status_code == 200
            assert link_of(edge).generation == generation
            await assert_settled(edge, caplog)


# --------------------------------------------------------------------- secrets, exactly


@pytest.mark.parametrize("suffix", [b"\xa0", b"\x85"])
async def test_bearer_token_with_non_ows_whitespace_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, suffix: bytes
) -> None:
    """RFC 9110 §5.5: only SP and HTAB are optional whitespace; ``key\\xa0`` or ``key\\x85`` is
    another token (API key and admin token), while ``key`` after SP/HTAB is the key (other control
    characters never reach it: the HTTP parser refuses them)."""
    layout = EdgeLayout(api_keys=("k-1",))
    with trio.fail_after(TIMEOUT):
        async with running_edge(tmp_path, layout) as edge:
            refused = await edge.http.get("/v1/models", headers={"authorization": b"Bearer k-1" + suffix})
            assert refused.status_code == 401, refused.text
            accepted = await edge.http.get("/v1/models", headers={"authorization": b"Bearer \t k-1"})
            assert accepted.status_code == 200, accepted.text
            admin = b"Bearer " + layout.admin_token.encode() + suffix  # type: ignore[union-attr]
            reload = await edge.http.post("/admin/reload", headers={"authorization": admin})
            assert reload.status_code == 401, reload.text
            assert_no_traceback(caplog)


async def test_register_token_with_a_lone_surrogate_is_a_bad_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A node's ``register`` whose token holds a lone surrogate (valid JSON): rejected bad_token, the
    Edge serves on (the comparison is of bytes and never raises)."""
    register = {
        "type": "register",
        "node_id": "node-a",
        "token": TOKEN_A + "\udfff",
        "protocol": PROTOCOL_VERSION,
        "providers": [],
    }
    with trio.fail_after(TIMEOUT):
        async with running_edge(tmp_path) as edge:
            async with fake_node(edge, register=False) as node:
                await node.ws.send_message(json.dumps(register))
                answer = await node.receive()
                assert isinstance(answer, Rejected) and answer.code == "bad_token", answer
            async with fake_node(edge) as node:  # the right token still registers
                assert node.registered is not None
            assert_no_traceback(caplog)


async def test_unknown_node_id_is_logged_escaped_and_cut(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An unauthenticated ``register``'s node id is logged escaped and cut to 128 characters: a newline
    in it cannot forge a log line, a megabyte of it is not a megabyte of log."""
    forged = "evil\nINFO iop_edge: forged line " + "x" * 1_000_000
    register = {"type": "register", "node_id": forged, "token": "t", "protocol": PROTOCOL_VERSION, "providers": []}
    with trio.fail_after(TIMEOUT):
        async with running_edge(tmp_path, EdgeLayout(max_ws_message_bytes=2 * 1024 * 1024)) as edge:
            async with fake_node(edge, register=False) as node:
                await node.ws.send_message(json.dumps(register))
                answer = await node.receive()
                assert isinstance(answer, Rejected) and answer.code == "unknown_node", answer
                assert len(answer.reason) < 300
            assert "\nINFO iop_edge: forged line" not in caplog.text
            assert "evil\\nINFO iop_edge: forged line" in caplog.text
            assert max(len(line) for line in caplog.text.splitlines()) < 1000
            assert_no_traceback(caplog)


async def test_non_ascii_secrets_are_compared_as_the_bytes_sent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A configured secret is its UTF-8 bytes, and a presented token is the bytes the client sent: an
    API key, the admin token and the viewer token (header or ``?token=``) spelt ``ö`` match ``\\xc3\\xb6``
    only; the same text in latin-1 (``\\xf6``) is another token (it used to be the one accepted)."""
    layout = EdgeLayout(api_keys=("k-ö",), admin_token="adm-ö", extra=('ui: {enabled: true, viewer_token: "v-ö"}',))
    with trio.fail_after(TIMEOUT):
        async with running_edge(tmp_path, layout) as edge:
            for utf8, status in ((True, 200), (False, 401)):
                spelt = "utf-8" if utf8 else "latin-1"
                key = b"Bearer " + "k-ö".encode(spelt)
                answer = await edge.http.get("/v1/models", headers={"authorization": key})
                assert answer.status_code == status, (spelt, answer.text)
                viewer = await edge.http.get("/ui", headers={"authorization": b"Bearer " + "v-ö".encode(spelt)})
                assert viewer.status_code == status, (spelt, viewer.text)
                in_query = await edge.http.get("/ui?token=v-" + ("%C3%B6" if utf8 else "%F6"))
                assert in_query.status_code == status, (spelt, in_query.text)
                admin = b"Bearer " + "adm-ö".encode(spelt)
                reload = await edge.http.post("/admin/reload", headers={"authorization": admin})
                assert reload.status_code == status, (spelt, reload.text)
            assert_no_traceback(caplog)
