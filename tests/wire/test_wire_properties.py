"""Hypothesis properties of the wire codec: round trip, and decode() raises only ProtocolError."""

from __future__ import annotations

import json
from typing import Any
from unittest import mock

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

import iop_wire._codec
from iop_wire import (
    ENDPOINTS,
    ERROR_CODES,
    REJECT_CODES,
    Cancel,
    Heartbeat,
    Message,
    ProtocolError,
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

# Example counts come from the suite profile (tests/conftest.py: ci, soak).
SETTINGS = settings(deadline=None)

texts = st.text(max_size=12)
ints = st.integers(min_value=-(2**63), max_value=2**64)
json_scalars = st.none() | st.booleans() | ints | st.floats(allow_nan=False, allow_infinity=False) | texts
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
json_objects = st.dictionaries(texts, json_values, max_size=5)
headers = st.lists(st.tuples(texts, texts), max_size=4).map(tuple)
optional_texts = st.none() | texts

# (status, code) pairs that satisfy "code required iff status != ok".
END_OUTCOMES = [("ok", None), *(("error", code) for code in ERROR_CODES), ("cancelled", "cancelled")]


def ends(cls: type[Any], **extra: Any) -> st.SearchStrategy[Any]:
    return st.sampled_from(END_OUTCOMES).flatmap(
        lambda outcome: st.builds(
            cls, run_id=texts, status=st.just(outcome[0]), code=st.just(outcome[1]), message=optional_texts, **extra
        )
    )


messages: st.SearchStrategy[Any] = st.one_of(
    st.builds(
        Register,
        node_id=texts,
        token=texts,
        protocol=ints,
        providers=st.lists(st.builds(ProviderInfo, id=texts, adapter=texts, capacity=ints), max_size=3).map(tuple),
    ),
    st.builds(Heartbeat, seq=ints),
    ends(RunEnd, upstream_status=st.none() | ints, upstream_body=optional_texts),
    st.builds(TunnelStart, run_id=texts, status=ints, headers=headers),
    st.builds(TunnelChunk.from_bytes, run_id=texts, raw=st.binary(max_size=64)),
    ends(TunnelEnd),
    st.builds(Registered, node_id=texts, generation=ints, heartbeat_interval_ms=ints),
    st.builds(Rejected, code=st.sampled_from(REJECT_CODES), reason=texts, retryable=st.booleans()),
    st.builds(
        Run, run_id=texts, provider=texts, endpoint=st.sampled_from(ENDPOINTS), body=json_objects, stream=st.booleans()
    ),
    st.builds(Cancel, run_id=texts),
    st.builds(
        TunnelRequest.from_bytes,
        run_id=texts,
        provider=texts,
        method=st.sampled_from(["GET", "POST", "DELETE"]),
        path=texts,
        headers=headers,
        body=st.binary(max_size=64),
    ),
)


def decode_or_error(data: str | bytes, **kwargs: Any) -> Message | ProtocolError:
    """decode(), with ProtocolError as a value: any other exception fails the test."""
    try:
        message = decode(data, **kwargs)
    except ProtocolError as exc:
        assert exc.reason  # noqa: PT017 (the reason of every refusal, not whether one is raised)
        return exc
    assert type(message) in {
        Register,
        Heartbeat,
        RunEnd,
        TunnelStart,
        TunnelChunk,
        TunnelEnd,
        Registered,
        Rejected,
        Run,
        Cancel,
        TunnelRequest,
    }
    return message


@SETTINGS
@given(messages)
def test_round_trip_property(message: Any) -> None:
    text = encode(message)
    assert decode(text) == message
    assert encode(decode(text)) == text


@SETTINGS
@given(st.text())
def test_decode_arbitrary_text_raises_only_protocol_error(data: str) -> None:
    decode_or_error(data)


@SETTINGS
@given(st.binary())
def test_decode_arbitrary_bytes_raises_only_protocol_error(data: bytes) -> None:
    decode_or_error(data)


@SETTINGS
@given(json_values, st.integers(min_value=0, max_value=200))
def test_decode_arbitrary_json_raises_only_protocol_error(value: Any, max_bytes: int) -> None:
    decode_or_error(json.dumps(value))
    decode_or_error(json.dumps(value), max_bytes=max_bytes)


MUTATIONS = ("delete", "replace", "add")


@SETTINGS
@given(messages, st.sampled_from(MUTATIONS), st.data())
def test_decode_mutated_message_raises_only_protocol_error(message: Any, mutation: str, data: st.DataObject) -> None:
    """Near-valid frames: one key deleted, replaced by any JSON value, or added."""
    obj = json.loads(encode(message))
    if mutation == "add":
        key = data.draw(texts.filter(lambda k: k not in obj), label="key")
        obj[key] = data.draw(json_values, label="value")
        result = decode_or_error(json.dumps(obj))
        assert isinstance(result, ProtocolError)
        assert "extra fields found" in result.reason
        return
    key = data.draw(st.sampled_from(sorted(obj)), label="key")
    if mutation == "delete":
        del obj[key]
        result = decode_or_error(json.dumps(obj))
        field = {f.name: f for f in attrs.fields(type(message))}.get(key)
        if key == "type":
            assert isinstance(result, ProtocolError)
            assert "missing message type" in result.reason
        elif field is not None and field.default is attrs.NOTHING:
            assert isinstance(result, ProtocolError)
            assert f"$.{key}" in result.reason
    else:
        obj[key] = data.draw(json_values, label="value")
        decode_or_error(json.dumps(obj))


runs = st.builds(
    Run, run_id=texts, provider=texts, endpoint=st.sampled_from(ENDPOINTS), body=json_objects, stream=st.booleans()
)


@SETTINGS
@given(runs, st.sampled_from(("keep", *MUTATIONS)), st.data())
def test_run_frames_decode_as_the_converter_decodes_them(run: Run, mutation: str, data: st.DataObject) -> None:
    """decode() builds a plain ``run`` without the converter: same message, same refusals."""
    obj = json.loads(encode(run))
    if mutation == "add":
        obj[data.draw(texts.filter(lambda k: k not in obj), label="key")] = data.draw(json_values, label="value")
    elif mutation != "keep":
        key = data.draw(st.sampled_from(sorted(obj)), label="key")
        if mutation == "delete":
            del obj[key]
        else:
            obj[key] = data.draw(json_values | st.sampled_from(["run", *ENDPOINTS, "rerank"]), label="value")
    frame = json.dumps(obj)
    fast = decode_or_error(frame)
    with mock.patch.object(iop_wire._codec, "_plain_run", return_value=None):
        converted = decode_or_error(frame)
    if isinstance(converted, ProtocolError):
        assert isinstance(fast, ProtocolError)
        assert (fast.reason, fast.close_code) == (converted.reason, converted.close_code)
    else:
        assert type(fast) is type(converted)
        assert fast == converted
    if mutation == "keep":
        assert fast == run


@settings(deadline=None)
@given(
    st.text(max_size=16),
    st.sampled_from([("ok", None), ("error", "upstream_error"), ("cancelled", "cancelled")]),
    st.none() | st.text(max_size=8),
    st.none() | st.integers(min_value=100, max_value=599),
)
def test_end_frames_are_what_the_converter_writes(
    run_id: str, outcome: tuple[str, str | None], message: str | None, upstream_status: int | None
) -> None:
    """A run's plain ok end is written from a template: byte for byte the converter's frame."""
    end = RunEnd(run_id, outcome[0], outcome[1], message, upstream_status)
    with mock.patch.object(iop_wire._codec, "_plain_ok_end", return_value=False):
        by_converter = encode(end)
    assert encode(end) == by_converter
