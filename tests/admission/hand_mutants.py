"""Apply each hand mutant of the catalogue alone and run the whole admission suite against it.

``make mutate-hand`` (docs/reliability.md): for each mutant of
``tests/admission/hand_mutant_catalogue.py``, a copy of ``src`` with that one change, then
``pytest -x tests/admission`` under ``HYPOTHESIS_PROFILE=mutate`` (a fixed seed, example tests
first: every run gives the same verdict). Prints the test that killed each mutant and its time;
exits 1 if one survives. Not part of ``make test`` (one pytest run per mutant).

``--profile ci`` runs the suite under the random-seed profile instead (``--runs N`` times each),
to see whether a kill depends on the seed; ``-k TEXT`` picks the mutants whose name has TEXT.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.admission.hand_mutant_catalogue import MUTANTS, HandMutant

ROOT = Path(__file__).resolve().parents[2]


def apply(mutant: HandMutant, scratch: Path) -> Path:
    """A copy of ``src`` under ``scratch`` with ``mutant`` applied; its path."""
    src = scratch / "src"
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    target = scratch / mutant.path
    text = target.read_text(encoding="utf-8")
    if text.count(mutant.old) != 1:
        raise SystemExit(f"{mutant.name}: {mutant.path} no longer has exactly one {mutant.old!r}")
    target.write_text(text.replace(mutant.old, mutant.new), encoding="utf-8")
    return src


def run(mutant: HandMutant, scratch: Path, profile: str) -> str | None:
    """The first test that fails with ``mutant`` applied, or None if it survives."""
    src = apply(mutant, scratch)
    env = dict(os.environ, PYTHONPATH=str(src), PYTHONDONTWRITEBYTECODE="1", HYPOTHESIS_PROFILE=profile)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "tests/admission"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode == 0:
        return None
    failed = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return failed[0].split(" - ")[0].split(" ", 1)[1] if failed else f"pytest exit code {done.returncode}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="mutate", help="HYPOTHESIS_PROFILE of the runs (default: mutate)")
    parser.add_argument("--runs", type=int, default=1, help="runs of the suite per mutant (default 1)")
    parser.add_argument("-k", dest="only", default="", help="only the mutants whose name contains this")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if args.only in m.name]
    survivors = 0
    with tempfile.TemporaryDirectory(prefix="hand-mutants-") as tmp:
        for mutant in chosen:
            for attempt in range(1, args.runs + 1):
                started = time.monotonic()
                killer = run(mutant, Path(tmp), args.profile)
                survivors += killer is None
                verdict = "SURVIVED" if killer is None else f"killed by {killer}"
                took = time.monotonic() - started
                print(f"[{mutant.kind}] {mutant.name} (run {attempt}, {took:.0f} s): {verdict}", flush=True)
    print(f"{len(chosen)} mutants x {args.runs} runs, {survivors} survived", flush=True)
    return 1 if survivors else 0


if __name__ == "__main__":
    raise SystemExit(main())
