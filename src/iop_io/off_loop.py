"""Run long pure-Python work without stalling the event loop: the one place of the GIL-yield concern.

A worker thread alone is not enough: the thread and the loop share the GIL.
Each time the loop thread makes a system call it lets the GIL go, the worker
takes it, and the loop then waits up to the interpreter's switch interval to
get it back -- several times per request it answers. A full garbage collection
started by the worker's allocations holds the GIL for the whole heap. So while any
such work runs (:func:`bulk_work`), the switch interval is short and
automatic collection is off; both are restored when the last one ends.

A short switch interval still leaves the loop waiting for the GIL at each
system call while the worker computes, and on a busy box the worker may be
off the CPU, holding the GIL, when the loop wants it back. Two ways out:

- :func:`run_off_loop`: the work calls :func:`yield_to_loop` often; while the loop has tasks to run, the
  worker waits there without the GIL (a trio instrument tells it when the
  loop waits for I/O again), so it runs in the loop's idle time. The loop
  may still wait for the GIL when it wakes up. ``/metrics`` and ``/status``
  write their text this way.
- :func:`run_in_turns`: the worker runs only while the loop thread waits for
  it, from one :func:`yield_to_loop` to the next, then the loop takes a
  turn: the two never want the GIL at once, and each slice holds the loop as
  long as it runs, as the same work on the loop would. A reload prepares its
  pool's changes this way ([reload-off-loop]).

Collection back on, the objects a reload left (its new config) would all be
young: the next allocation on the loop would start a young-generation
collection over all of them, then a middle one, then a full one, each a long
hold of the loop.
So after work that keeps what it made (``keeps_objects``), everything tracked
is moved to the oldest generation first
(``gc.freeze()`` then ``gc.unfreeze()``, O(1) each): nothing is scanned now,
garbage among those objects is still found by the next full collection, and
the full collections come no sooner than they would have.

Only objects the loop will not touch meanwhile may be handed to the work
(a snapshot taken on the loop, a file path): the loop keeps running.

Long work calls :func:`yield_to_loop` itself (the config loader, the Edge's
page and config rules): it is a no-op anywhere but in such a worker, so no
code passes a ``pause`` callback down to it. The one exception is the
admission library, which depends on no daemon package: its public
``pause=`` parameters are given :func:`yield_to_loop` by the Edge.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import attrs
import trio

T = TypeVar("T")

SWITCH_INTERVAL = 0.0005
"""GIL switch interval (s) while work runs off the loop: the loop thread, back from a
system call, waits at most this long for the GIL."""

MAX_PAUSE = 0.01
"""Longest a worker's :func:`yield_to_loop` waits for the loop to go idle (s); after that the
worker runs on for :data:`FREE_RUN` whatever the loop does, so a loop that is never idle
still lets the work end."""

FREE_RUN = 0.002
"""How long a worker runs on after a :data:`MAX_PAUSE` wait without checking the loop (s)."""


_running = 0
_saved: tuple[float, bool] = (0.005, True)
_promote = False
_worker = threading.local()


class _LoopIdle(trio.abc.Instrument):
    """Tells worker threads whether the loop is waiting for I/O with nothing to run (see
    :func:`yield_to_loop`)."""

    def __init__(self) -> None:
        self.idle = threading.Event()
        self.free_until = 0.0

    def before_io_wait(self, timeout: float) -> None:
        if timeout > 0:
            self.idle.set()

    def after_io_wait(self, timeout: float) -> None:
        if self.idle.is_set():
            self.idle.clear()

    def wait(self) -> None:
        """In a worker: return once the loop is idle, or after :data:`MAX_PAUSE` (then run free for a while)."""
        if time.perf_counter() < self.free_until:
            return
        if not self.idle.wait(MAX_PAUSE):
            self.free_until = time.perf_counter() + FREE_RUN


_gate: _LoopIdle | None = None


def yield_to_loop() -> None:
    """In work that :func:`run_off_loop` runs: wait while the event loop has work to do; in work
    that :func:`run_in_turns` runs: give the loop its turn.

    The worker and the loop share the GIL: each time the loop makes a system
    call (a stream's read, its write) the worker takes the GIL, and the loop
    waits for it again -- up to the switch interval, longer if the worker is
    off the CPU then. Long work calls this often: while the loop runs tasks, the worker then
    waits without the GIL, so the loop's system calls cost it nothing; it
    carries on while the loop waits for I/O. Anywhere else (the loop's own
    thread, a thread started otherwise) it returns at once.
    """
    turns: _Turns | None = getattr(_worker, "turns", None)
    if turns is not None:
        turns.give_back()
        return
    gate: _LoopIdle | None = getattr(_worker, "gate", None)
    if gate is not None and not gate.idle.is_set():
        gate.wait()


@contextlib.contextmanager
def bulk_work(*, keeps_objects: bool = False) -> Iterator[_LoopIdle]:
    """Inside: a short switch interval, automatic GC off and the loop-idle gate installed, as long as
    any bulk work runs (in a worker thread: :func:`run_off_loop`; or on the loop a slice at a time).

    Enter and leave it on the loop. ``keeps_objects``: the work makes many new
    objects that will live on (a config); they join the oldest generation when
    collection is switched back on, as the last stretch of bulk work ends.
    Yields the gate that :func:`yield_to_loop` waits on.
    """
    global _running, _saved, _promote, _gate
    if _gate is None:
        _saved = (sys.getswitchinterval(), gc.isenabled())
        sys.setswitchinterval(min(_saved[0], SWITCH_INTERVAL))
        gc.disable()
        _gate = _LoopIdle()
        trio.lowlevel.add_instrument(_gate)
    _running += 1
    gate = _gate
    try:
        yield gate
    finally:
        _running -= 1
        _promote = _promote or keeps_objects
        if _running == 0:
            trio.lowlevel.remove_instrument(gate)
            gate.idle.set()  # a thread left running (its wait was cancelled) runs on freely
            _gate = None
            sys.setswitchinterval(_saved[0])
            if _saved[1]:
                if _promote:
                    gc.freeze()  # every generation to the permanent one,
                    gc.unfreeze()  # and all of it back as the oldest: no young scan of the new objects
                gc.enable()
            _promote = False


async def run_off_loop(work: Callable[[], T], *, keeps_objects: bool = False) -> T:
    """``work()`` in a worker thread, inside :func:`bulk_work`; the loop runs on meanwhile.

    ``keeps_objects``: the result holds many new objects that will live on;
    they join the oldest generation when collection is switched back on.
    ``work`` may call :func:`yield_to_loop` (directly or through :func:`paced`).

    Checkpoints (it waits for the thread). Cancelled, it returns at once and the
    thread's result is dropped (the thread runs to its end). Raises what
    ``work`` raises.
    """
    with bulk_work(keeps_objects=keeps_objects) as gate:

        def gated() -> T:
            _worker.gate = gate
            try:
                return work()
            finally:
                _worker.gate = None

        return await trio.to_thread.run_sync(gated, abandon_on_cancel=True)


async def run_in_turns(work: Callable[[], T], *, keeps_objects: bool = False) -> T:
    """``work()`` a slice at a time, in turn with the loop: as if on the loop, between its other tasks.

    ``work`` runs in a worker thread, but only while the loop thread waits for
    it: from one :func:`yield_to_loop` call of ``work`` to the next, then the
    loop takes a turn (one checkpoint), then the next slice. The two threads
    never both want the GIL, so the loop never waits for a worker that holds
    it and is itself off the CPU; a slice holds the loop as long as it runs, so
    ``work`` must call :func:`yield_to_loop` often. Inside :func:`bulk_work` (``keeps_objects``: see there).

    Checkpoints (between slices). Cancelled, it stops ``work`` at its next
    :func:`yield_to_loop` and returns at once; nothing is left running. Raises
    what ``work`` raises.
    """
    turns = _Turns()

    result: list[T] = []

    def run() -> None:
        _worker.turns = turns
        try:
            turns.wait_turn()
            result.append(work())
        except BaseException as exc:  # handed to the loop, raised there
            turns.error = exc
        finally:
            _worker.turns = None
            turns.finished = True
            turns.back.release()

    with bulk_work(keeps_objects=keeps_objects):
        trio.lowlevel.start_thread_soon(run, lambda _: None)
        try:
            while True:
                turns.take()
                if turns.finished:
                    break
                await trio.lowlevel.checkpoint()
        except BaseException:
            turns.abandon()
            raise
    if turns.error is not None:
        raise turns.error
    return result[0]


class _Abandoned(BaseException):
    """Raised in a worker's :func:`yield_to_loop` when its :func:`run_in_turns` was cancelled."""


@attrs.define(eq=False)
class _Turns:
    """Hands the GIL's use back and forth between the loop thread and one worker (:func:`run_in_turns`)."""

    go: threading.Semaphore = attrs.field(factory=lambda: threading.Semaphore(0))
    back: threading.Semaphore = attrs.field(factory=lambda: threading.Semaphore(0))
    finished: bool = False
    abandoned: bool = False
    error: BaseException | None = None

    def take(self) -> None:
        """On the loop: let the worker run until it gives the turn back (or ends)."""
        self.go.release()
        self.back.acquire()

    def give_back(self) -> None:
        """In the worker: hand the turn to the loop, wait for the next one."""
        self.back.release()
        self.wait_turn()

    def wait_turn(self) -> None:
        self.go.acquire()
        if self.abandoned:
            raise _Abandoned

    def abandon(self) -> None:
        """On the loop: the worker stops at its next turn (it is waiting for one now)."""
        self.abandoned = True
        self.go.release()


def paced(items: Iterable[T]) -> Iterator[T]:
    """``items``, with :func:`yield_to_loop` before each (for a loop over many in off-loop work)."""
    for item in items:
        yield_to_loop()
        yield item
