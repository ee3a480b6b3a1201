"""The forward-progress watchdog's bookkeeping: :class:`Progress` (per provider) and its verdict.

The hung engine that still answers ``/health`` (vLLM's engine core stuck behind a live
API server) is found by what its runs do, not by what it says: a provider that has had
runs in flight without a break and sent no byte of any of them for ``stall_ms`` is
*stalled*. Only streamed runs count in flight: a non-stream answer comes whole at its
end, so a long one is silent by nature (a hung engine with non-stream work alone is
found by the run's read timeout or deadline). A run's relay counts its runs and body chunks here (:meth:`Progress.begin`,
:attr:`Progress.chunks`: an integer add per chunk, no clock read); the watchdog samples
the counters every tick (:meth:`Progress.check`, sans-I/O: ``now`` is passed in), so
the cost per token stays one add and the time resolution is the tick.

Why "without a break" and not "each run silent for ``stall_ms``": a hung engine keeps
being sent new runs until its capacity is taken, and each new run would restart a
per-run clock; the runs it holds all hang together. The price: a backend that
serializes its runs behind one long prompt (no byte for a while, new runs waiting)
looks the same, and needs a ``stall_ms`` above its longest prompt processing
(docs/node.md, Health).

On a stall the watchdog cuts every run in flight on the provider (:meth:`Progress.check`):
each ends ``upstream_unreachable``, so a run whose client has seen no byte yet is
retried elsewhere by the Edge ([failover-before-first-byte]) instead of waiting out
its read timeout on a backend that will not answer.
"""

from __future__ import annotations

from typing import final

import trio


@final
class Progress:
    """One provider's runs in flight and the body chunks they received (see the module docstring).

    Attributes:
        runs: runs in flight now (relayed runs; tunnel requests and background runs do not count).
        started: runs started so far.
        chunks: body chunks received so far, of every run.
    """

    __slots__ = (
        "runs",
        "started",
        "chunks",
        "silence",
        "cut_runs",
        "idle",
        "_scopes",
        "_seen",
        "_quiet_since",
        "_stalled",
    )

    def __init__(self) -> None:
        self.silence = 0.0
        """Seconds without a byte of the stall being cut (for the runs' error message)."""
        self.cut_runs = 0
        """Runs the last :meth:`check` cut."""
        self.idle = True
        """No run has begun since a :meth:`check` found none in flight and no stall: the next check
        would change nothing, and the watchdog skips it (most providers, most of the time)."""
        self.runs = 0
        self.started = 0
        self.chunks = 0
        self._scopes: set[trio.CancelScope] = set()
        self._seen = 0
        self._quiet_since: float | None = None
        self._stalled = False

    def __repr__(self) -> str:
        return f"<Progress {self.runs} runs, {self.chunks} chunks{' stalled' if self._stalled else ''}>"

    def begin(self) -> trio.CancelScope:
        """Count one run in flight; run it in the scope returned (the one a stall cancels), then :meth:`end` it.

        Two plain calls rather than a context manager: a generator-based one costs a
        visible share of a short run.
        """
        scope = trio.CancelScope()
        self.idle = False
        self.runs += 1
        self.started += 1
        self._scopes.add(scope)
        return scope

    def end(self, scope: trio.CancelScope) -> None:
        """The run of ``scope`` (from :meth:`begin`) is over."""
        self._scopes.discard(scope)
        self.runs -= 1

    @property
    def stalled(self) -> bool:
        """Whether the provider is in a stall now (from the last :meth:`check` until a byte or no run)."""
        return self._stalled

    def check(self, now: float, stall: float) -> bool | None:
        """Sample the counters at ``now``; cut the runs if the provider stalls; return the verdict when it changed.

        True: the provider has had runs in flight and no byte for ``stall`` seconds (a stall
        begins; every run in flight is cut: :attr:`cut_runs`). False: a stall ended (a byte
        arrived, or no run is left). While a stall lasts -- runs that came in after the cut, still
        without a byte -- they are cut in turn once they too went ``stall`` seconds without one.
        ``stall`` 0: never.
        """
        self.cut_runs = 0
        if self.runs == 0 or self.chunks != self._seen or stall <= 0:
            self._seen = self.chunks
            self._quiet_since = now if self.runs else None
            self.idle = not self.runs
            return self._verdict(False)
        if self._quiet_since is None:
            self._quiet_since = now
        if now - self._quiet_since < stall:
            return None
        self.silence = now - self._quiet_since
        self._quiet_since = now  # the runs that come in after the cut get a stall's time of their own
        self.cut_runs = len(self._scopes)
        for scope in self._scopes:
            scope.cancel()
        return self._verdict(True)

    def _verdict(self, stalled: bool) -> bool | None:
        if stalled == self._stalled:
            return None
        self._stalled = stalled
        return stalled
