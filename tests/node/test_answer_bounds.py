"""[upstream-bounds] The bounds on an upstream answer, without sockets: the parser, the httpx path, the config.

:class:`iop_http.AnswerParser` (within the provider's ``UpstreamLimits``) checks the head (1xx answers
included), the number of 1xx answers, the chunk extensions and trailers, and the
body of an answer relayed whole, as the bytes arrive, however they are split.
Answers read through httpx (``https://`` upstreams, wire v1, the Ollama adapter)
are bounded by :class:`~iop_node.upstream.http_upstream.BodyStream` instead.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from iop_config import ConfigFileError, load_config_text
from iop_http import AnswerError, AnswerParser
from iop_node import NodeConfig, OllamaAdapter, OpenAIAdapter, ProviderConfig, UpstreamLimits, UpstreamTooLarge

KiB = 1024
LIMITS = UpstreamLimits(head_bytes=4 * KiB, answer_bytes=8 * KiB, chunk_extension_bytes=1 * KiB)
OK_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def pieces(data: bytes, size: int) -> Iterator[bytes]:
    return (data[i : i + size] for i in range(0, len(data), size))


def fed(data: bytes, size: int = 1 << 30, *, whole: bool = False) -> AnswerParser:
    """A parser fed ``data`` in reads of ``size`` bytes, every body byte taken as it comes."""
    parser = AnswerParser(limits=LIMITS, whole=whole)
    for piece in pieces(data, size):
        parser.feed(piece)
        parser.take()
    return parser


@contextmanager
def raises_kind(kind: str, match: str | None = None) -> Iterator[None]:
    """The parser fails with an :class:`iop_http.AnswerError` of ``kind``."""
    with pytest.raises(AnswerError, match=match) as caught:
        yield
    assert caught.value.kind == kind


def chunked(*chunks: bytes, trailers: bytes = b"") -> bytes:
    return OK_HEAD + b"transfer-encoding: chunked\r\n\r\n" + b"".join(chunks) + b"0\r\n" + trailers + b"\r\n"


@pytest.mark.req("upstream-bounds")
@pytest.mark.parametrize("size", [1, 7, 512, 1 << 30])
def test_a_head_past_its_bound_is_refused_however_it_is_split(size: int) -> None:
    big = OK_HEAD + b"x-big: " + b"a" * (4 * KiB) + b"\r\ncontent-length: 0\r\n\r\n"
    with raises_kind("too_large"):
        fed(big, size)
    just = OK_HEAD + b"x-fits: " + b"a" * (3 * KiB) + b"\r\ncontent-length: 0\r\n\r\n"
    assert fed(just, size).reusable


@pytest.mark.req("upstream-bounds")
def test_a_head_without_end_is_refused_after_one_read_past_the_bound() -> None:
    parser = AnswerParser(limits=LIMITS)
    parser.feed(OK_HEAD + b"x-endless: ")
    with raises_kind("too_large"):
        for _ in range(100):
            parser.feed(b"a" * KiB)
    assert not parser.head_done


@pytest.mark.req("upstream-bounds")
def test_informational_answers_are_bounded_in_number_and_in_size() -> None:
    final = OK_HEAD + b"content-length: 2\r\n\r\nok"
    continues = b"HTTP/1.1 100 Continue\r\n\r\n"
    assert fed(continues * 5 + final).status == 200
    with raises_kind("over_bound", match="informational"):
        fed(continues * 6 + final)
    hints = b"HTTP/1.1 103 Early Hints\r\nlink: " + b"l" * KiB + b"\r\n\r\n"
    with raises_kind("too_large"):  # their heads count in the head's bound
        fed(hints * 4 + final)


@pytest.mark.req("upstream-bounds")
@pytest.mark.parametrize("size", [1, 100, 512])
def test_chunk_extensions_and_trailers_are_bounded_in_all(size: int) -> None:
    """RFC 9112 §7.1.1: the total of the extensions (and trailer fields) of one answer, checked after each read."""
    assert fed(chunked(*[b"1;e=x\r\na\r\n"] * 300), size).complete  # short extensions on many chunks
    hello = b"5\r\nhello\r\n"
    one_long = chunked(b"5;x=" + b"a" * (2 * KiB) + b"\r\nhello\r\n", hello)
    spread = chunked(*[b"1;" + b"e" * 100 + b"\r\na\r\n"] * 30)
    long_trailer = chunked(hello, trailers=b"x-t: " + b"t" * (2 * KiB) + b"\r\n")
    for answer in (one_long, spread, long_trailer):
        with raises_kind("over_bound", match="chunk extensions"):
            fed(answer, size)


@pytest.mark.req("upstream-bounds")
@pytest.mark.parametrize("framing", ["length", "chunked", "close"])
def test_a_body_relayed_whole_is_bounded_and_a_stream_is_not(framing: str) -> None:
    body = b" " * (8 * KiB + 1)
    if framing == "length":
        answer = OK_HEAD + b"content-length: %d\r\n\r\n" % len(body) + body
    elif framing == "chunked":
        answer = chunked(*(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces(body, 1000)))
    else:
        answer = OK_HEAD + b"\r\n" + body
    with raises_kind("too_large"):
        fed(answer, 4096, whole=True)
    parser = fed(answer, 4096)  # a stream: relayed as it comes, never held
    if framing == "close":
        parser.feed_eof()
    assert parser.complete


def openai_over_httpx(handler: httpx.MockTransport) -> OpenAIAdapter:
    provider = ProviderConfig(id="p", adapter="openai", base_url="https://upstream.test/v1", limits=LIMITS)
    return OpenAIAdapter.from_config(provider, transport=handler)


@pytest.mark.req("upstream-bounds")
async def test_answers_read_through_httpx_are_bounded_too() -> None:
    """``https://`` upstreams, wire v1 runs and the Ollama adapter read through httpx: a non-stream
    answer past ``answer_bytes`` and a stream line without end fail with ``upstream_too_large``."""
    huge = httpx.MockTransport(lambda request: httpx.Response(200, content=b" " * (8 * KiB + 1)))
    adapter = openai_over_httpx(huge)
    with pytest.raises(UpstreamTooLarge):
        async for _ in adapter.run("chat/completions", CHAT, stream=False):
            pass
    with pytest.raises(UpstreamTooLarge):
        await adapter.relay("chat/completions", CHAT, stream=False, send=_discard)
    sse = httpx.MockTransport(lambda request: httpx.Response(200, content=b"data: " + b"x" * (9 * KiB)))
    with pytest.raises(UpstreamTooLarge):
        async for _ in openai_over_httpx(sse).run("chat/completions", CHAT, stream=True):
            pass
    lines = b"".join(b"data: %b\n" % json.dumps({"p": "x" * 500}).encode() for _ in range(20))
    one_event = httpx.MockTransport(lambda request: httpx.Response(200, content=lines))
    with pytest.raises(UpstreamTooLarge):  # one event of many lines
        async for _ in openai_over_httpx(one_event).run("chat/completions", CHAT, stream=True):
            pass
    provider = ProviderConfig(id="p", adapter="ollama", base_url="http://ollama.test", limits=LIMITS)
    too_long = httpx.MockTransport(lambda request: httpx.Response(200, content=b"{" * (9 * KiB)))
    ollama = OllamaAdapter.from_config(provider, transport=too_long)
    for stream in (False, True):
        with pytest.raises(UpstreamTooLarge):
            async for _ in ollama.run("chat/completions", CHAT, stream=stream):
                pass


async def _discard(chunk: bytes) -> None:
    pass


NODE_YAML = """\
node_id: node-a
edge_url: ws://127.0.0.1:8081
token: t
providers:
  - id: gpu0
    adapter: openai
    base_url: http://127.0.0.1:9100/v1
    limits: {head_bytes: 8192, answer_bytes: 1048576, chunk_extension_bytes: 0, informational_answers: 0}
"""


@pytest.mark.req("upstream-bounds")
def test_the_limits_are_provider_settings_with_safe_defaults() -> None:
    config = load_config_text(NODE_YAML, NodeConfig, filename="node.yaml")
    assert config.providers[0].limits == UpstreamLimits(8192, 1048576, 0, 0)
    assert ProviderConfig(id="p", adapter="mock").limits == UpstreamLimits(64 * KiB, 16 * KiB * KiB, 16 * KiB, 5)
    with pytest.raises(ConfigFileError) as caught:
        load_config_text(NODE_YAML.replace("head_bytes: 8192", "head_bytes: 10"), NodeConfig, filename="node.yaml")
    assert caught.value.errors == ("node.yaml:8: providers[0].limits.head_bytes: must be >= 1024, got 10",)
