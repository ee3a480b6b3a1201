"""``python -m tests.system [--schedules N] [--seed S] [--length SECONDS] [--kinds K,...]``: ``make chaos``.

Runs ``N`` seeded schedules (seeds S, S+1, ...) of the whole-system check one after the other,
prints a line per schedule, saves each failing one under ``tests/system/results/`` (its seed
replays it; beside it, the folder of its processes' logs, the backends' executions and the
clients' attempts, to read the history from), and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
from pathlib import Path

import trio

from .nemesis import KINDS
from .run import keep_history, run_schedule, save_failure

RESULTS = Path(__file__).parent / "results"


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.system", description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--length", type=float, default=20.0, help="seconds of load per schedule")
    parser.add_argument("--kinds", default=",".join(KINDS), help="the faults to draw from, comma-separated")
    args = parser.parse_args()
    failed = 0
    for seed in range(args.seed, args.seed + args.schedules):
        with tempfile.TemporaryDirectory(prefix=f"iop-system-{seed}-") as folder:
            result = trio.run(
                functools.partial(
                    run_schedule, seed, Path(folder), length=args.length, kinds=tuple(args.kinds.split(","))
                )
            )
            if result.violations:
                keep_history(result, Path(folder), RESULTS / f"seed-{seed}")
        status = "ok" if not result.violations else f"FAILED ({len(result.violations)} violations)"
        print(
            f"seed {seed}: {status}; {len(result.faults)} faults, {len(result.attempts)} attempts, "
            f"{result.answered} answered, {result.executions} executions",
            flush=True,
        )
        if result.violations:
            failed += 1
            for line in result.violations[:10]:
                print(f"  {line}", flush=True)
            print(f"  saved: {save_failure(result, RESULTS)}", flush=True)
    print(f"{args.schedules - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
