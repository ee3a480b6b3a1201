"""An engine's KV cache, as the mock backend and the ledger benchmark model it (issue 40).

A GPU engine keeps one KV entry per token of every running sequence: its prompt once
prefilled, then one more per token generated. The cache holds ``total`` tokens for all
sequences at once, and one sequence at most ``n_ctx``. Sans-I/O and clock-free: the
caller calls :meth:`KvEngine.step` once per decode step and times the steps.

* A request whose ``prompt + max_tokens`` exceeds ``n_ctx`` fails at once with a
  context error (vLLM's 400 "maximum context length"; llama.cpp's request past
  ``n_ctx``).
* Waiting sequences start, in arrival order, when what they need (the prompt, plus the
  tokens generated before a preemption) fits in the free cache; a step prefills up to
  ``prefill_per_step`` tokens, in order, and a sequence whose prefill completes gives
  its first token in that step.
* Each step adds one token to every running sequence. What happens when the cache cannot
  hold a step is the engine's mode:

  - ``"preempt"`` (vLLM's recompute): a sequence starts when its prompt fits the free cache;
    when a step does not fit, the most recently started sequence is evicted: its cache is
    freed and it waits again at the front, to prefill its prompt and its tokens so far once
    more.
  - ``"fail"`` (llama.cpp's server with one unified cache): a request is given a slot at once
    (whatever admits in front of the engine bounds how many), its prompt takes cache chunk
    by chunk as it is prefilled, and when a step finds no room for its tokens the server
    ends *every* sequence in progress with a context error ("Context size has been
    exceeded.") and clears their cache -- llama.cpp's ``update_slots`` does so after halving
    the batch down to one token; dropping only the largest sequence is a TODO there.
  - ``"fail-newest"``: an engine kinder than llama.cpp: a sequence starts when its prompt
    fits, and a step that does not fit fails only the most recently started sequence.

What a step costs (:attr:`Step.seconds`, for a caller that times steps by the engine):
a GPU decode step reads the model's weights (``step_seconds``) and every cache entry
of the batch (``read_seconds`` a token in use: a fuller cache slows every stream),
and the prompt tokens prefilled in the step are computed (``prefill_seconds`` a
token: chunked prefill shares the step with the decodes, so a long prompt -- or a
preempted sequence's recompute -- slows every running stream while it lasts). With
the last two at 0 (the default) every step costs ``step_seconds``.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Final, final

MODES: Final = ("preempt", "fail", "fail-newest")
"""What an engine does when its cache cannot hold a step (see the module docstring)."""


@final
class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


@dataclass(eq=False)
class Sequence:
    """One request in the engine."""

    id: int
    prompt: int
    max_tokens: int
    generated: int = 0
    phase: Phase = Phase.WAITING
    to_prefill: int = 0  # tokens still to prefill before the next token
    started: int = 0  # start order (the newest is preempted first)
    preempted: int = 0
    held: int = 0  # cache entries it holds now

    @property
    def kv(self) -> int:
        """Cache entries it needs to run on: its prompt and the tokens generated so far."""
        return self.prompt + self.generated


@dataclass
class Step:
    """What one decode step did."""

    first: list[int] = field(default_factory=list)  # sequences that gave their first token
    tokens: list[int] = field(default_factory=list)  # sequences that gave a token (first ones too)
    finished: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)  # context errors past the cache (modes "fail*")
    preempted: list[int] = field(default_factory=list)
    seconds: float = 0.0  # what the step took (see the module docstring)


@final
class KvEngine:
    """A shared KV cache of ``total`` tokens, ``n_ctx`` per sequence (see the module docstring).

    Attributes:
        used: cache entries held by started sequences.
        peak: the most ever held.
        preemptions: sequences evicted to be recomputed (mode ``"preempt"``).
        context_errors: requests failed past ``n_ctx``, or sequences failed past the cache
            (modes ``"fail"`` and ``"fail-newest"``).
    """

    def __init__(
        self,
        total: int,
        n_ctx: int,
        *,
        mode: str = "preempt",
        prefill_per_step: int = 8192,
        cost: tuple[float, float, float] = (0.0, 0.0, 0.0),
    ) -> None:
        """``cost``: ``(step_seconds, prefill_seconds, read_seconds)``, what a step costs (see the
        module docstring; all 0: the caller times the steps itself)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if total < 1 or n_ctx < 1 or prefill_per_step < 1:
            raise ValueError("total, n_ctx and prefill_per_step must be >= 1")
        if min(cost) < 0:
            raise ValueError(f"step costs must be >= 0, got {cost}")
        self.total, self.n_ctx, self.mode, self.prefill_per_step = total, n_ctx, mode, prefill_per_step
        self.step_seconds, self.prefill_seconds, self.read_seconds = cost
        self.used = self.peak = self.preemptions = self.context_errors = 0
        self._waiting: deque[Sequence] = deque()
        self._started: dict[int, Sequence] = {}  # in start order
        self._starts = 0

    def submit(self, sid: int, prompt: int, max_tokens: int, output: int | None = None) -> bool:
        """Queue a request; False (a context error, nothing queued) when it cannot fit ``n_ctx``.

        ``output``: the tokens it will really generate before its end of sequence (at most
        ``max_tokens``, the default).
        """
        if not self.fits(prompt, max_tokens):
            self.context_errors += 1
            return False
        out = max_tokens if output is None else max(1, min(output, max_tokens))
        self._waiting.append(Sequence(sid, prompt, out))
        return True

    def fits(self, prompt: int, max_tokens: int) -> bool:
        """Whether a request can run at all: ``prompt + max_tokens`` within ``n_ctx`` and the cache."""
        return prompt + max_tokens <= min(self.n_ctx, self.total)

    def cancel(self, sid: int) -> None:
        """The client went away: drop the sequence and free its cache."""
        seq = self._started.pop(sid, None)
        if seq is not None:
            self.used -= seq.held
            return
        self._waiting = deque(s for s in self._waiting if s.id != sid)

    @property
    def running(self) -> int:
        """Sequences started (prefilling or generating)."""
        return len(self._started)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def started(self) -> list[Sequence]:
        """The sequences holding cache (prefilling or generating), oldest start first."""
        return list(self._started.values())

    @property
    def usage(self) -> float:
        """The cache in use, 0..1 (vLLM's ``kv_cache_usage_perc``)."""
        return self.used / self.total

    def step(self) -> Step:
        """One decode step: start, prefill, then one token for every running sequence."""
        out = Step()
        self._start()
        budget = self.prefill_per_step
        for seq in self._started.values():
            if seq.phase is Phase.PREFILL and budget:
                take = min(budget, seq.to_prefill)
                seq.to_prefill -= take
                budget -= take
                if self.mode == "fail":  # the prompt takes its cache as it is computed
                    seq.held += take
                    self.used += take
                if not seq.to_prefill:
                    seq.phase = Phase.RUNNING
        prefilled = self.prefill_per_step - budget
        read = self.used
        growing = [s for s in self._started.values() if s.phase is Phase.RUNNING]
        if self.mode == "fail" and self.used + len(growing) > self.total:
            for seq in list(self._started.values()):
                self._evict(seq, out)
            growing = []
        while growing and self.used + len(growing) > self.total:
            victim = next(reversed(self._started.values()))
            self._evict(victim, out)
            if victim in growing:
                growing.remove(victim)
        for seq in growing:
            seq.generated += 1
            seq.held += 1
            self.used += 1
            out.tokens.append(seq.id)
            if seq.generated == 1:
                out.first.append(seq.id)
            if seq.generated >= seq.max_tokens:
                seq.phase = Phase.DONE
                del self._started[seq.id]
                self.used -= seq.held
                out.finished.append(seq.id)
        self.peak = max(self.peak, self.used)
        out.seconds = self.step_seconds + prefilled * self.prefill_seconds + read * self.read_seconds
        return out

    def _start(self) -> None:
        """Start the waiting sequences that may start: in mode ``"fail"`` all of them, holding
        nothing until prefilled; otherwise in order while each one's cache fits, taken at once."""
        at_once = self.mode != "fail"
        while self._waiting and (not at_once or self.used + self._waiting[0].kv <= self.total):
            seq = self._waiting.popleft()
            seq.phase, seq.to_prefill = Phase.PREFILL, seq.kv
            self._starts += 1
            seq.started = self._starts
            self._started[seq.id] = seq
            if at_once:
                seq.held = seq.kv
                self.used += seq.kv
        self.peak = max(self.peak, self.used)

    def _evict(self, seq: Sequence, out: Step) -> None:
        del self._started[seq.id]
        self.used -= seq.held
        seq.held = 0
        if self.mode != "preempt":
            seq.phase = Phase.FAILED
            self.context_errors += 1
            out.failed.append(seq.id)
            return
        seq.phase = Phase.WAITING
        seq.preempted += 1
        self.preemptions += 1
        self._waiting.appendleft(seq)
        out.preempted.append(seq.id)
