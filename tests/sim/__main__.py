"""``python -m tests.sim --seeds N --first-seed S``: run seeds, print per-site counts, steps, violations.

``--ha`` runs the HA world instead (:mod:`tests.sim._ha`: Edge replicas, an
election, leader step-downs, pauses and etcd partitions); ``--tenants`` the
tenant world (:mod:`tests.sim._tenants`: floods, an idle tenant returning,
token-cost skew, the fairness and quota checks); ``--health`` the health world
(:mod:`tests.sim._health`: the Nodes' health watchers on, a hung backend whose
probe passes, a slow-loading one).

Exit status 1 if any seed violated an invariant (each such seed is printed with
its violations; rerun it alone with ``--first-seed SEED --seeds 1 --trace``).
``--out FILE`` also writes the summary (the command, its table, the wall time)
to ``FILE``: the figures of a run live there, not in the docs. ``--json`` prints
one JSON object per seed instead (seed, trace hash, trace, outcomes, outside
wakeups): the replay test reads it from a fresh process.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys
import time

from ._fleet import run_fleet
from ._ha import ha_summary, run_ha_seed
from ._health import health_summary, run_health_seed
from ._report import run_and_summarize
from ._tenants import run_tenant_seed, tenant_summary
from ._world import run_seed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sim", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200, help="number of seeds (default 200)")
    parser.add_argument("--first-seed", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--trace", action="store_true", help="print each seed's event trace")
    parser.add_argument("--out", type=pathlib.Path, help="also write the summary to this file")
    parser.add_argument("--fleet", type=int, default=0, help="run the fleet profile with this many nodes instead")
    parser.add_argument("--waves", type=int, default=3, help="fleet profile: mass drops per seed (default 3)")
    parser.add_argument("--ha", action="store_true", help="run the HA world: Edge replicas, election faults")
    parser.add_argument("--tenants", action="store_true", help="run the tenant world: floods, idle returns, token skew")
    parser.add_argument(
        "--health", action="store_true", help="run the health world: a hung backend, a slow-loading one"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per seed, no summary")
    args = parser.parse_args(argv)
    logging.disable(logging.CRITICAL)  # the daemons log every drop; the summary says what matters
    if args.json:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            run = (
                run_ha_seed
                if args.ha
                else run_tenant_seed
                if args.tenants
                else run_health_seed
                if args.health
                else run_seed
            )
            result = run(seed)
            fields = {"seed": seed, "trace_hash": result.trace_hash, "trace": result.trace}
            fields |= {"outcomes": dict(result.outcomes), "outside_wakeups": result.outside_wakeups}
            print(json.dumps(fields), flush=True)
        return 0
    started = time.perf_counter()
    if args.fleet:
        failed = 0
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            result = run_fleet(args.fleet, args.waves, seed)
            failed += bool(result.violations)
            print(
                f"fleet seed {seed}: {args.fleet} nodes, {args.waves} waves, {result.registrations} registrations, "
                f"busiest 100 ms window {result.busiest_window:.1%}, violations {result.violations[:5]}"
            )
        print(f"wall time: {time.perf_counter() - started:.1f} s")
        return 1 if failed else 0
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    if args.ha:
        summary = run_and_summarize(seeds, trace=args.trace, out=sys.stdout, run=run_ha_seed, summary=ha_summary())
    elif args.tenants:
        summary = run_and_summarize(
            seeds, trace=args.trace, out=sys.stdout, run=run_tenant_seed, summary=tenant_summary()
        )
    elif args.health:
        summary = run_and_summarize(
            seeds, trace=args.trace, out=sys.stdout, run=run_health_seed, summary=health_summary()
        )
    else:
        summary = run_and_summarize(seeds, trace=args.trace, out=sys.stdout)
    wall = f"wall time: {time.perf_counter() - started:.1f} s"
    print(wall)
    if args.out is not None:
        command = " ".join(["python -m tests.sim", *(argv if argv is not None else sys.argv[1:])])
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(f"{command}\n\n{summary.render()}\n{wall}\n", encoding="utf-8")
    return 1 if summary.failed_seeds else 0


if __name__ == "__main__":
    sys.exit(main())
