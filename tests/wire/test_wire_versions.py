"""The version pair: the current wire version and the previous, and a run said to a peer of either. [wire-versioning]"""

from __future__ import annotations

import json
from typing import get_args

import attrs
import pytest

from iop_wire import (
    ENDPOINTS,
    OLDEST_PROTOCOL,
    PROTOCOL_VERSION,
    PROTOCOL_VERSIONS,
    Message,
    ProtocolError,
    ProviderHealth,
    Run,
    TunnelRequest,
    decode,
    encode,
    encode_run,
    end_code_for,
    run_for,
    speaks,
    spoken,
)

pytestmark = pytest.mark.req("wire-versioning")

BODY = '{"model": "alias", "messages": [{"role": "user", "content": "h\\u00e9"}], "n": 1.50}'


def client_run(endpoint: str = "chat/completions", *, stream: bool = True) -> Run:
    """A run as the API builds it, in the current version's shape: empty body, the upstream model and
    the deadline beside it."""
    return Run("r1", "gpu0", endpoint, {}, stream and endpoint != "embeddings", 7, True, "upstream-model", 2500)


def test_two_versions_are_spoken_the_current_and_the_previous() -> None:
    assert PROTOCOL_VERSIONS == (OLDEST_PROTOCOL, PROTOCOL_VERSION) == (5, 6)
    assert spoken() == "5 and 6"


def test_a_peer_of_the_current_version_gets_the_run_as_built() -> None:
    run = client_run()
    assert run_for(PROTOCOL_VERSION, run, BODY) == (run, BODY)
    frame = encode_run(*run_for(PROTOCOL_VERSION, run, BODY))
    assert BODY in frame  # the client's text, character for character
    assert json.loads(frame)["deadline_ms"] == 2500
    assert decode(frame) == attrs.evolve(run, body=json.loads(BODY))


@pytest.mark.req("deadline")
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_a_peer_of_the_previous_version_gets_the_run_without_its_deadline(endpoint: str) -> None:
    """[deadline] v6 adds ``run.deadline_ms``: a v5 peer gets the run without it (its strict decoder
    knows no such key), the client's body still as sent; every other field stays."""
    run, body_json = run_for(OLDEST_PROTOCOL, client_run(endpoint), BODY)
    assert body_json == BODY
    assert run == attrs.evolve(client_run(endpoint), deadline_ms=None)
    frame = encode_run(run, BODY)
    assert "deadline_ms" not in json.loads(frame) and BODY in frame


def test_a_run_without_a_deadline_is_the_same_frame_in_both_versions() -> None:
    run = attrs.evolve(client_run(), deadline_ms=None)
    assert run_for(OLDEST_PROTOCOL, run, BODY) == run_for(PROTOCOL_VERSION, run, BODY) == (run, BODY)


@pytest.mark.req("deadline", "error-classes")
def test_the_current_versions_end_codes_in_the_previous_versions_words() -> None:
    """[deadline] [error-classes] a v6 node ends a stalled stream ``stream_stalled``; to a v5 Edge it
    says ``upstream_unreachable``, as a v5 node did. Every other code is the same in both."""
    assert end_code_for(PROTOCOL_VERSION, "stream_stalled") == "stream_stalled"
    assert end_code_for(OLDEST_PROTOCOL, "stream_stalled") == "upstream_unreachable"
    assert end_code_for(OLDEST_PROTOCOL, "deadline_exceeded") == "upstream_unreachable"
    for code in (None, "cancelled", "upstream_error", "concurrency_limit", "stale_epoch"):
        assert end_code_for(OLDEST_PROTOCOL, code) == code
    with pytest.raises(ValueError, match="wire v4 is not spoken"):
        end_code_for(4, "stream_stalled")


@pytest.mark.req("deadline")
@pytest.mark.parametrize("value", ["0", "-5", '"2500"', "true", "2.5"])
def test_a_deadline_that_is_not_a_positive_integer_is_a_protocol_error(value: str) -> None:
    frame = (
        '{"type":"run","run_id":"r","provider":"p","endpoint":"completions","body":{},"stream":false,'
        f'"deadline_ms":{value}}}'
    )
    with pytest.raises(ProtocolError, match="deadline_ms"):
        decode(frame)


@pytest.mark.parametrize("version", [OLDEST_PROTOCOL - 1, PROTOCOL_VERSION + 1, 1])
def test_a_version_outside_the_pair_is_no_peer(version: int) -> None:
    with pytest.raises(ValueError, match=f"wire v{version} is not spoken"):
        run_for(version, client_run(), BODY)
    with pytest.raises(ValueError, match=f"wire v{version} is not spoken"):
        speaks(version, Run)


@pytest.mark.req("health-probe")
def test_the_previous_version_reads_every_message_type_but_the_health_reports() -> None:
    """v6 added fields, end codes and one message type, the node's ``provider_health`` [health-probe]:
    a v6 peer reads every type, a v5 peer every other one."""
    assert all(speaks(PROTOCOL_VERSION, kind) for kind in get_args(Message))
    unread = [kind for kind in get_args(Message) if not speaks(OLDEST_PROTOCOL, kind)]
    assert unread == [ProviderHealth]


def test_the_previous_version_reads_every_other_message_as_the_current_one_writes_it() -> None:
    """Only ``run`` differs between the two: a tunnel request, with its epoch, is the same frame."""
    request = TunnelRequest.from_bytes("t1", "gpu0", "GET", "/v1/models", (("accept", "*/*"),), b"", 3)
    assert decode(encode(request)) == request
