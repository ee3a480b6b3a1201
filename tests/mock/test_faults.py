"""The mock backend's fault state (``POST /fault``) as a value: what it accepts, what it answers."""

from __future__ import annotations

import re

import pytest

from iop_mock.faults import Faults

pytestmark = pytest.mark.req("health-probe")


def test_a_fault_body_sets_the_whole_state_and_echoes_it() -> None:
    assert Faults.parse(b"") == Faults()
    assert Faults.parse(b'{"status": 503}').echo() == {"status": 503}
    hung = Faults.parse(b'{"hang": "mid_stream", "hang_after_tokens": 3, "loading": true}')
    assert hung == Faults(None, "mid_stream", 3, True)
    assert hung.echo() == {"status": None, "hang": "mid_stream", "hang_after_tokens": 3, "loading": True}
    assert hung.tokens_before_hang() == 3
    assert Faults(hang="head_only").tokens_before_hang() is None
    pressed = Faults.parse(b'{"kv_use": 1, "preemptions": 4}')
    assert pressed == Faults(kv_use=1.0, preemptions=4)
    assert pressed.echo() == {"status": None, "kv_use": 1.0, "preemptions": 4}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"[]", "the body must be a JSON object"),
        (b'{"hang": "forever"}', "hang must be one of none, no_answer, head_only, mid_stream"),
        (b'{"status": 200}', "status must be null or an HTTP error status (400-599)"),
        (b'{"hang_after_tokens": -1}', "hang_after_tokens must be an integer >= 0"),
        (b'{"loading": 1}', "loading must be true or false"),
        (b'{"slow": true}', "unknown keys ['slow']"),
        (b'{"kv_use": 1.5}', "kv_use must be null or a number in [0, 1]"),
        (b'{"kv_use": "0.5"}', "kv_use must be null or a number in [0, 1]"),
        (b'{"preemptions": -1}', "preemptions must be an integer >= 0"),
    ],
)
def test_a_bad_fault_body_is_refused_with_its_reason(body: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Faults.parse(body)
