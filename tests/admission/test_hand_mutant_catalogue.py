"""The hand mutant catalogue stays applicable: each mutant's text is in its file exactly once.

``make mutate-hand`` runs the mutants (one suite run each, not part of ``make test``); this
cheap check fails as soon as a change to ``src`` leaves a mutant with nothing to replace, so the
catalogue is brought along with the code instead of rotting.
"""

from __future__ import annotations

import pytest
from tests.admission.hand_mutant_catalogue import MUTANTS, HandMutant
from tests.admission.hand_mutants import ROOT


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_each_hand_mutant_changes_exactly_one_place(mutant: HandMutant) -> None:
    text = (ROOT / mutant.path).read_text(encoding="utf-8")
    assert text.count(mutant.old) == 1, f"{mutant.path} no longer has exactly one {mutant.old!r}"
    assert mutant.new != mutant.old


def test_the_catalogue_holds_every_kind_and_unique_names() -> None:
    kinds = {m.kind for m in MUTANTS}
    assert {"skipped call", "swapped order", "guard copied from a sibling", "timer not re-armed"} <= kinds
    assert "event for one of many" in kinds
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)
