"""A provider's health changes by one table [outlier-ejection] [health-probe].

``TRANSITIONS`` in ``_core/health.py`` lists every change of a provider's
:class:`ProviderHealth`; ``move`` is the only code that assigns one, and an event
the table does not list for the current state raises instead of changing
anything. The state machines (``test_health_machine.py``, ``test_state_machine.py``)
drive the core through these transitions; this file holds the table itself: its
entries, its refusals, its one writer and its copy in docs/admission.md.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from iop_admission import ProviderKey, ProviderSpec
from iop_admission._core.health import ADMITS, TRANSITIONS, HealthEvent, HealthTransitionError, move
from iop_admission._core.slots import NodeState, ProviderHealth, ProviderSlot

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "src" / "iop_admission"

pytestmark = pytest.mark.req("outlier-ejection", "health-probe")

ALL = [(state, event) for state in ProviderHealth for event in HealthEvent]
ALLOWED = [(state, event) for state, event in ALL if event in TRANSITIONS[state]]
REFUSED = [(state, event) for state, event in ALL if event not in TRANSITIONS[state]]


def _provider(health: ProviderHealth) -> ProviderSlot:
    slot = ProviderSlot(ProviderKey("node-a", "gpu0"), NodeState("node-a"), ProviderSpec(capacity=2))
    slot.health, slot.admitting = health, ADMITS[health]
    return slot


def _name(pair: tuple[ProviderHealth, HealthEvent]) -> str:
    return f"{pair[0].value}-{pair[1].value}"


@pytest.mark.parametrize("pair", ALLOWED, ids=_name)
def test_a_listed_event_leads_where_the_table_says_and_admitting_follows(pair):
    state, event = pair
    slot = _provider(state)
    move(slot, event)
    assert slot.health is TRANSITIONS[state][event]
    assert slot.admitting is ADMITS[slot.health]


@pytest.mark.parametrize("pair", REFUSED, ids=_name)
def test_an_unlisted_event_raises_and_changes_nothing(pair):
    state, event = pair
    slot = _provider(state)
    with pytest.raises(HealthTransitionError, match=f"from {state.value} on {event.value}"):
        move(slot, event)
    assert (slot.health, slot.admitting) == (state, ADMITS[state])


def test_the_table_covers_every_state_and_is_strict():
    """Each state has a row and some events it refuses; forgetting a provider resets any state."""
    assert set(TRANSITIONS) == set(ProviderHealth) == set(ADMITS)
    assert REFUSED, "a table that allows everything checks nothing"
    assert all(TRANSITIONS[state][HealthEvent.FORGET] is ProviderHealth.HEALTHY for state in ProviderHealth)
    assert [state for state in ProviderHealth if ADMITS[state]] == [ProviderHealth.HEALTHY, ProviderHealth.PROBE]


def test_every_state_is_reached_from_healthy():
    seen, frontier = {ProviderHealth.HEALTHY}, [ProviderHealth.HEALTHY]
    while frontier:
        for target in TRANSITIONS[frontier.pop()].values():
            if target not in seen:
                seen.add(target)
                frontier.append(target)
    assert seen == set(ProviderHealth)


def test_move_is_the_only_writer_of_a_providers_health():
    """Besides a new slot's start (``HEALTHY``), only ``move`` assigns ``.health`` in the library."""
    writers = [
        f"{path.relative_to(CORE)}: {line.strip()}"
        for path in sorted(CORE.rglob("*.py"))
        for line in path.read_text(encoding="utf-8").splitlines()
        if re.search(r"\.health(: ProviderHealth)? = ", line)
    ]
    assert writers == [
        "_core/health.py: p.health = health",
        "_core/slots.py: self.health: ProviderHealth = HEALTHY",
    ]


def test_docs_show_the_table():
    """docs/admission.md's table of health transitions is this one, row for row."""
    text = (ROOT / "docs" / "admission.md").read_text(encoding="utf-8")
    section = text.split("### Health transitions", 1)[1].split("\n#", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("|")]
    rows = [[cell.strip(" `") for cell in line.strip("|").split("|")] for line in table]
    header, _rule, *body = rows
    assert header[0] == "from \\ event" and header[1:] == [e.value for e in HealthEvent]
    documented = {ProviderHealth(row[0]): row[1:] for row in body}
    assert documented == {
        state: [TRANSITIONS[state][e].value if e in TRANSITIONS[state] else "—" for e in HealthEvent]
        for state in ProviderHealth
    }
