"""[token-ledger] Reservations counted with the model's own tokenizer against what llama.cpp reports.

The Edge names the model's GGUF as its tokenizer (``models[].tokenizer``); gpu0 admits by tokens
(its window and budget are llama.cpp's 2,048-token context). Requests of the trace's kinds --
chats of English prose, of Python source, a multi-turn chat in French, Chinese and Japanese, a
text completion -- go through real Edge and Node processes; each prompt's reservation (the
Edge's rule, :func:`iop_edge.token_count.prompt_tokens`, with the same tokenizer) is within 5 % of
the ``usage.prompt_tokens`` llama.cpp reports for it (llama-cpp-python's server exposes no other
context figure: no ``/slots``). One stream shows ``/status`` reserving exactly that rule's figure
plus ``max_tokens`` while it runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
from llama_server import N_CTX

from e2e.harness import BIG, FAST, Stack, edge_config, node_config, open_stack, provider
from iop_config import ConfigFileError
from iop_edge.config import load_edge_config
from iop_edge.token_count import load_tokenizer, prompt_tokens

TIMEOUT = 900.0
"""Seconds for the test: prefill on a loaded 2-core box is slow."""
REPO = Path(__file__).resolve().parents[1]
WITHIN = 0.05
NO_END = {"1": -100, "106": -100}
"""``logit_bias`` keeping Gemma from ``<eos>`` and ``<end_of_turn>``: the stream runs its ``max_tokens``."""


def requests() -> list[tuple[str, dict[str, Any]]]:
    """The trace's kinds of requests, each well inside the 2,048-token context."""
    prose = (REPO / "docs" / "admission.md").read_text(encoding="utf-8")[:1200]
    source = (REPO / "src" / "iop_edge" / "token_count.py").read_text(encoding="utf-8")[:1000]
    turns = [
        {"role": "user", "content": "Bonjour ! Peux-tu m'expliquer pourquoi le ciel est bleu, en deux phrases ?"},
        {"role": "assistant", "content": "La lumière bleue est davantage diffusée par l'air que la lumière rouge."},
        {"role": "user", "content": "写一首关于秋天的短诗。それから、日本語で同じ詩を書いてください。"},
    ]
    return [
        ("chat/completions", {"model": BIG, "messages": [{"role": "user", "content": prose}], "max_tokens": 2}),
        ("chat/completions", {"model": FAST, "messages": [{"role": "user", "content": source}], "max_tokens": 2}),
        ("chat/completions", {"model": BIG, "messages": turns, "max_tokens": 2}),
        ("completions", {"model": FAST, "prompt": prose[:600], "max_tokens": 2}),
    ]


def budgeted_config(tokenizer: Path) -> dict[str, Any]:
    config = edge_config()
    (gpu0,) = config["nodes"][0]["providers"]
    gpu0.update(admit_by="tokens", context_window_tokens=N_CTX, total_context_tokens=N_CTX)
    for model in config["models"]:
        model["tokenizer"] = str(tokenizer)
    return config


async def post(stack: Stack, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await stack.http.post(f"{stack.base_url}/v1/{endpoint}", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def test_reservations_by_the_models_tokenizer_are_within_5_percent_of_llama_cpps_count(
    tmp_path: Path, llama_port: int, llama_model: Path
) -> None:
    count = load_tokenizer(llama_model)
    gaps: list[tuple[str, int, int]] = []
    with trio.fail_after(TIMEOUT):
        async with open_stack(tmp_path) as stack:
            await stack.start_edge(budgeted_config(llama_model))
            stack.backend_port = llama_port
            await stack.start_node(node_config())
            for endpoint, body in requests():
                reported = (await post(stack, endpoint, body))["usage"]["prompt_tokens"]
                gaps.append((endpoint, prompt_tokens(endpoint, body, count), reported))
            streamed = {
                "model": BIG,
                "messages": [{"role": "user", "content": "Count from one to fifty in words."}],
                "max_tokens": 64,
                "stream": True,
                "logit_bias": NO_END,
            }
            expected = prompt_tokens("chat/completions", streamed, count) + 64
            async with stack.http.stream(
                "POST", f"{stack.base_url}/v1/chat/completions", json=streamed, timeout=TIMEOUT
            ) as answer:
                assert answer.status_code == 200, await answer.aread()
                lines = answer.aiter_lines()
                while not (await anext(lines)).startswith("data: {"):
                    pass  # the first chunk: the run holds its reservation until its end
                held = provider(await stack.status(), "gpu0")["reserved_tokens"]
                async for _ in lines:
                    pass
    print("\n".join(f"{e}: reserved {ours}, llama.cpp {theirs} ({ours / theirs - 1:+.1%})" for e, ours, theirs in gaps))
    for endpoint, ours, theirs in gaps:
        assert abs(ours - theirs) <= WITHIN * theirs, (endpoint, ours, theirs)
    assert held == expected


def test_the_edge_refuses_a_gguf_tokenizer_llama_cpp_cannot_read(tmp_path: Path) -> None:
    """With llama-cpp-python installed, a ``.gguf`` that is not a model is a config error naming the key."""
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    path = tmp_path / "edge.yaml"
    path.write_text(json.dumps(budgeted_config(bad)), encoding="utf-8")  # JSON is YAML
    with pytest.raises(ConfigFileError) as info:
        load_edge_config(path)
    assert [e.split(": ")[1] for e in info.value.errors] == ["models[0].tokenizer", "models[1].tokenizer"]
    assert all("not a model file llama.cpp reads" in e for e in info.value.errors)
