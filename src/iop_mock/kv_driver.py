"""The HTTP mock's KV budget: :class:`~iop_mock.kv.KvEngine` stepped in real time (issue 40).

With ``--kv-tokens`` the mock's generations are no longer merely timed: each one is a sequence
of the engine (its prompt as the mock counts it for ``usage``, plus the tokens generated so
far), holding cache in one pool while it runs, and its tokens are the ones the engine's steps
give it. The rules (what fits, who starts, who is evicted, what a step costs) are the
engine's, the same the ledger benchmark replays; this module only runs the steps on trio's
clock and hands each step's tokens to the streams.

- A request whose ``prompt + max_tokens`` exceeds ``n_ctx`` (or the whole cache) is refused
  when its body is read: 400, OpenAI's ``context_length_exceeded`` error (:meth:`KvDriver.check`).
- Otherwise it waits ``latency`` (the mock's transport delay), then enters the engine and gets
  its tokens as the steps produce them: one step every ``1 / tokens_per_second`` (each running
  sequence gets a token a step), plus the time its prompt tokens take to prefill. It ends at its
  end of sequence: ``max_tokens``, or sooner when the request's ``mock_output_tokens`` says so.
- Mode ``preempt``: when the pool is full the newest sequence is evicted; its stream pauses
  until it is started again and has prefilled its prompt and its tokens so far once more.
- Mode ``fail`` (llama.cpp): a request starts at once and its prompt takes cache as it is
  prefilled; a step that finds no room fails every sequence in progress (:class:`KvCacheFull`):
  a 500 for an answer not started, else an error frame that ends the stream. Mode
  ``fail-newest`` fails only the newest one.

One system task per ``trio.run`` steps the engine while it holds or awaits sequences and
sleeps otherwise (started by the first sequence, as :class:`iop_mock.Pacer`'s runner is).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Final, final

import trio

from .framing import NDJSON_HEADERS, Send, encode_json, error_body, send_json
from .kv import KvEngine, Step
from .request_body import BadRequest, Generation

__all__ = ["KV_CACHE_FULL", "KvCacheFull", "KvDriver", "TokenFlow"]

KV_CACHE_FULL: Final = "Context size has been exceeded."
"""The message of a sequence failed past the cache (llama.cpp's words for a full unified cache)."""


@final
class KvCacheFull(Exception):
    """The engine failed the sequence past its cache and does not run it again (modes ``fail*``)."""


@final
class TokenFlow:
    """One sequence's tokens, as the engine's steps produce them.

    Attributes:
        produced: tokens generated so far (those before a preemption stay generated).
        ended: the sequence finished or failed.
        failed: it failed past the cache (modes ``fail*``).
    """

    __slots__ = ("produced", "ended", "failed", "_lot")

    def __init__(self) -> None:
        self.produced = 0
        self.ended = False
        self.failed = False
        self._lot = trio.lowlevel.ParkingLot()

    async def more(self, seen: int) -> int:
        """``produced`` once it is above ``seen``, or at the sequence's end.

        Raises:
            KvCacheFull: the sequence was evicted for good.

        Checkpoints when it waits; cancellation leaves the flow as it was.
        """
        while self.produced <= seen and not self.ended:
            await self._lot.park()
        if self.failed:
            raise KvCacheFull(KV_CACHE_FULL)
        return self.produced

    def wake(self) -> None:
        self._lot.unpark_all()


@final
class KvDriver:
    """Runs ``engine`` on trio's clock for the HTTP mock (see the module docstring)."""

    def __init__(self, engine: KvEngine) -> None:
        self.engine = engine
        self._flows: dict[int, TokenFlow] = {}
        self._ids = itertools.count(1)
        self._idle = trio.Event()
        self._run: trio.lowlevel.Task | None = None

    @classmethod
    def build(
        cls,
        tokens: int,
        n_ctx: int,
        mode: str,
        *,
        tokens_per_second: float,
        prefill_tokens_per_second: float,
        prefill_per_step: int = 8192,
        read_seconds: float = 0.0,
    ) -> KvDriver:
        """A driver for a cache of ``tokens``: a step every ``1 / tokens_per_second`` (0: steps back to back),
        each prompt token prefilled costing ``1 / prefill_tokens_per_second`` more (0: nothing more), at
        most ``prefill_per_step`` of them a step, and each cache entry in use ``read_seconds`` more.

        Raises:
            ValueError: a figure out of range, or a mode not in :data:`iop_mock.kv.MODES`.
        """
        if tokens_per_second < 0 or prefill_tokens_per_second < 0:
            raise ValueError("tokens_per_second and prefill_tokens_per_second must be >= 0")
        step = 1.0 / tokens_per_second if tokens_per_second else 0.0
        prefill = 1.0 / prefill_tokens_per_second if prefill_tokens_per_second else 0.0
        cost = (step, prefill, read_seconds)
        return cls(KvEngine(tokens, n_ctx, mode=mode, prefill_per_step=prefill_per_step, cost=cost))

    def check(self, prompt: int, max_tokens: int) -> None:
        """Refuse a request that cannot fit the engine's context, as vLLM and OpenAI do.

        Raises:
            BadRequest: ``context_length_exceeded`` (counted in the engine's ``context_errors``).
        """
        engine = self.engine
        if engine.fits(prompt, _generated(max_tokens)):
            return
        engine.context_errors += 1
        limit = min(engine.n_ctx, engine.total)
        raise BadRequest(
            f"This model's maximum context length is {limit} tokens. However, you requested"
            f" {prompt + max_tokens} tokens ({prompt} in the messages, {max_tokens} in the completion)."
            " Please reduce the length of the messages or completion.",
            "context_length_exceeded",
        )

    @asynccontextmanager
    async def sequence(self, prompt: int, max_tokens: int, output: int | None = None) -> AsyncIterator[TokenFlow]:
        """Run a sequence (already :meth:`check`-ed) in the engine while the block runs; leaving the
        block early (the client gone) frees its cache. ``output``: the tokens it generates before its
        end of sequence (at most ``max_tokens``, the default).

        Raises:
            BadRequest: it cannot fit the engine's context.
        """
        self.check(prompt, max_tokens)
        self._ensure_runner()
        sid = next(self._ids)
        self.engine.submit(sid, prompt, _generated(max_tokens), None if output is None else _generated(output))
        flow = self._flows[sid] = TokenFlow()
        self._idle.set()
        try:
            yield flow
        finally:
            del self._flows[sid]
            if not flow.ended:
                self.engine.cancel(sid)

    async def run_whole(self, send: Send, generation: Generation) -> bool:
        """Run a whole (not streamed) answer's sequence to its end; False when it failed (the 500 sent).

        Checkpoints; cancellation frees its cache.
        """
        async with self.sequence(generation.prompt_tokens, generation.max_tokens, generation.n_tokens) as flow:
            try:
                while not flow.ended:
                    await flow.more(flow.produced)
            except KvCacheFull as full:
                await send_json(send, 500, _full_body(full))
                return False
        return True

    async def stream(
        self,
        send: Send,
        headers: list[tuple[bytes, bytes]],
        frames: Iterator[bytes],
        generation: Generation,
        *,
        head: int,
        trailer: bytes,
        hang_after: int | None,
    ) -> None:
        """A stream whose tokens are the ones the engine's steps give its sequence.

        The head goes out with the first token (a sequence evicted for good before it gets a 500);
        each message carries the tokens produced since the last one (a preempted sequence's
        stream pauses); an eviction for good once the stream began ends it with an error frame.
        ``hang_after``: send that many tokens, then nothing (``POST /fault`` ``mid_stream``).

        Checkpoints; cancellation (the client gone) frees its cache.
        """
        n_tokens = generation.n_tokens
        limit = n_tokens if hang_after is None else min(n_tokens, hang_after)
        async with self.sequence(generation.prompt_tokens, generation.max_tokens, n_tokens) as flow:
            try:
                produced = await flow.more(0)
            except KvCacheFull as full:
                await send_json(send, 500, _full_body(full))
                return
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            sent, body = 0, b"".join(itertools.islice(frames, head))
            try:
                while True:
                    take = min(produced, limit) - sent
                    body += b"".join(itertools.islice(frames, take))
                    sent += take
                    if sent == limit:
                        break
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                    body = b""
                    produced = await flow.more(produced)
            except KvCacheFull as full:
                if headers is NDJSON_HEADERS:  # Ollama's stream ends with {"error": message}
                    ending = encode_json({"error": str(full)}).encode() + b"\n"
                else:
                    ending = b"data: " + _full_body(full) + b"\n\n"
                await send({"type": "http.response.body", "body": body + ending})
                return
        if sent < n_tokens:
            await send({"type": "http.response.body", "body": body, "more_body": True})
            await trio.sleep_forever()
        await send({"type": "http.response.body", "body": body + b"".join(frames) + trailer})

    def _ensure_runner(self) -> None:
        root = trio.lowlevel.current_root_task()
        if self._run is not root:  # the first sequence of this trio.run: start its stepper
            self._run = root
            self._idle = trio.Event()
            trio.lowlevel.spawn_system_task(self._steps, name="iop_mock kv engine")

    async def _steps(self) -> None:
        """Step the engine while it has sequences: each step lasts what the engine says it costs, and
        its tokens (its failures) reach their streams at its end; a step more than a step late starts
        the schedule again from now rather than catching up."""
        engine = self.engine
        due = trio.current_time()
        while True:
            if not (engine.running or engine.waiting):
                self._idle = trio.Event()
                await self._idle.wait()
                due = trio.current_time()
            step = engine.step()
            due += step.seconds
            await trio.sleep_until(due)
            due = max(due, trio.current_time() - step.seconds)
            self._deliver(step)

    def _deliver(self, step: Step) -> None:
        """Hand ``step``'s tokens and ends to their streams (a stream whose client left meanwhile has none)."""
        flows = self._flows
        for sid in step.tokens:
            if (flow := flows.get(sid)) is not None:
                flow.produced += 1
        for sid in itertools.chain(step.finished, step.failed):
            if (flow := flows.get(sid)) is not None:
                flow.ended = True
                flow.failed = sid in step.failed
        for sid in {*step.tokens, *step.failed}:
            if (flow := flows.get(sid)) is not None:
                flow.wake()


def _generated(max_tokens: int) -> int:
    """What a sequence generates in the engine: ``max_tokens``, and one token for a request of none
    (the engine ends a sequence at a generated token; the stream sends none of it)."""
    return max(1, max_tokens)


def _full_body(full: KvCacheFull) -> bytes:
    """The OpenAI error object of a sequence evicted for good (a 500's body, or a stream's last event)."""
    return error_body(str(full), "kv_cache_full", "server_error")
