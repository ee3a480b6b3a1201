"""A prompt's tokens as a token budget reserves them ([token-ledger]): the UTF-8 bound without a
tokenizer, the model's tokenizer where ``models[].tokenizer`` names one, the template's tokens
around both; the key's errors with file and line; a real Edge reserving by its tokenizer.

The tokenizer is a small byte-level BPE trained here with the ``tokenizers`` library and saved as
a ``tokenizer.json`` (the real ones are measured in ``benchmarks/tokens.py`` and the real tier).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import trio
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from edge.harness import BIG, FAST, EdgeLayout, eventually, fake_node, running_edge, start_chat
from iop_config import ConfigFileError
from iop_edge.api.request_body import UNBOUNDED_OUTPUT, context_tokens
from iop_edge.config import load_edge_config
from iop_edge.token_count import (
    MESSAGE_TOKENS,
    REPLY_TOKENS,
    SEQUENCE_TOKENS,
    TokenizerError,
    load_tokenizer,
    prompt_tokens,
    tokenizer_count,
    utf8_bound,
)

pytestmark = pytest.mark.req("token-ledger")

TEXT = "the cat sat on the mat; the dog sat on the log. "


def trained_tokenizer(path: Path) -> Path:
    """A byte-level BPE of 300 tokens trained on :data:`TEXT`, saved as ``path``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator([TEXT] * 20, trainer)
    tokenizer.save(str(path))
    return path


def test_without_a_tokenizer_each_text_is_bounded_by_its_utf8_bytes() -> None:
    assert [utf8_bound(t) for t in ("abc", "é", "中文", "🙂", "")] == [4, 3, 7, 5, 1]  # bytes + 1
    chat = {"messages": [{"role": "user", "content": "c" * 40}], "max_tokens": 90}
    # 40 bytes + 1, "user" 4 + 1, the message's template tokens, the reply's opening; then max_tokens
    assert context_tokens("chat/completions", chat) == 41 + 5 + MESSAGE_TOKENS + REPLY_TOKENS + 90
    assert context_tokens("completions", {"prompt": "中" * 8}) == 25 + SEQUENCE_TOKENS + UNBOUNDED_OUTPUT
    assert context_tokens("embeddings", {"input": ["e" * 16, "f" * 16]}) == 2 * (17 + SEQUENCE_TOKENS)


def test_every_text_the_template_writes_is_counted() -> None:
    """Role, name, text parts, tool calls' names and arguments, the tools' definitions; not images."""
    message = {
        "role": "assistant",
        "name": "bot",
        "content": [{"type": "text", "text": "ab"}, {"type": "image_url", "image_url": {"url": "x" * 99}}],
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}],
    }
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = {"messages": [message, "not a message"], "tools": tools}
    texts = len("assistant") + len("bot") + 2 + len("f") + len('{"a":1}') + 5  # each text's bytes + 1
    tools_text = len(json.dumps(tools, ensure_ascii=False)) + 1
    assert prompt_tokens("chat/completions", body) == REPLY_TOKENS + MESSAGE_TOKENS + texts + tools_text


def test_token_ids_count_as_given() -> None:
    assert prompt_tokens("completions", {"prompt": [1, 2, 3]}) == 3 + SEQUENCE_TOKENS
    assert prompt_tokens("completions", {"prompt": ["ab", [1, 2]]}) == 3 + 2 + 2 * SEQUENCE_TOKENS
    assert prompt_tokens("embeddings", {"input": [[5] * 7]}) == 7 + SEQUENCE_TOKENS
    assert prompt_tokens("completions", {"prompt": 5}) == 0


def test_the_models_tokenizer_counts_each_text(tmp_path: Path) -> None:
    path = trained_tokenizer(tmp_path / "tokenizer.json")
    count = load_tokenizer(path)
    expected = len(Tokenizer.from_file(str(path)).encode(TEXT, add_special_tokens=False))
    assert count(TEXT) == expected < utf8_bound(TEXT)  # merges learnt: fewer tokens than bytes
    assert load_tokenizer(path) is count and tokenizer_count(str(path)) is count  # read once
    chat = {"messages": [{"role": "user", "content": TEXT}], "max_tokens": 7}
    user = count("user")
    assert context_tokens("chat/completions", chat, count) == expected + user + MESSAGE_TOKENS + REPLY_TOKENS + 7


def test_a_tokenizer_that_cannot_be_used_says_why(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="cannot read"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{}", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"not a tokenizer\.json"):
        load_tokenizer(tmp_path / "bad.json")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF")
    with pytest.raises(TokenizerError, match="llama"):  # llama-cpp-python missing, or the file unreadable
        load_tokenizer(tmp_path / "bad.gguf")


CONFIG = """\
listen: 127.0.0.1:8080
node_listen: 127.0.0.1:8081
provider_pool: {max_queue: 8, queue_timeout_ms: 1000}
nodes:
  - id: node-a
    token: t
    providers: [{id: gpu0, capacity: 2, context_window_tokens: 4096, total_context_tokens: 8192, admit_by: tokens}]
models:
  - id: m
    tokenizer: TOKENIZER
    candidates: [{node: node-a, provider: gpu0}]
"""


def test_the_tokenizer_key_loads_the_file_and_its_errors_name_file_line_and_field(tmp_path: Path) -> None:
    good = trained_tokenizer(tmp_path / "tokenizer.json")
    config_path = tmp_path / "edge.yaml"
    config_path.write_text(CONFIG.replace("TOKENIZER", str(good)), encoding="utf-8")
    config = load_edge_config(config_path)
    assert config.tokenizer("m") == str(good) and config.tokenizer("other") is None
    (tmp_path / "broken.json").write_text("[", encoding="utf-8")
    for name, why in (("missing.json", "cannot read"), ("broken.json", "not a tokenizer.json")):
        config_path.write_text(CONFIG.replace("TOKENIZER", str(tmp_path / name)), encoding="utf-8")
        with pytest.raises(ConfigFileError) as info:
            load_edge_config(config_path)
        (error,) = info.value.errors
        assert error.startswith(f"{config_path}:10: models[0].tokenizer: ") and why in error


async def test_a_real_edge_reserves_by_the_models_tokenizer(tmp_path: Path) -> None:
    """gpu0 admits by its 8,192 tokens; ornith:35b names the tokenizer: its request reserves the count
    of its prompt (with the template's tokens) plus max_tokens; the other key the UTF-8 bound."""
    path = trained_tokenizer(tmp_path / "tokenizer.json")
    count = load_tokenizer(path)
    layout = EdgeLayout(gpu0_capacity=2, gpu0_admit_by="both", model_keys=(f"tokenizer: {path}",))
    counted = count(TEXT) + count("user") + MESSAGE_TOKENS + REPLY_TOKENS + 9
    bounded = utf8_bound(TEXT) + utf8_bound("user") + MESSAGE_TOKENS + REPLY_TOKENS + 9
    with trio.fail_after(20):
        async with running_edge(tmp_path, layout) as edge, fake_node(edge) as node:
            results: dict[str, httpx.Response] = {}
            async with trio.open_nursery() as nursery:
                start_chat(nursery, edge, results, TEXT, BIG, max_tokens=9)
                first = await node.next_run()
                await eventually(lambda: edge.provider("node-a", "gpu0")["reserved_tokens"] == counted)
                start_chat(nursery, edge, results, TEXT + " ", FAST, max_tokens=9)
                second = await node.next_run()
                await eventually(lambda: edge.provider("node-a", "gpu0")["reserved_tokens"] == counted + bounded + 1)
                await node.answer(first)
                await node.answer(second)
            assert [r.status_code for r in results.values()] == [200, 200]
            await edge.assert_drained()
