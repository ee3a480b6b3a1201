"""A request's prompt tokens as a token budget reserves them ([token-ledger]): counted or bounded.

Two rules, both exact, no tuned ratio:

- **The model's tokenizer**, where the operator names one (``models[].tokenizer`` in
  ``edge.yaml``: a Hugging Face ``tokenizer.json``, read with the ``tokenizers`` library, or a
  GGUF model file, whose vocabulary llama.cpp reads): each text is counted as the engine counts
  it (:func:`load_tokenizer`).
- **Else a bound**: a text's UTF-8 bytes plus one (:func:`utf8_bound`). A byte-level BPE
  tokenizer (GPT-2, the GPT-4 family, Llama 3, Qwen) splits a text into tokens of at least one
  byte each, and a SentencePiece tokenizer with byte fallback (Llama 2, Gemma, Mistral) turns a
  character it has no piece for into its bytes, one token each, and every piece it has into at
  least one byte, besides the one word-start marker it may put before the text: no tokenizer of
  either kind makes more tokens of a text than its bytes plus one (a normalizer that expands
  text, such as NFKC, could; the chat models' tokenizers have none). The bound is
  tightest for scripts of several bytes a character and loose for English; ``docs/benchmarks.md``
  measures it against real tokenizers.

Around the texts, the chat template's own tokens: each message adds its role and
:data:`MESSAGE_TOKENS` markers (ChatML, Gemma and Llama 3 use 4: a turn's opening, the line
after the role, its close and the line after it), the prompt adds :data:`REPLY_TOKENS` (the
sequence's first token and the reply's opening, 5 in Llama 3); a completion's or embedding's
text adds :data:`SEQUENCE_TOKENS` (a first and a last marker). A template that writes text of
its own (a default system prompt) is not counted; the settlement with the engine's usage
corrects the reservation when the answer reports it.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

Count = Callable[[str], int]
"""A tokenizer's count of one text (no template tokens)."""

MESSAGE_TOKENS = 4
"""Template tokens a chat message adds besides its role: the turn's opening and close, a line
after each (ChatML ``<|im_start|>user\\n...<|im_end|>\\n``, Gemma, Llama 3)."""
REPLY_TOKENS = 5
"""Template tokens a chat prompt adds once: the sequence's first token and the reply's opening
(Llama 3's ``<|begin_of_text|>`` and ``<|start_header_id|>assistant<|end_header_id|>\\n\\n``)."""
SEQUENCE_TOKENS = 2
"""Tokens a completion prompt or an embedding input adds to its text: a first and a last marker."""


def utf8_bound(text: str) -> int:
    """The most tokens a byte-level or byte-fallback tokenizer makes of ``text``: its UTF-8 bytes,
    and one for the word-start marker a SentencePiece tokenizer may put before it."""
    return 1 + (len(text) if text.isascii() else len(text.encode("utf-8")))


def prompt_tokens(endpoint: str, body: dict[str, Any], count: Count = utf8_bound) -> int:
    """The prompt tokens of a request (``endpoint`` as :func:`iop_edge.api.request_body.checked_stream`
    takes it), each text counted by ``count`` (default: the bound), with the template's tokens."""
    if endpoint == "chat/completions":
        total = REPLY_TOKENS
        for message in body.get("messages") or ():
            if isinstance(message, dict):
                total += MESSAGE_TOKENS + sum(count(text) for text in message_texts(message))
        for key in ("tools", "functions"):
            if body.get(key):  # the template writes the definitions into the prompt, as JSON or alike
                total += count(json.dumps(body[key], ensure_ascii=False))
        return total
    prompt = body.get("input" if endpoint == "embeddings" else "prompt")
    if isinstance(prompt, str):
        return count(prompt) + SEQUENCE_TOKENS
    if not isinstance(prompt, list):
        return 0
    if prompt and all(type(t) is int for t in prompt):  # one prompt given as token ids
        return len(prompt) + SEQUENCE_TOKENS
    total = 0
    for item in prompt:
        if isinstance(item, str):
            total += count(item) + SEQUENCE_TOKENS
        elif isinstance(item, list):
            total += len(item) + SEQUENCE_TOKENS
    return total


def message_texts(message: dict[str, Any]) -> Iterator[str]:
    """The texts of a chat message the template writes: role, name, content (or its text parts),
    and its tool calls' names and arguments."""
    for key in ("role", "name"):
        if isinstance(message.get(key), str):
            yield message[key]
    content = message.get("content")
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                yield part["text"]
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            yield from (function[key] for key in ("name", "arguments") if isinstance(function.get(key), str))


class TokenizerError(Exception):
    """A tokenizer file that cannot be used; the message says why (the config check's message)."""


def load_tokenizer(path: str | os.PathLike[str]) -> Count:
    """The count of the tokenizer in ``path`` (cached per file, its size and modification time):
    a ``.gguf`` model file's vocabulary (llama.cpp's, through ``llama-cpp-python``), else a
    Hugging Face ``tokenizer.json`` (the ``tokenizers`` library, the daemons' ``tokens`` extra).
    Thread-safe. Texts are counted without special tokens (:func:`prompt_tokens` adds the template's).

    Raises:
        TokenizerError: no such file, the library is not installed, or the file does not load.
    """
    file = Path(path)
    try:
        stat = file.stat()
    except OSError as exc:
        raise TokenizerError(f"cannot read {file}: {exc.strerror}") from None
    key = (str(file.resolve()), stat.st_size, stat.st_mtime_ns)
    with _LOCK:
        count = _LOADED.get(key)
        if count is None:
            count = _gguf_count(file) if file.suffix.lower() == ".gguf" else _json_count(file)
            _LOADED[key] = count
        _LATEST[str(path)] = count
    return count


def tokenizer_count(path: str) -> Count:
    """The count of the tokenizer last loaded from ``path`` by :func:`load_tokenizer` (the config
    check loads it, a reload again), else loaded now: a request's count reads no file."""
    count = _LATEST.get(path)
    return count if count is not None else load_tokenizer(path)


_LOCK = threading.Lock()
_LOADED: dict[tuple[str, int, int], Count] = {}
_LATEST: dict[str, Count] = {}


def _json_count(file: Path) -> Count:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TokenizerError("needs the tokenizers package: pip install 'iop-daemons[tokens]'") from None
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:  # the library's own errors (a bad file) are plain Exceptions
        raise TokenizerError(f"{file} is not a tokenizer.json the tokenizers library reads: {exc}") from None

    def count(text: str) -> int:
        # encode_batch lets go of the GIL while it counts (encode holds it): the loop runs meanwhile
        return len(tokenizer.encode_batch([text], add_special_tokens=False)[0])

    return count


def _gguf_count(file: Path) -> Count:
    try:
        from llama_cpp import Llama
    except ImportError:
        raise TokenizerError("a .gguf tokenizer needs llama-cpp-python: pip install llama-cpp-python") from None
    try:
        model = Llama(model_path=str(file), vocab_only=True, verbose=False)
    except (ValueError, RuntimeError) as exc:
        raise TokenizerError(f"{file} is not a model file llama.cpp reads: {exc}") from None

    def count(text: str) -> int:
        return len(model.tokenize(text.encode("utf-8"), add_bos=False, special=False))

    return count
