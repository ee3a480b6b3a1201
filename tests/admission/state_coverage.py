"""State coverage as a measured, enforced property of the admission machines (issue 44).

Each machine names the interactions the docs promise (the states where its invariants would
fire: a probe's start putting waiters in panic mode, restores, repeated ejections, band moves
with non-zero virtual time, ...), counts them with Hypothesis ``event()`` in every step that
reaches one, and steers its generation towards them with ``target()`` (the interactions an
example reached). At the end of its module the machine checks the counts against their floors:
under the ``ci`` and ``soak`` profiles a count below its floor fails the run (the ``mutate`` and
``dev`` profiles run too few examples for the floors). The tables of every machine that ran are
printed in the test output's summary (``tests/admission/conftest.py``).
"""

from __future__ import annotations

import collections
import os

from hypothesis import event
from hypothesis.errors import InvalidArgument

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
ENFORCED = PROFILE in ("ci", "soak")
MACHINES: list[Coverage] = []  # every machine's coverage, in import order


class Coverage:
    """The named interactions of one machine: their floors and what the runs of this process reached."""

    def __init__(self, machine: str, floors: dict[str, int]) -> None:
        self.machine = machine
        self.floors = floors
        self.counts: collections.Counter[str] = collections.Counter()
        self.examples = 0
        MACHINES.append(self)

    def hit(self, name: str) -> None:
        """One occurrence of the interaction ``name`` (a Hypothesis event and a count)."""
        assert name in self.floors, f"{name!r} is not a named interaction of the {self.machine} machine"
        try:
            event(name)
        except InvalidArgument:  # a machine driven by hand, outside a Hypothesis test: counted only
            pass
        self.counts[name] += 1

    def table(self) -> str:
        width = max(map(len, self.floors))
        lines = [f"state coverage of the {self.machine} machine ({PROFILE} profile, {self.examples} examples):"]
        lines.append(f"  {'interaction':{width}}  {'count':>7}  {'floor':>5}")
        for name, floor in self.floors.items():
            mark = "" if self.counts[name] >= floor else "  BELOW FLOOR"
            lines.append(f"  {name:{width}}  {self.counts[name]:7}  {floor:5}{mark}")
        return "\n".join(lines)

    def below(self) -> list[str]:
        return [name for name, floor in self.floors.items() if self.counts[name] < floor]

    def check(self) -> None:
        """Under ``ci`` and ``soak``, fail if an interaction is below its floor (the table in the message).

        Does nothing when the machine did not run in this process (a selection left it out)."""
        if self.examples and ENFORCED:
            below = self.below()
            assert not below, f"below the floor: {', '.join(below)}\n{self.table()}"


def tables() -> list[str]:
    """The table of every machine that ran in this process."""
    return [coverage.table() for coverage in MACHINES if coverage.examples]
