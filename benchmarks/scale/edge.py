"""The Edge as the scale benchmark runs it (``python -m benchmarks.scale edge``): ``iop-edge`` with its loop
and its full garbage collections traced to stderr (:class:`LoopTracer`, :class:`GcClock`), read back by
:mod:`benchmarks.scale_logs`."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time

import trio


class GcClock:
    """Seconds spent in full (generation 2) garbage collections, through ``gc.callbacks``."""

    def __init__(self, write_over: float | None = None) -> None:
        self.write_over = write_over
        """Write each collection (any generation) longer than this many seconds to stderr:
        ``bench-gc: END MS GENERATION`` (END as :class:`LoopTracer`'s)."""
        self.seconds = 0.0
        self.longest = 0.0
        self.count = 0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        took = time.perf_counter() - self._start
        if self.write_over is not None and took > self.write_over:
            print(f"bench-gc: {time.monotonic():.4f} {took * 1000:.2f} {info['generation']}", file=sys.stderr)
        if info["generation"] == 2:
            self.seconds += took
            self.longest = max(self.longest, took)
            self.count += 1


class LoopTracer(trio.abc.Instrument):
    """Writes each long hold of the Edge's loop to stderr: ``bench-loop: END MS STEPS LONGEST_MS TASK CPU_MS``.

    A *batch* is what the loop does between two waits for I/O: every task step
    that was ready. While a batch runs, no stream event is read or written, so
    a stream's inter-event gap is at least its longest batch. END is the
    batch's end (``time.monotonic()``, comparable across processes), MS its
    length, STEPS how many task steps it ran, LONGEST_MS the longest of them
    and TASK that step's task. A wait for I/O that overran its timeout by more
    than :attr:`threshold` (the loop thread waited for the GIL after
    ``epoll_wait``) is written as a batch of 0 steps, TASK ``io-wait``. CPU_MS
    is the CPU time the loop thread used in the batch: the rest of MS it
    waited, for the GIL or for a CPU.

    Every :attr:`period` it also writes ``bench-loopsum: END SECONDS BUSY_MS
    IN_STEPS_MS STEPS CPU_MS RUNQ_MS``: over the last SECONDS, the time in
    batches, in task steps, the steps, the loop thread's CPU time and its time
    runnable but waiting for a CPU (``/proc``'s ``schedstat``): BUSY_MS minus
    CPU_MS minus RUNQ_MS is, roughly, the time the loop waited for the GIL.
    """

    def __init__(self, threshold: float = 0.005, period: float = 0.1) -> None:
        self.threshold = threshold
        self.period = period
        self._batch = self._step = self._io = self._since = time.monotonic()
        self._steps = 0
        self._longest = (0.0, "")
        self._timeout = 0.0
        self._busy = self._in_steps = 0.0
        self._all_steps = 0
        self._cpu = self._since_cpu = time.thread_time()
        try:
            self._schedstat: int | None = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
        except OSError:
            self._schedstat = None
        self._since_runq = self._runq()

    def _runq(self) -> float:
        """Seconds the loop thread has been runnable but not running, so far (0.0 without ``/proc``)."""
        if self._schedstat is None:
            return 0.0
        return int(os.pread(self._schedstat, 100, 0).split()[1]) / 1e9

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._step = time.monotonic()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        took = time.monotonic() - self._step
        self._steps += 1
        self._in_steps += took
        if took > self._longest[0]:
            self._longest = (took, task.name)

    def before_io_wait(self, timeout: float) -> None:
        now, cpu = time.monotonic(), time.thread_time()
        if now - self._batch > self.threshold:
            self._write(now, now - self._batch, self._steps, *self._longest, cpu - self._cpu)
        self._busy += now - self._batch
        self._all_steps += self._steps
        if now - self._since >= self.period:
            runq = self._runq()
            print(
                f"bench-loopsum: {now:.4f} {now - self._since:.4f} {self._busy * 1000:.2f} "
                f"{self._in_steps * 1000:.2f} {self._all_steps} {(cpu - self._since_cpu) * 1000:.2f} "
                f"{(runq - self._since_runq) * 1000:.2f}",
                file=sys.stderr,
            )
            self._since, self._busy, self._in_steps, self._all_steps = now, 0.0, 0.0, 0
            self._since_cpu, self._since_runq = cpu, runq
        self._io, self._timeout = now, timeout

    def after_io_wait(self, timeout: float) -> None:
        now = time.monotonic()
        if now - self._io - self._timeout > self.threshold:
            self._write(now, now - self._io - self._timeout, 0, 0.0, "io-wait", 0.0)
        self._batch, self._steps, self._longest, self._cpu = now, 0, (0.0, ""), time.thread_time()

    @staticmethod
    def _write(end: float, took: float, steps: int, longest: float, task: str, cpu: float) -> None:
        print(
            f"bench-loop: {end:.4f} {took * 1000:.2f} {steps} {longest * 1000:.2f} {task} {cpu * 1000:.2f}",
            file=sys.stderr,
        )


def main(argv: list[str]) -> None:
    """``iop-edge`` with its full garbage collections timed, written to stderr every 0.5 s, and its
    loop's long holds (:class:`LoopTracer`)."""
    from iop_edge.__main__ import main as edge_main

    clock = GcClock(write_over=0.005)

    def report() -> None:
        while True:
            time.sleep(0.5)
            print(f"bench-gc2: {clock.count} {clock.seconds:.4f} {clock.longest:.4f}", file=sys.stderr, flush=True)

    threading.Thread(target=report, daemon=True).start()

    edge_main(argv, instruments=[LoopTracer()])
