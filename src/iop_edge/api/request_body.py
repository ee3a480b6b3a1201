"""What the Edge reads of a request body: the JSON rules, the fields it checks, the token estimate.

The Edge reads only what it decides on (the model, ``stream``, the token estimate for the
long-request classification and tenant cost, the context tokens a token budget reserves); the rest of the body is the backend's, and a v5
node gets the client's own text (:class:`ClientBody`), never a re-encoding of it.

This is the one place where a client's JSON is read, strictly (:func:`read_body`): UTF-8 only
(an optional byte-order mark is ignored), no lone surrogate (as bytes or as a ``\\uD800``
escape), no duplicate key, no ``NaN``/``Infinity``, no number out of a float's range, nesting at
most :data:`MAX_DEPTH` deep, an object at the top. Each refusal is a 400 ``bad_request`` naming
the rule: a body the Edge accepts can always be carried to a node and to a backend.

:class:`BodyReader` takes the body off the ASGI ``receive`` within ``max_body_bytes`` and runs
the costly reads (a large body, a count by a tokenizer) in a worker thread.
"""

from __future__ import annotations

import codecs
import json
import math
import re
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any, final

import attrs
import trio

from iop_edge._off_loop import run_off_loop, yield_to_loop
from iop_edge.api.rejections import RequestRejected
from iop_edge.token_count import Count, prompt_tokens, tokenizer_count, utf8_bound

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]

MAX_DEPTH = 64
"""Deepest nesting of arrays and objects accepted in a request body (the top object is 1).

Well under the interpreter's recursion limit (1000), which the stdlib decoder and any
recursive reader of the body would otherwise hit; serde_json's default is 128, protobuf's 100.
"""

CHARS_PER_TOKEN = 4
"""Prompt characters per estimated token, for the long-request classification."""

UNBOUNDED_OUTPUT = 1 << 30
"""The output a request without ``max_tokens`` may take: the engine's whole window (the
admission core bounds every reservation by the provider's ``context_window_tokens``)."""


def checked_stream(endpoint: str, body: dict[str, Any]) -> bool:
    """Check the fields the Edge reads for ``endpoint``; return whether the answer streams.

    Raises:
        RequestRejected: 400 ``bad_request`` naming the field.
    """
    if endpoint == "embeddings":
        if not is_embedding_input(body.get("input")):
            raise RequestRejected(
                400,
                "bad_request",
                "'input' is required: a non-empty string, a list of strings, a token list or a list of token lists",
            )
        return False  # never a stream
    if endpoint == "chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestRejected(400, "bad_request", "'messages' is required and must be a non-empty list")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str | list):
            raise RequestRejected(400, "bad_request", "'prompt' is required and must be a string or a list")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestRejected(400, "bad_request", "'stream' must be true or false")
    return stream


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def is_embedding_input(value: object) -> bool:
    """``input`` of an embeddings request: a non-empty string, or a non-empty list of non-empty
    strings, a token list (integers), or a non-empty list of non-empty token lists."""
    if isinstance(value, str):
        return bool(value)
    if not isinstance(value, list) or not value:
        return False
    return (
        all(isinstance(item, str) and item for item in value)
        or _is_token_list(value)
        or all(_is_token_list(item) for item in value)
    )


def embedding_tokens(value: object) -> int:
    """Estimated tokens of an embeddings ``input``: characters / 4, plus one per token id given."""
    if isinstance(value, str):
        return len(value) // CHARS_PER_TOKEN
    if _is_token_list(value):
        return len(value)  # type: ignore[arg-type]
    if not isinstance(value, list):
        return 0
    chars = sum(len(item) for item in value if isinstance(item, str))
    return chars // CHARS_PER_TOKEN + sum(len(item) for item in value if isinstance(item, list))


def estimate_tokens(endpoint: str, body: dict[str, Any]) -> int:
    """Estimated context of a request: prompt characters / 4 plus the output budget.

    For embeddings: the input's characters / 4 plus its token ids (:func:`embedding_tokens`).
    """
    if endpoint == "embeddings":
        return embedding_tokens(body.get("input"))
    return prompt_chars(endpoint, body) // CHARS_PER_TOKEN + output_budget(body)


def context_tokens(endpoint: str, body: dict[str, Any], count: Count = utf8_bound) -> int:
    """The context tokens a request reserves on a token budget ([token-ledger]): its prompt's
    tokens (:func:`iop_edge.token_count.prompt_tokens`: each text counted by ``count``, the model's
    tokenizer, else bounded by its UTF-8 bytes; with the chat template's tokens), plus
    ``max_tokens`` (absent: :data:`UNBOUNDED_OUTPUT`, the window); for embeddings the input's alone."""
    prompt = prompt_tokens(endpoint, body, count)
    if endpoint == "embeddings":
        return prompt
    return prompt + (output_budget(body) or UNBOUNDED_OUTPUT)


def prompt_chars(endpoint: str, body: dict[str, Any]) -> int:
    """Characters of a completion request's prompt: the messages' text, or ``prompt``."""
    chars = 0
    if endpoint == "chat/completions":
        for message in body.get("messages") or ():
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        chars += len(part["text"])
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            chars += len(prompt)
        elif isinstance(prompt, list):
            chars += sum(len(p) for p in prompt if isinstance(p, str))
    return chars


def output_budget(body: dict[str, Any]) -> int:
    """``max_tokens`` (or ``max_completion_tokens``) of a request; 0 when absent or not an integer."""
    budget = body.get("max_tokens") or body.get("max_completion_tokens") or 0
    if not isinstance(budget, int) or isinstance(budget, bool):
        return 0
    return budget


def _reject_constant(name: str) -> None:
    # The stdlib reads NaN/Infinity; they are not JSON, and no node or backend could carry them.
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as infinity
        raise ValueError(f"number {text[:30]} is out of range")
    return value


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object; a key given twice is refused (readers disagree on which one counts)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {key[:40]!r}")
            seen.add(key)
    return obj


BODY_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float, object_pairs_hook=_object)
"""The request body's decoder, built once (``json.loads`` with hooks builds one per call)."""

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""A ``\\uD800``-``\\uDFFF`` escape in the body's text: only then can a decoded string hold a lone
surrogate (a valid pair is checked too, and passes)."""


@final
@attrs.frozen
class ClientBody:
    """A request body as the client sent it (``text``) and as the Edge reads it (``fields``)."""

    text: str
    """The body's JSON text, exactly the client's (without a byte-order mark): what a v5 node gets."""
    fields: dict[str, Any] = attrs.field(repr=False)
    """The decoded object; the Edge reads it and never changes it."""


YIELD_EVERY = 4096
"""Numbers and objects a body read off the loop decodes between two :func:`yield_to_loop` calls."""


def _yielding_decoder() -> json.JSONDecoder:
    """A decoder for :func:`read_body` off the loop: the rules of :data:`BODY_DECODER`, and every
    :data:`YIELD_EVERY` numbers or objects it lets the event loop run first (:func:`yield_to_loop`).

    The stdlib's C scanner holds the GIL from the first byte to the last: a 4 MB array of
    small integers is tens of milliseconds in which the loop could not run, thread or not.
    Its hooks are the only places it runs Python, so they are where it waits for the loop.
    """
    count = 0

    def tick() -> None:
        nonlocal count
        count += 1
        if count >= YIELD_EVERY:
            count = 0
            yield_to_loop()

    def parse_int(text: str) -> int:
        tick()
        return int(text)

    def parse_float(text: str) -> float:
        tick()
        return _finite_float(text)

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        tick()
        return _object(items)

    return json.JSONDecoder(
        parse_constant=_reject_constant, parse_float=parse_float, parse_int=parse_int, object_pairs_hook=pairs
    )


def read_body(raw: bytes, *, off_loop: bool = False) -> ClientBody:
    """Read a request body by the rules above (pure, so it can run off the event loop).

    ``off_loop``: run by :func:`iop_edge._off_loop.run_off_loop`, with a decoder that lets the
    loop take its turns (:func:`_yielding_decoder`); slower, so only for large bodies.

    Raises:
        RequestRejected: 400 ``bad_request`` with the rule the body breaks.
    """
    if raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8) :]
    try:
        text = raw.decode("utf-8")  # strict: refuses invalid UTF-8 and encoded surrogates
    except UnicodeDecodeError as exc:
        raise _bad(f"request body is not valid UTF-8 (at byte {exc.start})") from None
    try:
        fields = (_yielding_decoder() if off_loop else BODY_DECODER).decode(text)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:
        raise _bad(f"request body is not valid JSON: {exc}") from None
    if type(fields) is not dict:
        raise _bad("request body must be a JSON object")
    strings = _has_surrogate_escape(text, off_loop=off_loop)
    if strings or text.count("[") + text.count("{") > MAX_DEPTH:
        _check_values(fields, strings=strings, pace=yield_to_loop if off_loop else None)
    return ClientBody(text, fields)


_SEARCH_SLICE = 256 * 1024
"""Characters searched between two :func:`yield_to_loop` calls off the loop."""


def _has_surrogate_escape(text: str, *, off_loop: bool) -> bool:
    """Whether ``text`` holds a surrogate escape; off the loop a slice at a time, the loop's turn between."""
    if not off_loop:
        return _SURROGATE_ESCAPE.search(text) is not None
    for start in range(0, len(text), _SEARCH_SLICE):
        if _SURROGATE_ESCAPE.search(text, start, start + _SEARCH_SLICE + 5) is not None:  # an escape is 6 long
            return True
        yield_to_loop()
    return False


def _check_values(top: dict[str, Any], *, strings: bool, pace: Callable[[], None] | None) -> None:
    """Refuse nesting deeper than :data:`MAX_DEPTH` and, with ``strings``, a key or string holding a
    lone surrogate. Iterative: the body's depth never becomes the interpreter's. ``pace`` is
    called every :data:`YIELD_EVERY` containers (off the loop: :func:`yield_to_loop`)."""
    stack: list[tuple[dict[str, Any] | list[Any], int]] = [(top, 1)]
    seen = 0
    while stack:
        item, depth = stack.pop()
        seen += 1
        if pace is not None and seen % YIELD_EVERY == 0:
            pace()
        if depth > MAX_DEPTH:
            raise _too_deep()
        if type(item) is dict:
            if strings:
                for key in item:
                    _check_text(key)
            children: Any = item.values()
        else:
            children = item
        for child in children:
            kind = type(child)
            if kind is dict or kind is list:
                stack.append((child, depth + 1))
            elif strings and kind is str:
                _check_text(child)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _bad(f"request body holds a lone surrogate (\\u{ord(text[exc.start]):04x}), which is not text") from None


def _too_deep() -> RequestRejected:
    return _bad(f"request body nests deeper than {MAX_DEPTH} levels")


def _bad(message: str) -> RequestRejected:
    return RequestRejected(400, "bad_request", message)


class ClientGone(RequestRejected):
    """The client disconnected before its request body arrived; nothing to answer."""

    def __init__(self) -> None:
        super().__init__(499, "client_closed", "client closed the connection")


def _too_large(limit: int) -> RequestRejected:
    return RequestRejected(413, "request_too_large", f"request body exceeds {limit} bytes")


@final
class BodyReader:
    """The request bodies of one Edge, read off the ASGI ``receive`` by :func:`read_body`, and the
    context tokens each reserves; the costly ones in a worker thread, one at a time.

    Args:
        off_loop_bytes: bodies larger than this are read in a worker thread
            (:func:`run_off_loop`), so a flood of large bodies leaves the loop free for everything else.
    """

    def __init__(self, off_loop_bytes: int) -> None:
        self._off_loop_bytes = off_loop_bytes
        self._workers = trio.CapacityLimiter(1)  # large bodies read, prompts counted one at a time, off the loop

    async def context_tokens(self, endpoint: str, fields: dict[str, Any], tokenizer: str | None) -> int:
        """What the request reserves on a token budget ([token-ledger], :func:`context_tokens`): with
        the model's tokenizer, counted in a worker thread, one at a time (a count costs many body
        reads, docs/benchmarks.md); else the UTF-8 bound, here. Checkpoints with a tokenizer."""
        if tokenizer is None:
            return context_tokens(endpoint, fields)
        async with self._workers:
            return await run_off_loop(lambda: context_tokens(endpoint, fields, tokenizer_count(tokenizer)))

    async def read(self, headers: Iterable[tuple[bytes, bytes]], receive: Receive, limit: int) -> ClientBody:
        """The request body of ``limit`` bytes at most (its ``headers``' ``content-length`` is checked
        first), read by :func:`read_body`: in a worker thread past ``off_loop_bytes``. Checkpoints.

        Raises:
            ClientGone: the client left before its body arrived.
            RequestRejected: 413 ``request_too_large``, or 400 (a bad ``content-length``, or
                the rule the body breaks).
        """
        for name, value in headers:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    raise RequestRejected(400, "bad_request", "invalid content-length") from None
                if declared > limit:
                    raise _too_large(limit)
        chunks = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
        if len(raw) > self._off_loop_bytes:  # one worker at a time: the loop competes with one thread
            async with self._workers:
                return await run_off_loop(lambda: read_body(raw, off_loop=True))
        return read_body(raw)
