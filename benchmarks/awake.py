"""Keep the machine's CPUs out of deep idle while a latency is measured (Linux PM QoS).

A CPU with nothing to run goes idle; the deeper its idle state, the longer
it takes to run again when a timer or a packet wakes a task on it. On the
virtual machines these benchmarks run on, an idle CPU halts (the cpuidle
``haltpoll`` driver with no polling first) and its host may give the
physical core away meanwhile: a task woken on it can wait milliseconds. A
stream's inter-event gap through three processes (node, Edge, client) pays
that at each hop (docs/benchmarks.md, Scale, gives the figures).

While :func:`cpus_awake` is held, ``/dev/cpu_dma_latency`` asks for a wake-up
latency of 0 microseconds, so the kernel keeps idle CPUs polling instead of
halting -- what latency benchmarks do as a rule (tuned's
``latency-performance`` profile sets the same). It does not change what any
process may run, only how fast an idle CPU starts; the request ends when the
file is closed.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator

PM_QOS_FILE = "/dev/cpu_dma_latency"


@contextlib.contextmanager
def cpus_awake() -> Iterator[bool]:
    """Hold the CPUs out of deep idle for the ``with`` block; yields whether that could be asked
    (False: no such file here, or no permission to write it; the block runs anyway)."""
    try:
        fd = os.open(PM_QOS_FILE, os.O_WRONLY)
    except OSError:
        yield False
        return
    try:
        try:
            os.write(fd, struct.pack("=i", 0))
        except OSError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
