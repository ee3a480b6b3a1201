"""The official ``openai`` client against the Edge: chat and completions, stream and non-stream.

[contract-spec-sync] [cross-model-tests]: a real in-process Node with a mock
adapter serves ``node-a/gpu0``. ``AsyncOpenAI`` runs under trio for non-stream
calls; streams use the sync client in a worker thread (``AsyncOpenAI``'s
stream leaves async generators to the garbage collector, and a
ResourceWarning is an error here).
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import trio

from edge.harness import BIG, FAST, EdgeLayout, mock_provider, node_config, real_node, running_edge

API_KEY = "client-key-sentinel"


def _stream_chat(base_url: str, model: str) -> list[str]:
    with openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0) as client:
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
        )
        with stream:
            return [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]


def _stream_completion(base_url: str, model: str) -> list[str]:
    with openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0) as client:
        stream = client.completions.create(model=model, prompt="hi", max_tokens=5, stream=True)
        with stream:
            return [chunk.choices[0].text for chunk in stream if chunk.choices]


@pytest.mark.req("contract-spec-sync")
async def test_openai_client_chat_and_completions(tmp_path: Path) -> None:
    """[contract-spec-sync] the openai client parses every Edge answer, both keys, stream and not."""
    with trio.fail_after(20):
        async with running_edge(tmp_path, EdgeLayout(api_keys=(API_KEY,))) as edge:
            base_url = f"http://127.0.0.1:{edge.http_port}/v1"
            config = node_config(edge, "node-a", [mock_provider("gpu0")])
            async with real_node(edge, config):
                async with openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0) as client:
                    models = await client.models.list()
                    assert [m.id for m in models.data] == [BIG, FAST]
                    chat = await client.chat.completions.create(
                        model=BIG, messages=[{"role": "user", "content": "hi"}], max_tokens=5
                    )
                    assert chat.object == "chat.completion"
                    assert chat.choices[0].message.content
                    raw = await client.chat.completions.with_raw_response.create(
                        model=FAST, messages=[{"role": "user", "content": "hi"}], max_tokens=5
                    )
                    assert raw.headers["x-iop-provider"] == "node-a/gpu0"
                    assert raw.parse().choices[0].message.content
                    completion = await client.completions.create(model=FAST, prompt="hi", max_tokens=5)
                    assert completion.object == "text_completion"
                    assert completion.choices[0].text
                    with pytest.raises(openai.NotFoundError) as not_found:
                        await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
                    assert not_found.value.code == "model_not_found"
                deltas = await trio.to_thread.run_sync(_stream_chat, base_url, BIG)
                assert len(deltas) >= 5 and "".join(deltas)
                texts = await trio.to_thread.run_sync(_stream_completion, base_url, FAST)
                assert len(texts) >= 5 and "".join(texts)
                await edge.assert_drained()


async def test_openai_client_bad_key(tmp_path: Path) -> None:
    """A wrong API key surfaces as openai.AuthenticationError with code invalid_api_key."""
    with trio.fail_after(10):
        async with running_edge(tmp_path, EdgeLayout(api_keys=(API_KEY,))) as edge:
            base_url = f"http://127.0.0.1:{edge.http_port}/v1"
            async with openai.AsyncOpenAI(base_url=base_url, api_key="wrong", max_retries=0) as client:
                with pytest.raises(openai.AuthenticationError) as denied:
                    await client.models.list()
                assert denied.value.status_code == 401
                assert denied.value.code == "invalid_api_key"
