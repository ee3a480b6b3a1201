"""Wire v5: a ``run`` carrying the client's body as sent (``encode_run``, ``Run.model``). [wire-versioning]"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from iop_wire import (
    MAX_MESSAGE_BYTES,
    RUN_ENVELOPE_BYTES,
    ProtocolError,
    Run,
    decode,
    encode,
    encode_run,
    max_body_bytes_for,
)

pytestmark = pytest.mark.req("wire-versioning")

json_bodies = st.dictionaries(
    st.text(max_size=10),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
        max_leaves=8,
    ),
    max_size=5,
)


@given(
    body=json_bodies,
    provider=st.text(min_size=1, max_size=30),
    model=st.text(max_size=30),
    spacing=st.sampled_from([(",", ":"), (", ", ": ")]),
    stream=st.booleans(),
)
def test_encode_run_carries_the_body_text_as_is(
    body: dict[str, Any], provider: str, model: str, spacing: tuple[str, str], stream: bool
) -> None:
    """Whatever the provider id holds (``,"body":{},`` included), the frame holds the body's text
    character for character, and decodes to the run with that body."""
    text = json.dumps(body, separators=spacing, ensure_ascii=False)
    run = Run("r1", provider + ',"body":{},', "chat/completions", {}, stream, None, False, model)
    frame = encode_run(run, text)
    assert f',"body":{text},' in frame
    decoded = decode(frame)
    assert decoded == Run(run.run_id, run.provider, run.endpoint, json.loads(text), stream, None, False, model)
    assert len(frame.encode()) - len(text.encode()) < 200 + len(provider.encode()) * 2 + len(model.encode()) * 2


def test_encode_run_wants_an_empty_body() -> None:
    with pytest.raises(ValueError, match="empty body"):
        encode_run(Run("r1", "p", "completions", {"x": 1}, False, model="m"), "{}")


def test_model_is_left_out_when_unset_and_typed_when_set() -> None:
    """A run without ``model`` is exactly the v4 frame; a ``model`` that is not a string is a protocol error."""
    assert '"model"' not in encode(Run("r1", "p", "completions", {}, False)).replace('"body":{}', "")
    frame = json.loads(encode(Run("r1", "p", "completions", {}, False, model="m")))
    assert frame["model"] == "m"
    frame["model"] = 5
    with pytest.raises(ProtocolError, match="model"):
        decode(json.dumps(frame))


@pytest.mark.parametrize(
    ("endpoint", "stream", "expected"),
    [
        ("chat/completions", True, {"model": "up", "messages": [], "stream": True, "x": 1}),
        ("completions", False, {"model": "up", "messages": [], "stream": False, "x": 1}),
        ("embeddings", False, {"model": "up", "messages": [], "x": 1}),
    ],
)
def test_node_puts_the_upstream_model_and_stream_in(endpoint: str, stream: bool, expected: dict[str, Any]) -> None:
    """``Run.for_upstream()``: the client's ``model`` and ``stream`` replaced (no ``stream`` for embeddings)."""
    client = {"model": "public", "messages": [], "stream": "whatever", "x": 1}
    if endpoint == "embeddings":
        del client["stream"]
    run = Run("r1", "p", endpoint, client, stream, None, False, "up")
    served = run.for_upstream()
    assert served.body == expected and served.model is None
    assert run.body == client  # the received run is left as it came
    before_v5 = Run("r1", "p", endpoint, client, stream)
    assert before_v5.for_upstream() is before_v5


def test_largest_body_fits_one_frame() -> None:
    """A body of max_body_bytes_for(limit) plus the run's fields stays within the limit."""
    body = '{"x":"' + "a" * (max_body_bytes_for() - 8) + '"}'
    assert len(body) == max_body_bytes_for()
    run = Run("r" + "9" * 19, "p" * 200, "chat/completions", {}, True, 2**62, True, "m" * 1000)
    frame = encode_run(run, body)
    assert len(frame.encode()) <= MAX_MESSAGE_BYTES
    assert MAX_MESSAGE_BYTES - len(frame.encode()) < RUN_ENVELOPE_BYTES
