"""Example-based tests of the wire protocol codec (contract: docs/wire.md) [contract-spec-sync]."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, get_args

import attrs
import pytest

import iop_wire
from iop_wire import (
    CLOSE_PROTOCOL_ERROR,
    CLOSE_TOO_BIG,
    ERROR_CODES,
    FAILURE_KINDS,
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    PROVIDER_FAILURES,
    REJECT_CODES,
    Cancel,
    EdgeMessage,
    EngineView,
    Heartbeat,
    InFlight,
    Leader,
    Message,
    NodeMessage,
    ProtocolError,
    ProviderHealth,
    ProviderInfo,
    Register,
    Registered,
    Rejected,
    Run,
    RunEnd,
    TunnelChunk,
    TunnelEnd,
    TunnelRequest,
    TunnelStart,
    decode,
    encode,
)

# The tag values are the spec's, written out here so a rename in the code fails a test.
TAGS: dict[type[Any], str] = {
    Register: "register",
    Heartbeat: "heartbeat",
    RunEnd: "run_end",
    TunnelStart: "tunnel_start",
    TunnelChunk: "tunnel_chunk",
    TunnelEnd: "tunnel_end",
    Registered: "registered",
    Rejected: "rejected",
    Run: "run",
    Cancel: "cancel",
    TunnelRequest: "tunnel_request",
    InFlight: "in_flight",
    ProviderHealth: "provider_health",
    Leader: "leader",
}

EXAMPLES: list[Any] = [
    Register(
        "node-a", "dev-token", PROTOCOL_VERSION, (ProviderInfo("gpu0", "openai", 1), ProviderInfo("cpu", "mock", 4))
    ),
    Heartbeat(7),
    RunEnd("r1", "ok"),
    RunEnd("r2", "error", "upstream_error", "backend said 500", 500),
    RunEnd("r5", "error", "upstream_error", "too long", 400, '{"error":{"message":"too long"}}'),
    RunEnd("r3", "cancelled", "cancelled"),
    TunnelStart("t1", 200, (("content-type", "application/x-ndjson"), ("x-a", ""))),
    TunnelChunk.from_bytes("t1", b"\x00\xffraw"),
    TunnelEnd("t1", "ok"),
    TunnelEnd("t2", "error", "upstream_unreachable", "connect refused"),
    Registered("node-a", 3, 5000),
    Rejected("duplicate", "node-a is already connected", True),
    Run(
        "r1",
        "gpu0",
        "chat/completions",
        {"model": "qwen3:35b", "messages": [{"role": "user", "content": "héllo ✓"}], "stream": True, "x": None},
        True,
    ),
    Run("r4", "gpu0", "completions", {"model": "qwen3:35b", "prompt": "hi", "stream": False}, False),
    Cancel("r1"),
    TunnelRequest.from_bytes("t1", "gpu0", "POST", "/api/chat", (("content-type", "application/json"),), b'{"a":1}'),
    TunnelRequest("t3", "gpu0", "GET", "/v1/models"),
    Run("r6", "gpu0", "completions", {"model": "m", "prompt": "hi", "stream": False}, False, 41),
    TunnelRequest("t4", "gpu0", "GET", "/v1/models", epoch=41),
    RunEnd("r7", "error", "stale_epoch", "run of epoch 40, this node has seen 41"),
    InFlight(41, (("gpu0", 2), ("gpu1", 1))),
    InFlight(42, ()),
    Run("r8", "gpu0", "chat/completions", {"model": "m", "messages": [], "stream": False}, False, 43, True),
    Run("r9", "gpu0", "chat/completions", {"model": "m", "messages": [], "stream": False}, False, long=True),
    InFlight(43, (("gpu0", 2), ("gpu1", 1)), (("gpu0", 1),)),
    ProviderHealth("gpu0", "stalled", "no byte from the backend for 6.0 s with runs in flight"),
    ProviderHealth("gpu1", "ready", "", 2),
    ProviderHealth("gpu1", "not_ready", "loading (Loading model)"),
    ProviderHealth("gpu1", "ready", "", None, EngineView(0.5, 2048, 4096, 7, 3, 1)),
    Leader(41),
    Run("r10", "gpu0", "chat/completions", {"messages": []}, True, 43, False, "m", 2500),
    RunEnd("r10", "error", "deadline_exceeded", "the run's deadline of 2500 ms passed"),
    RunEnd("r11", "error", "stream_stalled", "the upstream went silent"),
]


def test_examples_cover_every_message_type() -> None:
    assert {type(m) for m in EXAMPLES} == set(get_args(Message)) == set(TAGS)


def test_node_and_edge_messages_partition_the_protocol() -> None:
    node = set(get_args(NodeMessage))
    edge = set(get_args(EdgeMessage))
    assert node == {Register, Heartbeat, RunEnd, TunnelStart, TunnelChunk, TunnelEnd, InFlight, ProviderHealth}
    assert edge == {Registered, Rejected, Run, Cancel, TunnelRequest, Leader}
    assert node | edge == set(get_args(Message))


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: TAGS[type(m)])
def test_round_trip_every_message_type(message: Any) -> None:
    text = encode(message)
    assert decode(text) == message
    assert decode(text.encode("utf-8")) == message
    obj = json.loads(text)
    assert obj["type"] == TAGS[type(message)]
    # compact, all fields emitted (but an unset epoch, long, long_runs, model, deadline_ms and engine), non-ASCII
    # kept as is
    assert text == json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    unset = {"epoch"} if getattr(message, "epoch", 0) is None else set()
    unset |= {"long"} if getattr(message, "long", True) is False else set()
    unset |= {"long_runs"} if getattr(message, "long_runs", None) == () else set()
    unset |= {"model"} if type(message) is Run and message.model is None else set()
    unset |= {"deadline_ms"} if type(message) is Run and message.deadline_ms is None else set()
    unset |= {"engine"} if type(message) is ProviderHealth and message.engine is None else set()
    assert set(obj) == {"type"} | {f.name for f in attrs.fields(type(message))} - unset


@pytest.mark.req("epoch-fencing")
def test_an_unset_epoch_is_left_out_of_the_frame() -> None:
    """[epoch-fencing] A run without an epoch (an Edge without ``ha:``) has no ``epoch`` key."""
    run = Run("r", "gpu0", "completions", {"prompt": "hi", "stream": False}, False)
    assert "epoch" not in json.loads(encode(run))
    assert "epoch" not in json.loads(encode(TunnelRequest("t", "gpu0", "GET", "/")))
    assert json.loads(encode(attrs.evolve(run, epoch=7)))["epoch"] == 7
    with pytest.raises(ProtocolError, match="epoch"):
        decode(
            '{"type":"run","run_id":"r","provider":"p","endpoint":"completions","body":{},"stream":false,"epoch":"7"}'
        )


def test_encode_emits_optional_fields_as_null() -> None:
    assert json.loads(encode(RunEnd("r", "ok"))) == {
        "type": "run_end",
        "run_id": "r",
        "status": "ok",
        "code": None,
        "message": None,
        "upstream_status": None,
        "upstream_body": None,
    }


@pytest.mark.parametrize(
    ("frame", "expected"),
    [
        ('{"type":"run_end","run_id":"r","status":"ok"}', RunEnd("r", "ok")),
        ('{"type":"run_end","run_id":"r","status":"ok","code":null,"message":null}', RunEnd("r", "ok")),
        (
            '{"type":"tunnel_end","run_id":"r","status":"cancelled","code":"cancelled"}',
            TunnelEnd("r", "cancelled", "cancelled"),
        ),
        (
            '{"type":"tunnel_request","run_id":"t","provider":"p","method":"GET","path":"/v1/models"}',
            TunnelRequest("t", "p", "GET", "/v1/models", (), ""),
        ),
        (
            '{"path":"/","type":"tunnel_request","run_id":"t","provider":"p","method":"GET"}',
            TunnelRequest("t", "p", "GET", "/"),
        ),
    ],
)
def test_decode_accepts_missing_optional_fields(frame: str, expected: Any) -> None:
    assert decode(frame) == expected


@pytest.mark.req("upstream-error-passthrough")
def test_run_end_without_upstream_fields_decodes() -> None:
    """[upstream-error-passthrough] upstream_status and upstream_body are optional: an older node's frame decodes."""
    frame = '{"type":"run_end","run_id":"r","status":"error","code":"upstream_error","message":"m"}'
    assert decode(frame) == RunEnd("r", "error", "upstream_error", "m", None, None)


@pytest.mark.req("upstream-error-passthrough")
@pytest.mark.parametrize(
    ("end", "kind"),
    [
        (RunEnd("r", "ok"), None),
        (RunEnd("r", "error", "upstream_error", "m", 400), "client_error"),
        (RunEnd("r", "error", "upstream_error", "m", 404), "client_error"),
        (RunEnd("r", "error", "upstream_error", "m", 413), "client_error"),
        (RunEnd("r", "error", "upstream_error", "m", 422), "client_error"),
        (RunEnd("r", "error", "upstream_error", "m", 429), "rate_limited"),
        (RunEnd("r", "error", "upstream_error", "m", 401), "provider_error"),
        (RunEnd("r", "error", "upstream_error", "m", 403), "provider_error"),
        (RunEnd("r", "error", "upstream_error", "m", 408), "provider_error"),
        (RunEnd("r", "error", "upstream_error", "m", 500), "provider_error"),
        (RunEnd("r", "error", "upstream_error", "m", 503), "provider_error"),
        (RunEnd("r", "error", "upstream_error", "m", 200), "provider_error"),
        (RunEnd("r", "error", "upstream_error", "broke off mid-stream"), "provider_error"),
        (RunEnd("r", "error", "upstream_unreachable", "timed out"), "unreachable"),
        (RunEnd("r", "error", "concurrency_limit", "full"), "node_busy"),
        (RunEnd("r", "error", "bad_request", "unknown provider"), "node_refused"),
        (RunEnd("r", "cancelled", "cancelled"), "cancelled"),
    ],
)
def test_failure_kind_tells_the_clients_failures_from_the_providers(end: RunEnd, kind: str | None) -> None:
    """[upstream-error-passthrough] the one classification the Edge maps (and health counts) from."""
    assert end.failure == kind
    if kind is not None:
        assert kind in FAILURE_KINDS
        assert (kind in PROVIDER_FAILURES) == (kind in ("provider_error", "unreachable"))


def test_non_ascii_is_kept_and_counted_in_utf8_bytes() -> None:
    message = Run("r", "p", "completions", {"prompt": "日本語"}, False)
    text = encode(message)
    assert "日本語" in text
    size = len(text.encode("utf-8"))
    assert size > len(text)
    assert decode(text, max_bytes=size) == message
    with pytest.raises(ProtocolError) as info:
        decode(text, max_bytes=size - 1)
    assert info.value.reason == f"message too large: {size} bytes > {size - 1}"
    assert info.value.close_code == CLOSE_TOO_BIG


def test_oversized_frame_at_default_limit_is_rejected_before_parsing() -> None:
    big = "x" * MAX_MESSAGE_BYTES
    ok = encode(Run("r", "p", "completions", {"c": big[: MAX_MESSAGE_BYTES - 200]}, False))
    assert isinstance(decode(ok), Run)
    head = '{"type":"run","run_id":"r","provider":"p","endpoint":"completions","body":{"c":"'
    for frame in (head + big + '"},"stream":false}', "{" + big):
        for data in (frame, frame.encode()):
            with pytest.raises(ProtocolError) as info:
                decode(data)
            size = len(frame.encode())
            assert info.value.reason == f"message too large: {size} bytes > {MAX_MESSAGE_BYTES}"
            assert info.value.close_code == CLOSE_TOO_BIG


def _register(**changes: Any) -> str:
    obj: dict[str, Any] = {
        "type": "register",
        "node_id": "node-a",
        "token": "t",
        "protocol": 1,
        "providers": [{"id": "gpu0", "adapter": "openai", "capacity": 1}],
    }
    obj.update(changes)
    return json.dumps(obj)


BAD_FRAMES = [
    # malformed / not a message
    ('{"type":"heartbeat"', "malformed JSON"),
    ("", "malformed JSON"),
    ('{"type":"heartbeat","seq":1} x', "malformed JSON"),
    (
        '{"type":"run","run_id":"r","provider":"p","endpoint":"completions","body":{"v":NaN}}',
        "malformed JSON: NaN is not valid JSON",
    ),
    ('{"type":"run","run_id":"r","provider":"p","endpoint":"completions","body":{"v":-Infinity}}', "malformed JSON"),
    ('{"type":"heartbeat","seq":' + "9" * 5000 + "}", "malformed JSON"),
    ("[" * 100_000, "malformed JSON"),
    (b'{"type":"cancel","run_id":"\xff"}', "frame is not valid UTF-8"),
    ("[1,2]", "expected a JSON object, got array"),
    ('"register"', "expected a JSON object, got string"),
    ("null", "expected a JSON object, got null"),
    ('{"run_id":"r"}', "missing message type (field 'type')"),
    ('{"type":"bogus","run_id":"r"}', "unknown message type 'bogus' (field 'type')"),
    ('{"type":"Cancel","run_id":"r"}', "unknown message type 'Cancel'"),
    ('{"type":5,"run_id":"r"}', "unknown message type 5"),
    ('{"type":["cancel"],"run_id":"r"}', "unknown message type ['cancel']"),
    ('{"type":"' + "x" * 1000 + '"}', "unknown message type 'xxxxxxxx"),
    # missing field
    ('{"type":"heartbeat"}', "invalid heartbeat message: required field missing @ $.seq"),
    (_register(providers=[{"id": "gpu0", "adapter": "openai"}]), "required field missing @ $.providers[0].capacity"),
    # extra field
    ('{"type":"cancel","run_id":"r","reason":"x"}', "invalid cancel message: extra fields found (reason) @ $"),
    (
        _register(providers=[{"id": "g", "adapter": "a", "capacity": 1, "long": 2}]),
        "extra fields found (long) @ $.providers[0]",
    ),
    # wrong types
    ('{"type":"cancel","run_id":5}', "expected a string, got integer @ $.run_id"),
    ('{"type":"cancel","run_id":null}', "expected a string, got null @ $.run_id"),
    ('{"type":"heartbeat","seq":"1"}', "expected an integer, got string @ $.seq"),
    ('{"type":"heartbeat","seq":true}', "expected an integer, got boolean @ $.seq"),
    ('{"type":"heartbeat","seq":1.0}', "expected an integer, got number @ $.seq"),
    (_register(protocol=False), "expected an integer, got boolean @ $.protocol"),
    (_register(providers="gpu0"), "expected an array, got string @ $.providers"),
    (_register(providers={"id": "g"}), "expected an array, got object @ $.providers"),
    (
        _register(providers=[{"id": "g", "adapter": "a", "capacity": "1"}]),
        "expected an integer, got string @ $.providers[0].capacity",
    ),
    (_register(token=None), "expected a string, got null @ $.token"),
    (
        '{"type":"rejected","code":"duplicate","reason":"r","retryable":1}',
        "expected a boolean, got integer @ $.retryable",
    ),
    (
        '{"type":"rejected","code":"duplicate","reason":"r","retryable":"true"}',
        "expected a boolean, got string @ $.retryable",
    ),
    (
        '{"type":"run","run_id":"r","provider":"p","endpoint":"completions","body":[1],"stream":false}',
        "expected an object, got array @ $.body",
    ),
    (
        '{"type":"run","run_id":"r","provider":"p","endpoint":"completions","body":"{}","stream":false}',
        "expected an object, got string @ $.body",
    ),
    (
        '{"type":"run","run_id":"r","provider":"p","endpoint":"completions","body":null,"stream":false}',
        "expected an object, got null @ $.body",
    ),
    (
        '{"type":"run_end","run_id":"r","status":"error","code":"upstream_error","upstream_status":"502"}',
        "expected an integer, got string @ $.upstream_status",
    ),
    ('{"type":"run_end","run_id":"r","status":"ok","message":7}', "expected a string, got integer @ $.message"),
    (
        '{"type":"tunnel_start","run_id":"t","status":200,"headers":[["a","b","c"]]}',
        "expected an array of 2 items, got 3 @ $.headers[0]",
    ),
    (
        '{"type":"tunnel_start","run_id":"t","status":200,"headers":["ab"]}',
        "expected an array, got string @ $.headers[0]",
    ),
    (
        '{"type":"tunnel_start","run_id":"t","status":200,"headers":[["a",1]]}',
        "expected a string, got integer @ $.headers[0][1]",
    ),
    (
        '{"type":"tunnel_start","run_id":"t","status":200,"headers":{"a":"b"}}',
        "expected an array, got object @ $.headers",
    ),
    ('{"type":"tunnel_chunk","run_id":"t","data":null}', "expected a string, got null @ $.data"),
    # value rules
    ('{"type":"run_end","run_id":"r","status":"error"}', "code is required when status is 'error'"),
    ('{"type":"run_end","run_id":"r","status":"cancelled"}', "code is required when status is 'cancelled'"),
    ('{"type":"run_end","run_id":"r","status":"ok","code":"bad_request"}', "code must be omitted when status is 'ok'"),
    ('{"type":"run_end","run_id":"r","status":"error","code":"oops"}', "code must be one of concurrency_limit"),
    (
        '{"type":"run_end","run_id":"r","status":"cancelled","code":"upstream_error"}',
        "code must be 'cancelled' when status is 'cancelled'",
    ),
    ('{"type":"run_end","run_id":"r","status":"done"}', "status must be one of ok, error, cancelled; got 'done'"),
    (
        '{"type":"tunnel_end","run_id":"r","status":"error"}',
        "invalid tunnel_end message: code is required when status is 'error'",
    ),
    (
        '{"type":"run","run_id":"r","provider":"p","endpoint":"rerank","body":{},"stream":false}',
        "endpoint must be one of chat/completions, completions, embeddings; got 'rerank'",
    ),
    ('{"type":"rejected","code":"nope","reason":"r","retryable":false}', "code must be one of bad_token"),
]


@pytest.mark.parametrize(("frame", "reason_part"), BAD_FRAMES)
def test_bad_frame_raises_protocol_error_naming_the_problem(frame: str | bytes, reason_part: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(frame)
    assert reason_part in info.value.reason
    assert str(info.value) == info.value.reason
    assert info.value.close_code == CLOSE_PROTOCOL_ERROR


def test_unknown_type_reason_stays_short() -> None:
    with pytest.raises(ProtocolError) as info:
        decode(json.dumps({"type": "x" * 10_000}))
    assert len(info.value.reason) < 100


def test_every_field_error_is_reported_at_once() -> None:
    frame = _register(node_id=1, protocol="1", providers=[{"id": "g", "adapter": "a", "capacity": True}], extra=0)
    with pytest.raises(ProtocolError) as info:
        decode(frame)
    reason = info.value.reason
    for part in ("$.node_id", "$.protocol", "$.providers[0].capacity", "extra fields found (extra)"):
        assert part in reason


def test_protocol_version_is_not_checked_by_decode() -> None:
    """The Edge answers `rejected protocol_mismatch`; a decode error would close with 1002 instead."""
    message = decode(_register(protocol=99))
    assert isinstance(message, Register)
    assert message.protocol == 99


@pytest.mark.parametrize(
    "build",
    [
        lambda: RunEnd("r", "error"),
        lambda: RunEnd("r", "ok", "cancelled"),
        lambda: RunEnd("r", "cancelled", "bad_request"),
        lambda: RunEnd("r", "finished"),
        lambda: TunnelEnd("r", "error", "nope"),
        lambda: Run("r", "p", "v1/chat/completions", {}, False),
        lambda: Rejected("banned", "no", False),
    ],
)
def test_invalid_message_cannot_be_constructed(build: Any) -> None:
    with pytest.raises(ValueError):
        build()


def test_every_end_code_is_accepted_with_status_error() -> None:
    for code in ERROR_CODES:
        assert decode(encode(RunEnd("r", "error", code))) == RunEnd("r", "error", code)
    for code in REJECT_CODES:
        assert decode(encode(Rejected(code, "why", False))).code == code


def test_encode_rejects_what_is_not_a_message() -> None:
    with pytest.raises(TypeError, match="encode\\(\\) expects a wire message, got ProviderInfo"):
        encode(ProviderInfo("g", "a", 1))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        encode({"type": "cancel", "run_id": "r"})  # type: ignore[arg-type]


def test_encode_rejects_data_that_is_not_json() -> None:
    with pytest.raises(ValueError):
        encode(Run("r", "p", "completions", {"v": float("nan")}, False))
    with pytest.raises(TypeError):
        encode(Run("r", "p", "completions", {"v": b"bytes"}, False))


def test_register_repr_hides_the_token() -> None:
    message = Register("node-a", "s3cr3t-token", 1, ())
    assert "s3cr3t-token" not in repr(message)
    assert "s3cr3t-token" not in str(message)
    assert "node-a" in repr(message)
    assert "s3cr3t-token" not in repr(decode(encode(message)))


def test_tunnel_chunk_bytes_helpers() -> None:
    raw = bytes(range(256))
    chunk = TunnelChunk.from_bytes("t", raw)
    assert chunk.payload() == raw
    assert decode(encode(chunk)).payload() == raw  # type: ignore[union-attr]
    assert TunnelChunk.from_bytes("t", b"").data == ""


def test_tunnel_request_bytes_helpers() -> None:
    request = TunnelRequest.from_bytes("t", "gpu0", "POST", "/api/chat", (("a", "b"),), b'{"model":"m"}')
    assert request.headers == (("a", "b"),)
    assert request.body_bytes() == b'{"model":"m"}'
    assert TunnelRequest("t", "gpu0", "GET", "/v1/models").body_bytes() == b""


@pytest.mark.parametrize("bad", ["not base64!", "abc", "YQ=", "é", "YWJj\n"])
def test_bad_base64_raises_protocol_error_when_read(bad: str) -> None:
    """Base64 is not checked by decode() (it costs per chunk); the helpers check it."""
    chunk = decode(json.dumps({"type": "tunnel_chunk", "run_id": "t", "data": bad}))
    assert isinstance(chunk, TunnelChunk)
    with pytest.raises(ProtocolError, match="tunnel_chunk 't': data is not valid base64"):
        chunk.payload()
    request = TunnelRequest("t", "p", "POST", "/x", (), bad)
    with pytest.raises(ProtocolError, match="tunnel_request 't': body is not valid base64"):
        request.body_bytes()


def test_close_reason_fits_a_close_frame() -> None:
    short = ProtocolError("bad frame")
    assert short.close_reason == "bad frame"
    long = ProtocolError("é" * 200)
    assert len(long.close_reason.encode("utf-8")) <= 123
    assert long.close_reason.endswith("...")
    assert long.reason == "é" * 200


# --------------------------------------------------------------------------- docs/wire.md


DOC = Path(__file__).resolve().parents[2] / "docs" / "wire.md"


@pytest.mark.req("contract-spec-sync")
def test_doc_names_every_message_field_and_code() -> None:
    """[contract-spec-sync] docs/wire.md documents every tag, field and code the code has."""
    text = DOC.read_text(encoding="utf-8")
    for cls, tag in TAGS.items():
        assert f"`{tag}`" in text, tag
        for field in attrs.fields(cls):
            assert f"`{field.name}`" in text, (tag, field.name)
    for field in attrs.fields(ProviderInfo):
        assert f"`{field.name}`" in text
    for code in (*ERROR_CODES, *REJECT_CODES, *FAILURE_KINDS):
        assert f"`{code}`" in text, code
    for number in ("1000", "1001", "1002", "1008", "1009", str(MAX_MESSAGE_BYTES), "heartbeat_timeout_ms", "15000"):
        assert number in text, number


@pytest.mark.req("contract-spec-sync")
def test_doc_example_exchange_decodes() -> None:
    """[contract-spec-sync] Every frame of the example exchange in docs/wire.md is a valid message."""
    lines = [line for line in DOC.read_text(encoding="utf-8").splitlines() if line.startswith(("N→E ", "E→N "))]
    messages = []
    for line in lines:
        direction, frame = line.split(" ", 1)
        message = decode(frame.strip())
        assert isinstance(message, get_args(NodeMessage) if direction == "N→E" else get_args(EdgeMessage)), line
        assert encode(message) == frame.strip(), "the example shows what encode() emits"
        messages.append(message)
    assert [TAGS[type(m)] for m in messages] == [
        "register",
        "registered",
        "run",
        "run_end",
        "heartbeat",
        "provider_health",
        "tunnel_request",
        "tunnel_start",
        "tunnel_chunk",
        "tunnel_end",
    ]


# --------------------------------------------------------------------------- data frames


@pytest.mark.req("wire-versioning")
def test_data_frame_round_trip_keeps_records_and_bytes() -> None:
    """[wire-versioning] Records of several runs in one frame come back in order, bytes untouched."""
    records = [
        iop_wire.RunData("r1", 0, b"data: {}\r\n\r\n"),
        iop_wire.RunData("r22", 0, b"\xc3"),  # half a UTF-8 character: data is opaque
        iop_wire.RunData("r1", 1, b""),
        iop_wire.RunData("r22", 1, b"\xa9 [DONE]"),
    ]
    frame = iop_wire.encode_data(records)
    assert frame[:3] == b"\x02r1" and frame[3:11] == b"\x00\x00\x00\x00\x00\x00\x00\x0c"
    assert iop_wire.decode_data(frame) == records


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (b"", "empty"),
        (b"\x02r1\x00\x00\x00\x00\x00", "truncated data record header"),
        (b"\x02r1\x00\x00\x00\x00\x00\x00\x00\x05abc", "announces 5 bytes, 3 left"),
        (b"\x02r\xff\x00\x00\x00\x00\x00\x00\x00\x00", "not ASCII"),
    ],
)
@pytest.mark.req("wire-versioning")
def test_bad_data_frames_are_protocol_errors(frame: bytes, reason: str) -> None:
    """[wire-versioning] Empty, truncated or non-ASCII run id: ProtocolError with close code 1002."""
    with pytest.raises(iop_wire.ProtocolError) as caught:
        iop_wire.decode_data(frame)
    assert reason in caught.value.reason
    assert caught.value.close_code == iop_wire.CLOSE_PROTOCOL_ERROR


def test_oversized_data_frame_is_1009() -> None:
    frame = iop_wire.encode_data([iop_wire.RunData("r1", 0, b"x" * 100)])
    with pytest.raises(iop_wire.ProtocolError) as caught:
        iop_wire.decode_data(frame, max_bytes=50)
    assert caught.value.close_code == iop_wire.CLOSE_TOO_BIG


def test_record_header_refuses_ids_and_counters_it_cannot_carry() -> None:
    with pytest.raises(ValueError):
        iop_wire.record_header("r" * 256, 0, 0)
    with pytest.raises(ValueError):
        iop_wire.record_header("r1", 2**32, 0)
    with pytest.raises(UnicodeEncodeError):
        iop_wire.record_header("rü", 0, 0)
