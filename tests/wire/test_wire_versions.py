"""The version pair: the current wire version and the previous, and a run said to a peer of either. [wire-versioning]"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from iop_wire import (
    ENDPOINTS,
    OLDEST_PROTOCOL,
    PROTOCOL_VERSION,
    PROTOCOL_VERSIONS,
    Run,
    TunnelRequest,
    decode,
    encode,
    encode_run,
    run_for,
    spoken,
)

pytestmark = pytest.mark.req("wire-versioning")

BODY = '{"model": "alias", "messages": [{"role": "user", "content": "h\\u00e9"}], "n": 1.50}'


def client_run(endpoint: str = "chat/completions", *, stream: bool = True) -> Run:
    """A run as the API builds it, in the current version's shape: empty body, the upstream model beside it."""
    return Run("r1", "gpu0", endpoint, {}, stream, 7, True, "upstream-model")


def test_two_versions_are_spoken_the_current_and_the_previous() -> None:
    assert PROTOCOL_VERSIONS == (OLDEST_PROTOCOL, PROTOCOL_VERSION) == (4, 5)
    assert spoken() == "4 and 5"


def test_a_peer_of_the_current_version_gets_the_run_as_built() -> None:
    run = client_run()
    assert run_for(PROTOCOL_VERSION, run, BODY) == (run, BODY)
    frame = encode_run(*run_for(PROTOCOL_VERSION, run, BODY))
    assert BODY in frame  # the client's text, character for character


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("stream", [True, False])
def test_a_peer_of_the_previous_version_gets_the_body_with_the_model_put_in(endpoint: str, stream: bool) -> None:
    """v4 has no ``run.model``: the body goes re-encoded with the upstream model (and, for the
    completion endpoints, ``stream``) in it, as a v4 node sends it upstream; the other fields stay."""
    stream = stream and endpoint != "embeddings"
    run, body_json = run_for(OLDEST_PROTOCOL, client_run(endpoint, stream=stream), BODY)
    assert body_json is None
    assert run.model is None
    expected = {**json.loads(BODY), "model": "upstream-model"}
    if endpoint != "embeddings":
        expected["stream"] = stream
    assert run.body == expected
    assert (run.run_id, run.provider, run.endpoint, run.stream, run.epoch, run.long) == (
        "r1",
        "gpu0",
        endpoint,
        stream,
        7,
        True,
    )
    frame = encode(run)
    assert '"model":"upstream-model"' in frame and not json.loads(frame).keys() - {
        "type",
        "run_id",
        "provider",
        "endpoint",
        "body",
        "stream",
        "epoch",
        "long",
    }
    assert decode(frame) == run


def test_a_run_built_with_its_body_reaches_either_peer_alike() -> None:
    """A run whose body is already a dict (no client text) is said to a v4 peer the same way."""
    run = Run("r1", "gpu0", "completions", json.loads(BODY), False, None, False, "upstream-model")
    assert run_for(OLDEST_PROTOCOL, run)[0].body == {**json.loads(BODY), "model": "upstream-model", "stream": False}
    assert run_for(PROTOCOL_VERSION, run) == (run, None)


@pytest.mark.parametrize("version", [OLDEST_PROTOCOL - 1, PROTOCOL_VERSION + 1, 1])
def test_a_version_outside_the_pair_is_no_peer(version: int) -> None:
    with pytest.raises(ValueError, match=f"wire v{version} is not spoken"):
        run_for(version, client_run(), BODY)


def test_the_previous_version_reads_every_other_message_as_the_current_one_writes_it() -> None:
    """Only ``run`` differs between the two: a tunnel request, with its epoch, is the same frame."""
    request = TunnelRequest.from_bytes("t1", "gpu0", "GET", "/v1/models", (("accept", "*/*"),), b"", 3)
    assert decode(encode(request)) == request


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@given(body=st.dictionaries(st.text(max_size=10), json_values, max_size=5), stream=st.booleans())
def test_the_previous_versions_body_is_what_a_current_node_sends_upstream(body: dict[str, Any], stream: bool) -> None:
    """Whatever the client's body, a v4 node is given exactly what a v5 node puts together itself."""
    text = json.dumps(body, ensure_ascii=False)
    run = Run("r1", "gpu0", "chat/completions", {}, stream, None, False, "m")
    older, _ = run_for(OLDEST_PROTOCOL, run, text)
    assert older.body == decode(encode_run(run, text)).upstream_body()  # type: ignore[union-attr]
