"""Run long pure-Python work in a worker thread without stalling the event loop.

A worker thread alone is not enough: the thread and the loop share the GIL.
Each time the loop thread makes a system call it lets the GIL go, the worker
takes it, and the loop then waits up to the interpreter's switch interval
(5 ms by default) to get it back -- several times per request it answers. A
full garbage collection started by the worker's allocations holds the GIL for
the whole heap (over a second with 10,000 nodes configured). So while any
such work runs, the switch interval is short and automatic collection is off;
both are restored when the last one ends.

A short switch interval still leaves the loop waiting for the GIL at each
system call while the worker computes, and on a busy box the worker may be
off the CPU, holding the GIL, when the loop wants it back. Long work
therefore calls :func:`yield_to_loop` every few hundred microseconds of its
own: while the loop has tasks to run, the worker waits there without the
GIL (a trio instrument tells it when the loop waits for I/O again). The
reload's parse, structuring, validation and pool comparison do
([reload-off-loop]); a reload then runs in the loop's idle time.

Idle time of the loop is not idle time of the machine: a reload's worker
busy for a second takes a core from everything else on it (a Node, the
backend, the clients on a small box), and a stream's events wait for a CPU.
Work started with ``cpu_share`` below 1 therefore rests without the GIL at
:func:`yield_to_loop` after each :data:`WORK_SLICE` of running, long
enough to use at most that share of a core; the reload uses
:data:`RELOAD_CPU_SHARE`.

Collection back on, the objects a reload left (its new config: some
300,000 of them at 10,000 nodes) would all be young: the next allocation on
the loop would start a young-generation collection over all of them, then a
middle one, then a full one (130, 60 and 260 ms measured on a loaded box).
So after work that keeps what it made (``keeps_objects``), everything tracked
is moved to the oldest generation first
(``gc.freeze()`` then ``gc.unfreeze()``, O(1) each): nothing is scanned now,
garbage among those objects is still found by the next full collection, and
the full collections come no sooner than they would have.

Only objects the loop will not touch meanwhile may be handed to the work
(a snapshot taken on the loop, a file path): the loop keeps running.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

import attrs
import trio

from iop_admission import Admission, ProviderRow, ProviderSnapshot, Snapshot

T = TypeVar("T")
R = TypeVar("R")

SWITCH_INTERVAL = 0.0005
"""GIL switch interval (s) while work runs off the loop: the loop thread, back from a
system call, waits at most this long for the GIL."""

SNAPSHOT_SLICE = 500
"""Providers read per loop turn by :func:`snapshot_in_slices` (about 1.5 ms of CPU)."""

ROW_SLICE = 1000
"""Providers read per loop turn by :func:`rows_in_slices` (a plain row costs about half
an object: about the time of a :data:`SNAPSHOT_SLICE`)."""

NODE_SLICE = 1000
"""Nodes whose connection state ``/status`` reads per loop turn (a node's row costs about
a third of a provider's, so about the time of a :data:`SNAPSHOT_SLICE`)."""

WORK_SLICE = 0.002
"""How long work started with a ``cpu_share`` below 1 runs between two rests (s)."""

RELOAD_CPU_SHARE = 0.5
"""The share of a core a config reload's worker uses (its parse takes twice its CPU time in
wall time): measured on the 2-core benchmark box with 10,000 nodes, a running stream's
largest gap during a reload stayed <= 20 ms in 25 of 25 reloads, against 23 of 25 at a
full core (docs/benchmarks-history.md, Scale)."""

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
    """In work that :func:`run_off_loop` runs: wait while the event loop has work to do.

    The worker and the loop share the GIL: each time the loop makes a system
    call (a stream's read, its write) the worker takes the GIL, and the loop
    waits for it again -- up to the switch interval, longer if the worker is
    off the CPU then. Long work calls this often (every few hundred
    microseconds of its own): while the loop runs tasks, the worker then
    waits without the GIL, so the loop's system calls cost it nothing; it
    carries on while the loop waits for I/O. Anywhere else (the loop's own
    thread, a thread not started by :func:`run_off_loop`) it returns at once.
    """
    gate: _LoopIdle | None = getattr(_worker, "gate", None)
    if gate is None:
        return
    if not gate.idle.is_set():
        gate.wait()
        _worker.slice_start = time.perf_counter()
    elif _worker.rest and time.perf_counter() - _worker.slice_start >= WORK_SLICE:
        time.sleep(_worker.rest)
        _worker.slice_start = time.perf_counter()


async def run_off_loop(work: Callable[[], T], *, keeps_objects: bool = False, cpu_share: float = 1.0) -> T:
    """``work()`` in a worker thread, with a short switch interval and automatic GC off meanwhile.

    ``keeps_objects``: the result holds many new objects that will live on (a
    config); they join the oldest generation when collection is switched back on.
    ``work`` may call :func:`yield_to_loop` (directly or through :func:`paced`).
    ``cpu_share`` (0 < share <= 1): at most this share of a core; below 1, the
    work rests at :func:`yield_to_loop` after each :data:`WORK_SLICE` of running.

    Checkpoints (it waits for the thread). Cancelled, it returns at once and the
    thread's result is dropped (the thread runs to its end). Raises what
    ``work`` raises, and ValueError for a ``cpu_share`` outside (0, 1].
    """
    global _running, _saved, _promote, _gate
    if not 0 < cpu_share <= 1:
        raise ValueError(f"cpu_share must be in (0, 1], not {cpu_share}")
    if _gate is None:
        _saved = (sys.getswitchinterval(), gc.isenabled())
        sys.setswitchinterval(min(_saved[0], SWITCH_INTERVAL))
        gc.disable()
        _gate = _LoopIdle()
        trio.lowlevel.add_instrument(_gate)
    _running += 1
    gate = _gate
    rest = WORK_SLICE * (1 - cpu_share) / cpu_share

    def gated() -> T:
        _worker.gate = gate
        _worker.rest = rest
        _worker.slice_start = time.perf_counter()
        try:
            return work()
        finally:
            _worker.gate = None

    try:
        return await trio.to_thread.run_sync(gated, abandon_on_cancel=True)
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


def paced(items: Iterable[T]) -> Iterator[T]:
    """``items``, with :func:`yield_to_loop` before each (for a loop over many in off-loop work)."""
    for item in items:
        yield_to_loop()
        yield item


async def snapshot_in_slices(admission: Admission, size: int = SNAPSHOT_SLICE) -> Snapshot:
    """``admission.snapshot()``, read ``size`` providers per loop turn ([status-at-size]).

    At 10,000 providers a whole snapshot holds the loop about 30 ms (a stream's
    events wait that long); a slice about 1.5 ms. The Edge-wide fields are read
    with the first slice; each provider's row is read at once, rows of different
    slices a few loop turns apart. A config refresh between two slices starts
    the reading again, so the rows are always those of one config; after three
    such restarts the rest is read in one go. Checkpoints (between slices).
    """

    def first_slice(count: int | None) -> tuple[Snapshot, Sequence[ProviderSnapshot]]:
        head = admission.snapshot(count=count)
        return head, head.providers

    head, rows = await _in_slices(
        admission, first_slice, lambda first, count: admission.snapshot(first=first, count=count).providers, size
    )
    return attrs.evolve(head, providers=tuple(rows))


async def rows_in_slices(admission: Admission, size: int = ROW_SLICE) -> tuple[Snapshot, list[ProviderRow]]:
    """The snapshot's Edge-wide fields (``providers`` empty) and its providers as
    :meth:`~iop_admission.Admission.provider_rows`, read as :func:`snapshot_in_slices` reads
    (``size`` per loop turn). Checkpoints (between slices)."""
    return await _in_slices(
        admission,
        lambda count: (admission.snapshot(count=0), admission.provider_rows(count=count)),
        lambda first, count: admission.provider_rows(first=first, count=count),
        size,
    )


async def _in_slices(
    admission: Admission,
    first_slice: Callable[[int | None], tuple[Snapshot, Sequence[R]]],
    read: Callable[[int, int], Sequence[R]],
    size: int,
) -> tuple[Snapshot, list[R]]:
    """The Edge-wide fields and every provider's row, ``size`` per loop turn, all of one config
    (see :func:`snapshot_in_slices`): ``first_slice(count)`` reads both for the first ``count``
    providers (None: all), ``read(first, count)`` the rows of the next. Checkpoints."""
    for _ in range(3):
        config = admission.config
        head, first_rows = first_slice(size)
        rows = list(first_rows)
        for first in range(size, len(config.providers), size):
            await trio.lowlevel.checkpoint()
            if admission.config is not config:
                break
            rows.extend(read(first, size))
        else:
            return head, rows
    head, all_rows = first_slice(None)
    return head, list(all_rows)
