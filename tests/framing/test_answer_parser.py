"""iop_http.AnswerParser: an answer parsed by httptools, with what llhttp leaves to us."""

from __future__ import annotations

import gc

import pytest

from iop_http import AnswerError, AnswerParser

CHUNKED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"9\r\ndata: a\n\n\r\n"
    b"a\r\ndata: \xc3\xa9\n\n\r\n"
    b"e\r\ndata: [DONE]\n\n\r\n"
    b"0\r\n\r\n"
)
BODY = b"data: a\n\ndata: \xc3\xa9\n\ndata: [DONE]\n\n"


def parse(*pieces: bytes, eof: bool = False, head_only: bool = False) -> tuple[AnswerParser, bytes]:
    parser = AnswerParser(head_only=head_only)
    body = b""
    for piece in pieces:
        parser.feed(piece)
        body += parser.take() or b""
    if eof:
        parser.feed_eof()
        body += parser.take() or b""
    return parser, body


@pytest.mark.req("relay-fidelity")
def test_a_chunked_body_is_the_same_however_it_is_split() -> None:
    """[relay-fidelity] The body bytes are exactly the chunks' data, in order, for every
    split of the answer into two reads (through a multi-byte character too); the head's
    status, reason and headers are kept as sent, and the connection is reusable."""
    for cut in range(len(CHUNKED) + 1):
        parser, body = parse(CHUNKED[:cut], CHUNKED[cut:])
        assert body == BODY, cut
        assert parser.complete and parser.reusable
        assert (parser.status, parser.reason) == (200, b"OK")
        assert parser.headers == [(b"content-type", b"text/event-stream"), (b"Transfer-Encoding", b"chunked")]


def test_informational_answers_are_skipped() -> None:
    parser, body = parse(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok")
    assert (parser.status, parser.reason, parser.headers, body) == (201, b"Created", [(b"content-length", b"2")], b"ok")
    assert parser.reusable


def test_a_body_delimited_by_the_close_ends_at_eof_and_is_not_reused() -> None:
    parser, body = parse(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{}", b"[]")
    assert not parser.complete
    parser.feed_eof()
    assert (parser.complete, parser.reusable, body) == (True, False, b"{}[]")


@pytest.mark.parametrize(
    "answer",
    [
        b"",
        b"HTTP/1.1 200 OK\r\ncontent-le",
        b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nabc",
    ],
)
def test_an_answer_cut_short_by_eof_fails(answer: bytes) -> None:
    """No head, or a framed body (length or chunked) that stops early: AnswerError."""
    parser = AnswerParser()
    if answer:
        parser.feed(answer)
    with pytest.raises(AnswerError):
        parser.feed_eof()
    assert not parser.complete


@pytest.mark.parametrize(
    ("answer", "reusable"),
    [
        (b"HTTP/1.1 204 No Content\r\n\r\n", True),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok", False),
        (b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok", False),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n", False),  # unasked data
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokextra", False),
        (b"HTTP/1.1 204 No Content\r\ntransfer-encoding: chunked\r\n\r\n", False),  # its body may follow
        (b"HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\n", False),
        (b"HTTP/1.1 304 Not Modified\r\ncontent-length: 5\r\n\r\n", True),  # the length of the 200
    ],
)
def test_reuse_follows_the_answer(answer: bytes, reusable: bool) -> None:
    parser, _ = parse(answer)
    assert parser.complete
    assert parser.reusable is reusable


def test_an_answer_to_head_ends_with_its_head_and_is_not_reused() -> None:
    parser, body = parse(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n", head_only=True)
    assert (parser.complete, parser.reusable, body, parser.status) == (True, False, b"", 200)


@pytest.mark.parametrize("answer", [b"HTTX/1.1 200 OK\r\n\r\n", b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n"])
def test_bad_http_is_a_protocol_error(answer: bytes) -> None:
    with pytest.raises(AnswerError):
        AnswerParser().feed(answer)


def test_an_answer_read_to_its_end_leaves_no_garbage_for_the_collector() -> None:
    """llhttp's parser and its callbacks' object refer to each other until the answer ends; then
    the cycle is cut, so a finished answer is freed by reference counting (no collection needed)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        parser, body = parse(CHUNKED[:40], CHUNKED[40:])
        assert body == BODY and parser.complete
        parser.feed(b"unasked")  # after the end: noted, not parsed
        assert not parser.reusable
        del parser
        assert gc.collect() == 0
    finally:
        if was_enabled:
            gc.enable()
