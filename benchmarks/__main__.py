"""Run the benchmarks: ``python -m benchmarks [admission] [e2e] [overload] [fleet] [scale] [config_scale] [reload_load] [ui] [deadline] [ejection] [--runs N] [--peers] [--quick]``.

Prints a table per benchmark and writes JSON to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time

from . import admission, config_scale, deadline, e2e, fleet, health, overload, reload_load, scale, ui

RESULTS = pathlib.Path(__file__).parent / "results"
SUITES = {
    "admission": admission,
    "e2e": e2e,
    "overload": overload,
    "fleet": fleet,
    "scale": scale,
    "config_scale": config_scale,
    "reload_load": reload_load,
    "ui": ui,
    "deadline": deadline,
    "ejection": health,
}
EJECTION_TRIALS = 5  # each of a hung engine and a dead process, per gateway: ~3 minutes with --peers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("suites", nargs="*", help=f"any of {', '.join(SUITES)} (default: all)")
    parser.add_argument("--runs", type=int, default=5, help="runs per figure (median)")
    parser.add_argument(
        "--peers",
        action="store_true",
        help="e2e, fleet, deadline, ejection: also measure a LiteLLM proxy (installed on first use into benchmarks/.peers)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="overload: two short scenarios; fleet: K = 64 and 512 only; scale (both wire versions), config_scale: "
        "1,000 nodes only (for iteration)",
    )
    args = parser.parse_args(argv)
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        parser.error(f"unknown suite(s) {', '.join(unknown)}; choose from {', '.join(SUITES)}")
    RESULTS.mkdir(exist_ok=True)
    for name in args.suites or list(SUITES):
        suite = SUITES[name]
        print(f"== {name} (median of {args.runs} runs) ...", file=sys.stderr, flush=True)
        if suite is e2e:
            result = e2e.run(runs=args.runs, with_peers=args.peers)
        elif suite is overload:
            result = overload.run(quick=args.quick)
        elif suite is fleet:
            result = fleet.run(quick=args.quick, with_peers=args.peers)
        elif suite is scale:
            result = scale.run(sizes=(1_000,) if args.quick else scale.SIZES)
        elif suite is deadline:
            result = deadline.run(with_peers=args.peers)
        elif suite is health:
            result = health.run(trials=EJECTION_TRIALS, with_peers=args.peers)
        elif suite in (config_scale, reload_load):
            result = suite.run(nodes=1_000 if args.quick else config_scale.NODES)
        else:
            result = suite.run(runs=args.runs)
        result["python"] = platform.python_version()
        result["machine"] = platform.machine()
        result["when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        print(suite.table(result))
        print(f"(JSON: {RESULTS / (name + '.json')})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
