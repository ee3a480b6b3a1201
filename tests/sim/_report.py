"""Run many seeds and summarize: faults fired per site, steps, outcomes, violations."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TextIO

import attrs

from ._world import SITES, SeedResult, run_seed


@attrs.define(eq=False)
class Summary:
    """Totals over a range of seeds."""

    seeds: int = 0
    steps: int = 0
    requests: int = 0
    virtual_time: float = 0.0
    enabled: Counter[str] = attrs.field(factory=Counter)
    fired: Counter[str] = attrs.field(factory=Counter)
    outcomes: Counter[str] = attrs.field(factory=Counter)
    failed_seeds: list[SeedResult] = attrs.field(factory=list)
    sites: Sequence[str] = SITES
    extra: Sequence[str] = ()
    """Counters of :attr:`SeedResult.fired` printed after the table (the HA world's)."""

    def add(self, result: SeedResult) -> None:
        self.seeds += 1
        self.steps += result.steps
        self.requests += result.requests
        self.virtual_time += result.virtual_time
        self.enabled.update(result.enabled)
        self.fired.update(result.fired)
        self.outcomes.update(result.outcomes)
        if result.violations:
            self.failed_seeds.append(result)

    def render(self) -> str:
        lines = [
            f"seeds: {self.seeds}  steps: {self.steps}  requests: {self.requests}  "
            f"virtual time: {self.virtual_time:.0f} s  violations: {sum(len(r.violations) for r in self.failed_seeds)}",
            "fault site                      enabled-in  fired",
        ]
        for site in self.sites:
            lines.append(f"  {site:<30}{self.enabled[site]:>10}{self.fired[site]:>7}")
        lines.append("request outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items())))
        lines.append(
            f"requests retried: {self.fired['retried']}  steps with an ejected provider: "
            f"{self.fired['ejected provider seen']}"
        )
        if self.extra:
            lines.append(", ".join(f"{name}: {self.fired[name]}" for name in self.extra))
        for result in self.failed_seeds:
            lines.append(f"FAILED seed {result.seed} (faults enabled: {', '.join(result.enabled) or 'none'}):")
            lines.extend(f"  {v}" for v in result.violations)
        return "\n".join(lines)


def run_and_summarize(
    seeds: Iterable[int],
    *,
    trace: bool = False,
    out: TextIO | None = None,
    run: Callable[[int], SeedResult] = run_seed,
    summary: Summary | None = None,
) -> Summary:
    """Run ``seeds`` with ``run`` (one-Edge by default; :func:`tests.sim._ha.run_ha_seed` for replicas)."""
    summary = summary if summary is not None else Summary()
    for seed in seeds:
        result = run(seed)
        summary.add(result)
        if trace and out is not None:
            print(f"--- seed {seed} trace (hash {result.trace_hash})", file=out)
            print("\n".join(result.trace), file=out)
        if result.violations and out is not None:
            print(
                f"seed {seed}: {len(result.violations)} violations (rerun with --first-seed {seed} --seeds 1 --trace)",
                file=out,
                flush=True,
            )
    if out is not None:
        print(summary.render(), file=out)
    return summary
