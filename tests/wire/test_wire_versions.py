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
    EngineView,
    Message,
    ProtocolError,
    ProviderHealth,
    Run,
    TunnelRequest,
    decode,
    encode,
    encode_run,
    end_code_for,
    health_for,
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
    assert PROTOCOL_VERSIONS == (OLDEST_PROTOCOL, PROTOCOL_VERSION) == (6, 7)
    assert spoken() == "6 and 7"


def test_a_peer_of_the_current_version_gets_the_run_as_built() -> None:
    run = client_run()
    assert run_for(PROTOCOL_VERSION, run, BODY) == (run, BODY)
    frame = encode_run(*run_for(PROTOCOL_VERSION, run, BODY))
    assert BODY in frame  # the client's text, character for character
    assert json.loads(frame)["deadline_ms"] == 2500
    assert decode(frame) == attrs.evolve(run, body=json.loads(BODY))


@pytest.mark.req("deadline")
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_a_peer_of_the_previous_version_gets_the_run_as_built(endpoint: str) -> None:
    """v7 adds nothing to ``run``: a v6 peer gets it with its deadline, the client's body as sent."""
    run = client_run(endpoint)
    assert run_for(OLDEST_PROTOCOL, run, BODY) == run_for(PROTOCOL_VERSION, run, BODY) == (run, BODY)


@pytest.mark.req("deadline", "error-classes")
def test_the_end_codes_are_the_same_in_both_versions() -> None:
    """[deadline] [error-classes] v7 adds no end code: ``stream_stalled`` and ``deadline_exceeded``
    (v6's) are said as they are to a peer of either."""
    for code in (None, "cancelled", "upstream_error", "stream_stalled", "deadline_exceeded", "stale_epoch"):
        assert end_code_for(OLDEST_PROTOCOL, code) == end_code_for(PROTOCOL_VERSION, code) == code
    with pytest.raises(ValueError, match="wire v5 is not spoken"):
        end_code_for(5, "stream_stalled")


ENGINE = EngineView(kv_use=0.41, kv_tokens=None, kv_capacity=None, preemptions=3, running=2, waiting=0)


@pytest.mark.req("token-ledger")
def test_a_peer_of_the_previous_version_gets_the_health_report_without_the_engine_view() -> None:
    """[token-ledger] v7 adds ``provider_health.engine``: a v6 peer gets the report without it (its
    strict decoder knows no such key); the current version's frame carries it, and a report
    without one is the same frame in both."""
    report = ProviderHealth("gpu0", "ready", "", 2, ENGINE)
    old = health_for(OLDEST_PROTOCOL, report)
    assert old == ProviderHealth("gpu0", "ready", "", 2) and "engine" not in json.loads(encode(old))
    assert health_for(PROTOCOL_VERSION, report) is report
    assert decode(encode(report)) == report
    assert json.loads(encode(report))["engine"]["kv_use"] == 0.41
    plain = ProviderHealth("gpu0", "not_ready", "loading")
    assert health_for(OLDEST_PROTOCOL, plain) is plain and "engine" not in json.loads(encode(plain))
    with pytest.raises(ValueError, match="wire v5 is not spoken"):
        health_for(5, report)


@pytest.mark.req("token-ledger")
@pytest.mark.parametrize(
    ("engine", "field"),
    [
        ('{"kv_use":1.5}', "kv_use"),
        ('{"kv_use":-0.1}', "kv_use"),
        ('{"kv_use":1e999}', "kv_use"),
        ('{"kv_use":"0.5"}', "kv_use"),
        ('{"kv_use":true}', "kv_use"),
        ('{"preemptions":-1}', "preemptions"),
        ('{"preemptions":1.0}', "preemptions"),
        ('{"kv_tokens":9007199254740993}', "kv_tokens"),
        ('{"running":"2"}', "running"),
        ('{"waiting":null,"extra":1}', "extra"),
        ("[0.5]", "engine"),
    ],
)
def test_an_engine_view_out_of_its_bounds_is_a_protocol_error(engine: str, field: str) -> None:
    frame = f'{{"type":"provider_health","provider":"gpu0","state":"ready","engine":{engine}}}'
    with pytest.raises(ProtocolError, match=field):
        decode(frame)


@pytest.mark.req("token-ledger")
def test_an_engine_view_reads_whole_numbers_and_nulls() -> None:
    frame = '{"type":"provider_health","provider":"gpu0","state":"ready","engine":{"kv_use":1,"running":null}}'
    assert decode(frame) == ProviderHealth("gpu0", "ready", engine=EngineView(kv_use=1.0))


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
def test_the_previous_version_reads_every_message_type() -> None:
    """v7 adds a field, no message type: a peer of either version reads every type (v6's
    ``provider_health`` [health-probe] included)."""
    assert all(speaks(PROTOCOL_VERSION, kind) and speaks(OLDEST_PROTOCOL, kind) for kind in get_args(Message))


def test_the_previous_version_reads_every_other_message_as_the_current_one_writes_it() -> None:
    """Only ``run`` differs between the two: a tunnel request, with its epoch, is the same frame."""
    request = TunnelRequest.from_bytes("t1", "gpu0", "GET", "/v1/models", (("accept", "*/*"),), b"", 3)
    assert decode(encode(request)) == request
