"""``python -m tests.sim --seeds N --first-seed S``: run seeds, print per-site counts, steps, violations.

Exit status 1 if any seed violated an invariant (each such seed is printed with
its violations; rerun it alone with ``--first-seed SEED --seeds 1 --trace``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from ._report import run_and_summarize


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sim", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200, help="number of seeds (default 200)")
    parser.add_argument("--first-seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--trace", action="store_true", help="print each seed's event trace")
    args = parser.parse_args(argv)
    logging.disable(logging.CRITICAL)  # the daemons log every drop; the summary says what matters
    started = time.perf_counter()
    summary = run_and_summarize(range(args.first_seed, args.first_seed + args.seeds), trace=args.trace, out=sys.stdout)
    print(f"wall time: {time.perf_counter() - started:.1f} s")
    return 1 if summary.failed_seeds else 0


if __name__ == "__main__":
    sys.exit(main())
