"""The mock backend's fault modes and its health endpoints (the backends' own, as a Node probes them).

``POST /fault`` sets the whole fault state at once (``{}`` heals everything)::

    {"status": 500}            every generation request answers 500 (an OpenAI error body)
    {"hang": "no_answer"}      generation requests get nothing at all (no head): the hung
                               engine whose ``/health`` still answers 200
    {"hang": "head_only"}      200 and its headers, then nothing
    {"hang": "mid_stream"}     a stream's first tokens, then nothing (``hang_after_tokens``, default 1)
    {"loading": true}          ``/health`` answers 503 "Loading model" (llama.cpp while it loads)
    {"kv_use": 0.9}            the engine says 0.9 of its KV cache is in use (``/metrics``'
                               ``kv_cache_usage_perc``; every ``/slots`` slot processing with
                               that share of its ``n_ctx`` held): a cache others fill
    {"preemptions": 5}         ``/metrics``' ``num_preemptions_total`` says 5

A hung request stays counted in flight until its client goes away (the Node's watchdog
cutting it shows in ``/stats``). Health endpoints: llama.cpp's ``GET /health`` and ``GET
/slots`` (each slot's ``n_ctx``), vLLM's ``GET /metrics`` (running and waiting requests, KV-cache
use, preemptions), Ollama's
``GET /api/ps``; OpenAI's ``GET /v1/models`` is the backend's own. With a KV budget
(``--kv-tokens``), ``/metrics`` and ``/slots`` report the pool's real figures, and the ``kv_use``
and ``preemptions`` faults are not read.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Final, final

import attrs
import trio

from iop_mock.framing import Receive, Send, encode_json, error_body, send_json
from iop_mock.request_body import read_body

if TYPE_CHECKING:
    from iop_mock.backend import MockBackend
    from iop_mock.kv import KvEngine

HANGS: Final = ("none", "no_answer", "head_only", "mid_stream")
"""The values of ``POST /fault``'s ``hang``."""


@final
@attrs.frozen
class Faults:
    """The fault state ``POST /fault`` sets (see the module docstring).

    Attributes:
        status: every generation request answers this HTTP error status (None: served).
        hang: ``none``, ``no_answer``, ``head_only`` or ``mid_stream``.
        hang_after_tokens: ``mid_stream``: the tokens sent before the stream stops.
        loading: ``/health`` answers 503 as llama.cpp does while loading its model.
        kv_use: the KV-cache use the engine reports (None: its slots in use, as before).
        preemptions: the preemption count ``/metrics`` reports.
    """

    status: int | None = None
    hang: str = "none"
    hang_after_tokens: int = 1
    loading: bool = False
    kv_use: float | None = None
    preemptions: int = 0

    @classmethod
    def parse(cls, body: bytes) -> Faults:
        """The fault state a ``POST /fault`` body asks for.

        Raises:
            ValueError: the body is not such a request (the message says why).
        """
        data = json.loads(body or b"{}")
        if not isinstance(data, dict):
            raise ValueError("the body must be a JSON object")
        unknown = set(data) - {"status", "hang", "hang_after_tokens", "loading", "kv_use", "preemptions"}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}")
        status = data.get("status")
        if status is not None and (type(status) is not int or not 400 <= status <= 599):
            raise ValueError("status must be null or an HTTP error status (400-599)")
        hang = data.get("hang", "none")
        if hang not in HANGS:
            raise ValueError(f"hang must be one of {', '.join(HANGS)}")
        after = data.get("hang_after_tokens", 1)
        if type(after) is not int or after < 0:
            raise ValueError("hang_after_tokens must be an integer >= 0")
        loading = data.get("loading", False)
        if type(loading) is not bool:
            raise ValueError("loading must be true or false")
        kv_use = data.get("kv_use")
        if kv_use is not None and (type(kv_use) not in (int, float) or not 0 <= kv_use <= 1):
            raise ValueError("kv_use must be null or a number in [0, 1]")
        preemptions = data.get("preemptions", 0)
        if type(preemptions) is not int or preemptions < 0:
            raise ValueError("preemptions must be an integer >= 0")
        return cls(status, hang, after, loading, None if kv_use is None else float(kv_use), preemptions)

    def echo(self) -> dict[str, Any]:
        """The answer to ``POST /fault``: the status, and every other setting that is not the default."""
        answer: dict[str, Any] = {"status": self.status}
        if self.hang != "none":
            answer["hang"] = self.hang
            answer["hang_after_tokens"] = self.hang_after_tokens
        if self.loading:
            answer["loading"] = True
        if self.kv_use is not None:
            answer["kv_use"] = self.kv_use
        if self.preemptions:
            answer["preemptions"] = self.preemptions
        return answer

    async def hold(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        """``no_answer`` and ``head_only``: answer nothing (or only the head) until the client leaves.

        Returns at once for the other modes. Checkpoints; cancellation (the client gone) ends it.
        """
        if self.hang == "head_only":
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b"", "more_body": True})
        if self.hang in ("no_answer", "head_only"):
            await trio.sleep_forever()

    def tokens_before_hang(self) -> int | None:
        """``mid_stream``: how many tokens a stream sends before it stops; None: all of them."""
        return self.hang_after_tokens if self.hang == "mid_stream" else None


async def fault(backend: MockBackend, receive: Receive, send: Send) -> None:
    """``POST /fault``: set the backend's fault state (400 and no change if the body is bad)."""
    try:
        faults = Faults.parse(await read_body(receive) or b"")
    except ValueError as exc:
        await send_json(send, 400, error_body(f"bad fault request: {exc}", "bad_request"))
        return
    backend.faults = faults
    backend.fail_status = faults.status
    await send_json(send, 200, encode_json(faults.echo()).encode())


async def health(backend: MockBackend, receive: Receive, send: Send) -> None:
    """llama.cpp's ``GET /health``: 200 ``{"status": "ok"}``, or 503 while "loading"."""
    if backend.faults.loading:
        body = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
        await send_json(send, 503, encode_json(body).encode())
    else:
        await send_json(send, 200, b'{"status":"ok"}')


SLOT_CONTEXT: Final = 4096
"""The ``n_ctx`` each ``/slots`` slot reports."""


async def slots(backend: MockBackend, receive: Receive, send: Send) -> None:
    """llama.cpp's ``GET /slots``: one entry per slot (``backend.slots``) with its ``n_ctx``, busy ones
    processing; with a ``kv_use`` fault, every slot processing with that share of its context held;
    with a KV budget, the pool's own (:func:`_pool_slots`)."""
    kv_use = backend.faults.kv_use
    entries: list[dict[str, Any]]
    if backend.kv is not None:
        entries = _pool_slots(backend.kv.engine, backend.slots)
    elif kv_use is None:
        busy = backend.stats()["in_flight"]
        entries = [{"id": i, "n_ctx": SLOT_CONTEXT, "is_processing": i < busy} for i in range(backend.slots)]
    else:
        held = round(kv_use * SLOT_CONTEXT)
        entries = [
            {
                "id": i,
                "n_ctx": SLOT_CONTEXT,
                "is_processing": True,
                "n_prompt_tokens": held,
                "next_token": [{"has_next_token": True, "n_decoded": 0}],
            }
            for i in range(backend.slots)
        ]
    await send_json(send, 200, encode_json(entries).encode())


def _pool_slots(engine: KvEngine, parallel: int) -> list[dict[str, Any]]:
    """The KV pool as llama.cpp's slots: ``parallel`` of them (more when more sequences run), their
    ``n_ctx`` summing to the pool; each running sequence on a slot of its own, processing with its
    prompt and its tokens so far held (their sum: the cache in use)."""
    running = engine.started()
    count = max(parallel, len(running))
    share, extra = divmod(engine.total, count)
    entries: list[dict[str, Any]] = [
        {"id": i, "n_ctx": share + (i < extra), "is_processing": False} for i in range(count)
    ]
    for entry, seq in zip(entries, running, strict=False):
        entry.update(
            is_processing=True,
            n_prompt_tokens=seq.prompt,
            next_token=[{"has_next_token": True, "n_decoded": seq.generated}],
        )
    return entries


async def metrics(backend: MockBackend, receive: Receive, send: Send) -> None:
    """vLLM's ``GET /metrics`` (Prometheus text): requests running and waiting, KV-cache use (the
    ``kv_use`` fault's, else the slots in use), preemptions (the fault's count); with a KV budget,
    the pool's own figures."""
    running, waiting = backend.stats()["in_flight"], 0
    kv_use = min(1.0, running / backend.slots) if backend.faults.kv_use is None else backend.faults.kv_use
    preemptions = backend.faults.preemptions
    if backend.kv is not None:
        engine = backend.kv.engine
        running, waiting, kv_use, preemptions = engine.running, engine.waiting, engine.usage, engine.preemptions
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{model_name="{backend.models[0]}"}} {running}\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{model_name="{backend.models[0]}"}} {waiting}\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{model_name="{backend.models[0]}"}} {kv_use:g}\n'
        "# TYPE vllm:num_preemptions_total counter\n"
        f'vllm:num_preemptions_total{{model_name="{backend.models[0]}"}} {preemptions}\n'
    ).encode()
    headers = [(b"content-type", b"text/plain; version=0.0.4"), (b"content-length", b"%d" % len(text))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": text})


async def ollama_ps(backend: MockBackend, receive: Receive, send: Send) -> None:
    """Ollama's ``GET /api/ps``: the models loaded (every model of the backend)."""
    models = [{"name": model, "model": model, "size": 0} for model in backend.models]
    await send_json(send, 200, encode_json({"models": models}).encode())
