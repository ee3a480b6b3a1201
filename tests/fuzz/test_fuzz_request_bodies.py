"""Structure-aware fuzz of request bodies, against one running Edge and its real node (issue 37).

Bodies are built as bytes, piece by piece, so that they can hold what a JSON library would
never write: lone surrogates (escaped or as bytes), invalid UTF-8, duplicate keys, numbers
spelt to re-encode larger (``1e15``), deep nesting, huge arrays, and a value of the wrong type
in every field the Edge reads. Each example checks the answer (never a 500; a body that breaks
one of the JSON rules of docs/openai-api.md is a 400 ``bad_request``) and then the Edge: its
thread alive, no traceback logged, a healthy request served and every counter back to 0.

A short run is part of ``make test`` (:data:`EXAMPLES` examples per test); ``make fuzz`` runs
it long (``IOP_FUZZ_EXAMPLES``, docs/security.md).
[lease-lifecycle] [contract-spec-sync]
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator

import httpx
import pytest
import trio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fuzz.harness import HEALTHY_MODEL, MAX_BODY_BYTES, EdgeThread, assert_healthy
from iop_mock.completion import MAX_TOKENS_LIMIT

pytestmark = pytest.mark.req("lease-lifecycle", "contract-spec-sync")

EXAMPLES = int(os.environ.get("IOP_FUZZ_EXAMPLES", "30"))
"""Examples per test: a few dozen in ``make test``, thousands under ``make fuzz``."""
EXAMPLE_TIMEOUT = 10.0
MAX_DEPTH = 64  # docs/openai-api.md: arrays and objects nested at most 64 deep

Fragment = tuple[bytes, bool]
"""A piece of a body: its bytes, and whether it breaks a JSON rule (the body must then be a 400)."""


# ------------------------------------------------------------------ fragments

_NUMBERS = [b"1e15", b"1E+300", b"-0.0", b"1e-7", b"0.1", b"123456789012345678901234567890", b"-1", b"2.5e-308"]
"""Numbers a re-encoding spells longer (``1e15`` becomes ``1000000000000000.0``)."""

_BAD_STRINGS = [
    b'"x\\ud800y"',  # a lone high surrogate, escaped
    b'"\\udfff"',  # a lone low surrogate, escaped
    b'"\\ude00\\ud83d"',  # a pair in the wrong order
    b'"\xed\xa0\x80"',  # a surrogate as UTF-8 bytes
    b'"\xff\xfe"',  # not UTF-8
    b'"\xc3"',  # a truncated sequence
]

_GOOD_STRINGS = [
    b'"\\ud83d\\ude00"',  # a valid escaped pair
    '"é\u2028\u00a0\ufeff𝄞"'.encode(),  # multi-byte characters, a separator, a no-break space, a BOM char
    b'"\\u0000\\n\\t\\"\\\\"',  # escapes
    b'"' + b"a" * 2000 + b'"',
]


@st.composite
def strings(draw: st.DrawFn) -> Fragment:
    kind = draw(st.sampled_from(["text", "good", "bad"]))
    if kind == "bad":
        return draw(st.sampled_from(_BAD_STRINGS)), True
    if kind == "good":
        return draw(st.sampled_from(_GOOD_STRINGS)), False
    text = draw(st.text(st.characters(exclude_categories=["Cs"]), max_size=40))
    return json.dumps(text, ensure_ascii=draw(st.booleans())).encode(), False


scalars: st.SearchStrategy[Fragment] = st.one_of(
    st.sampled_from([(b"null", False), (b"true", False), (b"false", False), (b"0", False)]),
    st.sampled_from(_NUMBERS).map(lambda n: (n, False)),
    st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e999"]).map(lambda n: (n, True)),
    # (a max_tokens between 65 and the mock's limit is a long legitimate answer: left out)
    st.one_of(st.integers(-(2**80), 64), st.integers(MAX_TOKENS_LIMIT + 1, 2**80)).map(
        lambda n: (str(n).encode(), False)
    ),
    strings(),
)


def _array(items: list[Fragment]) -> Fragment:
    return b"[" + b",".join(i[0] for i in items) + b"]", any(i[1] for i in items)


@st.composite
def _object(draw: st.DrawFn, values: st.SearchStrategy[Fragment]) -> Fragment:
    keys = draw(st.lists(strings(), max_size=4))
    items = [(key, draw(values)) for key in keys]
    decoded = [key if bad else json.loads(key) for key, bad in keys]  # "\u00e9" and "é" are one key
    duplicate = len(set(decoded)) < len(decoded)
    if draw(st.booleans()) and items:
        duplicate = True
    if duplicate:
        items.append((items[0][0], draw(values)))
    text = b"{" + b",".join(k[0] + b":" + v[0] for k, v in items) + b"}"
    return text, duplicate or any(k[1] or v[1] for k, v in items)


values: st.SearchStrategy[Fragment] = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4).map(_array) | _object(inner),
    max_leaves=10,
)


@st.composite
def nested(draw: st.DrawFn) -> Fragment:
    """Arrays nested ``depth`` deep around a scalar, as a top-level field's value: with the top
    object, ``depth + 1`` levels; deeper than the rule allows is a 400."""
    depth = draw(st.one_of(st.integers(1, MAX_DEPTH + 4), st.integers(MAX_DEPTH, 1200)))
    inner, bad = draw(scalars)
    too_deep = depth + 1 > MAX_DEPTH
    event("nested past the limit" if too_deep else "nested within the limit")
    return b"[" * depth + inner + b"]" * depth, bad or too_deep


@st.composite
def huge_arrays(draw: st.DrawFn) -> Fragment:
    number = draw(st.sampled_from(_NUMBERS))
    count = draw(st.integers(1, MAX_BODY_BYTES // (len(number) + 1)))
    return b"[" + b",".join([number] * count) + b"]", False


field_values = st.one_of(values, nested(), huge_arrays())


# ------------------------------------------------------------------ bodies

_FIELDS = {
    "/v1/chat/completions": (b'"messages"', b'[{"role":"user","content":"hi"}]'),
    "/v1/completions": (b'"prompt"', b'"hi"'),
    "/v1/embeddings": (b'"input"', b'"hi"'),
}


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes, bool]:
    """(path, body, breaks_a_rule): a request whose fields, one or more, may be anything."""
    path = draw(st.sampled_from(list(_FIELDS)))
    name, default = _FIELDS[path]
    fields: dict[bytes, Fragment] = {
        b'"model"': (json.dumps(HEALTHY_MODEL).encode(), False),
        name: (default, False),
        b'"max_tokens"': (b"2", False),
    }
    for field in draw(st.lists(st.sampled_from([b'"model"', name, b'"stream"', b'"max_tokens"', b'"x"']))):
        fields[field] = draw(field_values)  # a wrong type, an odd number, deep, huge, not text ...
        event(f"field {field.decode()} replaced")
    pairs = [key + b":" + value[0] for key, value in fields.items()]
    broken = any(value[1] for value in fields.values())
    if draw(st.booleans()):  # a key twice, with the same or another value
        key = draw(st.sampled_from(list(fields)))
        pairs.append(key + b":" + draw(field_values)[0])
        broken = True
    raw = b"{" + b",".join(pairs) + b"}"
    if draw(st.booleans()):
        raw = b" \n\t" + raw.replace(b",", b" , ") + b"\r\n"  # insignificant whitespace
    return path, raw, broken


# ------------------------------------------------------------------ checks


class _Tracebacks(logging.Handler):
    """Every log record with a traceback or at ERROR, from any thread (the Edge's included)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def filter(self, record: logging.LogRecord) -> bool:
        return bool(record.exc_info) or record.levelno >= logging.ERROR


@pytest.fixture(scope="module")
def tracebacks() -> Iterator[_Tracebacks]:
    handler = _Tracebacks()
    handler.setLevel(logging.DEBUG)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)


@settings(max_examples=EXAMPLES, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=bodies())
async def test_request_body_is_answered_and_the_edge_serves_on(
    edge_thread: EdgeThread, tracebacks: _Tracebacks, case: tuple[str, bytes, bool]
) -> None:
    """Any body: never a 500; one breaking a JSON rule is a 400 ``bad_request`` (or 413 when too
    large); then the Edge thread is alive, no traceback was logged, a healthy request is served
    and every counter is back to 0."""
    path, raw, broken = case
    event("breaks a rule" if broken else "strict JSON")
    with trio.fail_after(EXAMPLE_TIMEOUT):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{edge_thread.http_port}", timeout=5) as http:
            response = await http.post(path, content=raw, headers={"content-type": "application/json"})
            assert response.status_code != 500, response.text
            if len(raw) > MAX_BODY_BYTES:
                assert response.status_code == 413, response.text
            elif broken:
                assert response.status_code == 400, (raw[:300], response.text)
                assert response.json()["error"]["code"] == "bad_request"
            else:
                assert response.status_code in (200, 400, 404, 502), response.text
            event(f"answered {response.status_code}")
        # A new connection: past the limit the Edge answers 413 and closes without reading the rest.
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{edge_thread.http_port}", timeout=5) as http:
            await assert_healthy(http)
    assert edge_thread.alive
    assert not tracebacks.records, [r.getMessage() for r in tracebacks.records]
