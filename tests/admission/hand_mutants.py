"""Issue 32's hand mutants of the health and retry code, each applied alone, against the example tests.

``make mutate-hand`` (docs/reliability.md): for each mutant, a copy of ``src`` with that one
change, then ``pytest -x`` over every test module of ``tests/admission`` that uses no
Hypothesis, so a kill does not depend on a seed. Prints the test that killed each
mutant; exits 1 if one survives. Not part of ``make test`` (one pytest run per mutant).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
CORE = "src/iop_admission/"


class HandMutant(NamedTuple):
    name: str
    path: str
    old: str
    new: str


MUTANTS = (
    HandMutant(
        "the ejection threshold off by one",
        CORE + "_health.py",
        "if limit and p.failures >= limit:",
        "if limit and p.failures > limit:",
    ),
    HandMutant(
        "a success does not reset the failure count",
        CORE + "_health.py",
        "        p.failures = 0\n        if p.health is HEALTHY:\n",
        "        if p.health is HEALTHY:\n",
    ),
    HandMutant(
        "panic mode when some (not all) candidates are ejected: the choice index",
        CORE + "_slots.py",
        "return self.eligible > 0 and self.admitting == 0",
        "return self.eligible > 0 and self.admitting < self.eligible",
    ),
    HandMutant(
        "panic mode when some (not all) candidates are ejected: a retry's scan",
        CORE + "_choice.py",
        "        if p.admitting:\n            return False\n        found = True\n",
        "        if not p.admitting:\n            found = True\n",
    ),
    HandMutant(
        "one attempt too many",
        CORE + "_state.py",
        "if lease.attempt >= self._config.retry.max_attempts:",
        "if lease.attempt > self._config.retry.max_attempts:",
    ),
    HandMutant(
        "a report from a fenced older generation counted",
        CORE + "_health.py",
        "if p.epoch != lease._epoch or p.node.generation != lease.generation:",
        "if p.epoch != lease._epoch:",
    ),
    HandMutant(
        "the probe grant does not close the provider to normal grants",
        CORE + "_core.py",
        "            p.health = PROBING\n            p.admitting = False\n",
        "            p.health = PROBING\n",
    ),
    HandMutant(
        "a queued retry goes to the tail of the waiter order",
        CORE + "_core.py",
        "if not waiters or next(reversed(waiters)) < waiter.seq:",
        "if True:",
    ),
    HandMutant(
        "a refresh forgets which providers a queued retry tried",
        CORE + "_refresh.py",
        "w._candidates = untried(group.providers, w.tried)",
        "w._candidates = group.providers",
    ),
)


def example_test_modules() -> list[str]:
    """The test modules of tests/admission with no Hypothesis (their verdict is the same every run)."""
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests/admission").glob("test_*.py")
        if "hypothesis" not in p.read_text(encoding="utf-8")
    )


def run(mutant: HandMutant, tests: list[str], scratch: Path) -> str | None:
    """The first test that fails with ``mutant`` applied, or None if it survives."""
    src = scratch / "src"
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    target = scratch / mutant.path
    text = target.read_text(encoding="utf-8")
    if text.count(mutant.old) != 1:
        raise SystemExit(f"{mutant.name}: {mutant.path} no longer has exactly one {mutant.old!r}")
    target.write_text(text.replace(mutant.old, mutant.new), encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(src), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    failed = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    if done.returncode == 0:
        return None
    return failed[0].split(" - ")[0].split(" ", 1)[1] if failed else f"pytest exit code {done.returncode}"


def main() -> int:
    tests = example_test_modules()
    survivors = 0
    with tempfile.TemporaryDirectory(prefix="hand-mutants-") as tmp:
        for mutant in MUTANTS:
            killer = run(mutant, tests, Path(tmp))
            survivors += killer is None
            print(f"{mutant.name}: {'SURVIVED' if killer is None else 'killed by ' + killer}", flush=True)
    return 1 if survivors else 0


if __name__ == "__main__":
    raise SystemExit(main())
