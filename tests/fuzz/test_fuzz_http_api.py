"""Fuzz the Edge's HTTP API with malformed, wrong-shaped and oversized requests.

Every bad request gets a clear OpenAI-shaped error (400 ``bad_request``, 413
``request_too_large``, 404 ``model_not_found``), a request of the right shape
with odd contents gets an answer that is never a 500, garbage in place of an
HTTP request head gets a 400 or a closed connection, and afterwards the same
Edge serves a healthy request with every admission counter back to 0.
[lease-lifecycle] [contract-spec-sync]
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from fuzz.harness import HEALTHY_MODEL, MAX_BODY_BYTES, EdgeThread, assert_healthy, json_values
from iop_http import Refusal, accept_head, find_head_end
from iop_mock.completion import MAX_TOKENS_LIMIT

pytestmark = pytest.mark.req("lease-lifecycle", "contract-spec-sync")

EXAMPLE_TIMEOUT = 5.0
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


def client(edge: EdgeThread) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{edge.http_port}", timeout=EXAMPLE_TIMEOUT)


def valid_body(path: str) -> dict[str, Any]:
    if path == "/v1/chat/completions":
        return {"model": HEALTHY_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return {"model": HEALTHY_MODEL, "prompt": "hi", "max_tokens": 2}


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and isinstance(error["message"], str) and error["message"]
    assert response.headers["x-iop-reject-reason"] == code


@st.composite
def wrong_shapes(draw: st.DrawFn) -> tuple[str, Any]:
    """(path, body): one required field of a valid body replaced by a value of the wrong type."""
    path = draw(st.sampled_from(ENDPOINTS))
    body: Any = valid_body(path)
    field = draw(st.sampled_from(["<top>", "model", "stream", "messages" if "messages" in body else "prompt"]))
    if field == "<top>":
        body = draw(json_values.filter(lambda v: not isinstance(v, dict)))
    elif field == "model":
        body["model"] = draw(json_values.filter(lambda v: not isinstance(v, str) or v == ""))
    elif field == "stream":
        body["stream"] = draw(json_values.filter(lambda v: not isinstance(v, bool)))
    elif field == "messages":
        body["messages"] = draw(json_values.filter(lambda v: not isinstance(v, list) or v == []))
    else:
        body["prompt"] = draw(json_values.filter(lambda v: not isinstance(v, str | list)))
    event(f"wrong {field}")
    return path, body


@settings(max_examples=30)
@given(path=st.sampled_from(ENDPOINTS), raw=st.binary(max_size=256))
async def test_random_bytes_body_is_400(edge_thread: EdgeThread, path: str, raw: bytes) -> None:
    """Random bytes as the body: 400 bad_request (not JSON, or not a request object)."""
    with trio.fail_after(EXAMPLE_TIMEOUT):
        async with client(edge_thread) as http:
            response = await http.post(path, content=raw, headers={"content-type": "application/json"})
            assert_error(response, 400, "bad_request")
            await assert_healthy(http)


@settings(max_examples=40)
@given(case=wrong_shapes())
async def test_wrong_shape_is_400(edge_thread: EdgeThread, case: tuple[str, Any]) -> None:
    """JSON of the wrong shape or with wrong-typed required fields: 400 bad_request."""
    path, body = case
    with trio.fail_after(EXAMPLE_TIMEOUT):
        async with client(edge_thread) as http:
            assert_error(await http.post(path, content=json.dumps(body)), 400, "bad_request")
            await assert_healthy(http)


@settings(max_examples=15)
@given(
    path=st.sampled_from(ENDPOINTS),
    excess=st.integers(min_value=1, max_value=4 * MAX_BODY_BYTES),
    chunked=st.booleans(),
)
async def test_oversized_body_is_413(edge_thread: EdgeThread, path: str, excess: int, chunked: bool) -> None:
    """A body over ``max_body_bytes`` (declared by content-length or streamed chunked): 413."""
    body = json.dumps({**valid_body(path), "pad": ""}).encode()
    body = body[:-2] + b"x" * (MAX_BODY_BYTES - len(body) + excess) + b'"}'
    if chunked:
        framed = b"".join(
            b"%x\r\n%s\r\n" % (len(body[i : i + 4096]), body[i : i + 4096]) for i in range(0, len(body), 4096)
        )
        head = f"POST {path} HTTP/1.1\r\nhost: edge\r\ntransfer-encoding: chunked\r\n\r\n".encode()
        request = head + framed + b"0\r\n\r\n"
    else:
        head = f"POST {path} HTTP/1.1\r\nhost: edge\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        request = head + body
    with trio.fail_after(EXAMPLE_TIMEOUT):
        # By hand, sending while receiving: the Edge answers 413 as soon as it knows, and may
        # close before the upload ends (an HTTP client would report a write error then).
        answer = await raw_exchange(edge_thread, request)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert b'"code":"request_too_large"' in answer
        async with client(edge_thread) as http:
            await assert_healthy(http)


@pytest.mark.parametrize(
    "content",
    [
        b'{"model": "fuzz-a", "prompt": "x", "max_tokens": Infinity}',
        b'{"model": "fuzz-a", "prompt": "x", "temperature": NaN}',
        b'{"model": "fuzz-a", "prompt": "x", "temperature": -Infinity}',
        b'{"model": "fuzz-a", "prompt": "x", "max_tokens": 1e999}',
        b'{"model": "fuzz-a", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
        b'{"model": "fuzz-a", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    ],
    ids=["Infinity", "NaN", "-Infinity", "1e999", "5000-digit int", "nested 5000 deep"],
)
async def test_json_the_node_link_cannot_carry_is_400(edge_thread: EdgeThread, content: bytes) -> None:
    """Regression: non-finite numbers, over-long ints and deep nesting were a 500 (ValueError or
    RecursionError escaping the handler); now 400 bad_request, and the Edge serves on."""
    with trio.fail_after(EXAMPLE_TIMEOUT):
        async with client(edge_thread) as http:
            assert_error(await http.post("/v1/completions", content=content), 400, "bad_request")
            await assert_healthy(http)


@pytest.mark.parametrize("limit", [MAX_TOKENS_LIMIT + 1, 2**31, 2**200])
@pytest.mark.req("upstream-error-passthrough")
async def test_huge_token_limit_is_refused_by_the_mock_not_served(edge_thread: EdgeThread, limit: int) -> None:
    """Regression: the mock adapter built ``"tok " * max_tokens`` for any limit, so one request with
    ``max_tokens: 2**31`` held the node (and the GIL) in one allocation; now the mock refuses
    it at once as the mock backend does, with a 400 that the Edge passes through
    [upstream-error-passthrough]."""
    with trio.fail_after(EXAMPLE_TIMEOUT):
        async with client(edge_thread) as http:
            response = await http.post(
                "/v1/completions", json={"model": HEALTHY_MODEL, "prompt": "x", "max_tokens": limit}
            )
            assert_error_reason = response.headers["x-iop-reject-reason"]
            assert (response.status_code, assert_error_reason) == (400, "upstream_client_error"), response.text
            assert response.json()["error"]["code"] == "invalid_value"
            await assert_healthy(http)


token_limits = st.one_of(
    json_values.filter(lambda v: not isinstance(v, int) or isinstance(v, bool)),
    st.integers(min_value=-(2**70), max_value=64),
    st.integers(min_value=MAX_TOKENS_LIMIT + 1, max_value=2**200),
    st.sampled_from([float("inf"), float("-inf"), float("nan"), 1e300, 2.5]),
)
"""Token limits a client might send: wrong types, small, negative, huge, non-finite.

(Between 65 and :data:`MAX_TOKENS_LIMIT` the mock really generates that many tokens: a
long but legitimate answer, left out to keep examples short.)"""


@st.composite
def odd_contents(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """(path, body): the right shape, odd contents (messages of any JSON, huge or wrong extras)."""
    path = draw(st.sampled_from(ENDPOINTS))
    body = valid_body(path)
    if path == "/v1/chat/completions":
        body["messages"] = draw(st.lists(json_values, min_size=1, max_size=3))
    else:
        body["prompt"] = draw(st.one_of(st.text(max_size=2000), st.lists(json_values, max_size=3)))
    extras = draw(
        st.fixed_dictionaries(
            {},
            optional={
                "max_tokens": token_limits,
                "max_completion_tokens": token_limits,
                "temperature": json_values,
                "stop": json_values,
                "x-extra": st.one_of(json_values, st.text(min_size=1000, max_size=4000)),
            },
        )
    )
    return path, {**body, **extras}


@settings(max_examples=40)
@given(case=odd_contents(), stream=st.booleans())
async def test_odd_contents_never_500(edge_thread: EdgeThread, case: tuple[str, dict[str, Any]], stream: bool) -> None:
    """Right shape, odd contents: a success or an explicit 4xx/502 error, never a 500 or a hang."""
    path, body = case
    with trio.fail_after(EXAMPLE_TIMEOUT):
        async with client(edge_thread) as http:
            # allow_nan: the stdlib writes Infinity/NaN, which some clients send and json.loads reads
            content = json.dumps({**body, "stream": stream}, allow_nan=True)
            response = await http.post(path, content=content)
            event(f"status {response.status_code}")
            if response.status_code == 200:
                if stream:
                    assert response.text.rstrip().endswith("data: [DONE]") or '"error"' in response.text
            else:
                assert response.status_code in (400, 413, 502), response.text
                assert response.json()["error"]["code"]
            await assert_healthy(http)


@settings(max_examples=25)
@given(head=st.binary(max_size=200))
@example(head=b"! ! HTTP/0.0")  # once answered 404: h11 reads any version and any target
@example(head=b"GET ! HTTP/1.1\r\nhost: x")
@example(head=b"GET / HTTP/2.0\r\nhost: x")
@example(head=b"A / HTTP/1.0")  # an unknown method on a path: llhttp refuses it (400)
async def test_garbage_request_head_is_400_or_closed(edge_thread: EdgeThread, head: bytes) -> None:
    """Bytes that are not an HTTP request head: iop_http's refusal (400, 501 or 505) or a closed
    connection, no hang; the rare head that is well formed (iop_http accepts it) gets an answer
    below 500."""
    request = head.replace(b"\r\n\r\n", b"") + b"\r\n\r\n"
    with trio.fail_after(EXAMPLE_TIMEOUT):
        answer = await raw_exchange(edge_thread, request)
        event("answered" if answer else "closed")
        refused = _refused_with(request)
        if refused is None:
            event("well formed")
            assert answer.startswith(b"HTTP/1.1 ") and int(answer[9:12]) < 500, answer[:200]
        else:
            assert answer == b"" or answer.startswith(b"HTTP/1.1 %d " % refused), answer[:200]
        async with client(edge_thread) as http:
            await assert_healthy(http)


def _refused_with(head: bytes) -> int | None:
    """The status the Edge refuses ``head`` with (iop_http's verdict), or None when it serves it."""
    verdict = accept_head(head[: find_head_end(head)])
    return verdict.status if isinstance(verdict, Refusal) else None


async def raw_exchange(edge: EdgeThread, request: bytes) -> bytes:
    """Send raw bytes to the HTTP port; return the one response (head and content-length body).

    Sends while it receives: a server that answers early may stop reading the
    rest. Returns what arrived before the server closed if that is less (b"":
    closed unanswered).
    """

    async def send() -> None:
        try:
            await stream.send_all(request)
        except trio.BrokenResourceError:
            pass  # the server answered and closed before reading everything

    stream = await trio.open_tcp_stream("127.0.0.1", edge.http_port)
    async with stream, trio.open_nursery() as nursery:
        nursery.start_soon(send)
        answer = b""
        while not response_complete(answer):
            try:
                chunk = await stream.receive_some(65536)
            except trio.BrokenResourceError:  # reset by the server after its answer
                break
            if not chunk:
                break
            answer += chunk
        nursery.cancel_scope.cancel()
    return answer


def response_complete(data: bytes) -> bool:
    head, found, body = data.partition(b"\r\n\r\n")
    if not found:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False  # no length: the server ends the body by closing
