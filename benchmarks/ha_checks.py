"""HA's per-request checks on the Edge, in one process: ``python -m benchmarks.ha_checks [--rounds 8]``.

What a request's path does with ``ha:`` and without it, the rest of the path
left out: the entry check (:meth:`iop_edge.ha.EdgeHa.admits`), the term's
cancel scope (:meth:`~iop_edge.ha.EdgeHa.cut_on_step_down`, an ``ExitStack``
either way, as ``iop_edge.api.app`` enters it), the epoch stamped on the run
(:meth:`~iop_edge.ha.fencing.LeaderFence.stamp`) and checked again as frames
leave (:meth:`~iop_edge.ha.fencing.LeaderFence.may_send`, twice). Alternated
rounds of ``--calls`` each; the best round of each, µs per request, and the
difference: what ``benchmarks/ha.py``'s CPU per request can attribute to
these checks (docs/benchmarks.md, High availability).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable

import trio

from iop_edge.config import HaConfig
from iop_edge.ha import EdgeHa
from iop_edge.ha.fencing import LeaderFence


def _paths() -> dict[str, Callable[[], None]]:
    ha = EdgeHa.of(HaConfig(endpoints=("http://127.0.0.1:2379",), advertise="bench"))
    ha.leadership.won(7, trio.current_time() + 1e9)  # leads for the whole benchmark
    leading, plain = LeaderFence(epoch=7, leads=ha.admits), LeaderFence()

    def with_ha() -> None:
        if not ha.admits():
            raise AssertionError("the benchmark's Edge leads")
        term = trio.CancelScope()
        with contextlib.ExitStack() as stack:
            stack.enter_context(ha.cut_on_step_down(term))
            with term:
                leading.stamp()
                leading.may_send()
                leading.may_send()

    def without() -> None:
        term = trio.CancelScope()
        with contextlib.ExitStack():
            with term:
                plain.stamp()
                plain.may_send()
                plain.may_send()

    return {"no_ha": without, "ha": with_ha}


async def _measure(rounds: int, calls: int) -> dict[str, float]:
    best: dict[str, float] = {}
    paths = _paths()
    for _ in range(rounds):
        for name, path in paths.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                path()
            best[name] = min(best.get(name, float("inf")), (time.perf_counter() - t0) / calls * 1e6)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ha_checks", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--calls", type=int, default=200_000, help="requests' checks per round")
    args = parser.parse_args(argv)
    best = trio.run(_measure, args.rounds, args.calls)
    print(f"per request, best of {args.rounds} rounds of {args.calls}:", end="")
    print(f" no_ha {best['no_ha']:.2f} µs, ha {best['ha']:.2f} µs, ha adds {best['ha'] - best['no_ha']:.2f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
