"""The whole-system checker on histories built by hand: each promise holds on a good history and
catches its own breach (the control)."""

from __future__ import annotations

import pytest

from .checker import (
    Attempt,
    Execution,
    answered_once,
    at_most_once,
    refused_never_ran,
    violations,
    within_capacity,
)
from .terms import Stop, stepped_down_in_time, terms_of

pytestmark = pytest.mark.req("epoch-fencing", "ha-step-down")

CAPACITY = {"node-a/gpu0": 2, "node-b/gpu0": 2}


def run(marker: str, start: float, end: float, provider: str = "node-a/gpu0", outcome: str = "answered") -> Execution:
    return Execution(marker, provider, start, end, outcome)


def ok(marker: str) -> Attempt:
    return Attempt(marker, "edge-0", 0.0, 1.0, 200)


def test_a_good_history_breaks_no_promise() -> None:
    executions = [run("a", 0.0, 1.0), run("b", 0.5, 1.5), run("c", 1.0, 2.0), run("d", 0.0, 1.0, "node-b/gpu0")]
    attempts = [ok("a"), ok("b"), ok("c"), ok("d"), Attempt("e", "edge-1", 0.0, 0.1, 503, "not_leader")]
    assert violations(attempts, executions, CAPACITY) == []


def test_a_marker_run_twice_is_caught_even_if_its_node_was_lost_meanwhile() -> None:
    """A run failed over after its node was lost ran twice all the same (its node may have run it
    to its end): the Edge must not fail it over, and the checker excuses nothing."""
    twice = [run("a", 0.0, 1.0), run("a", 2.0, 3.0, "node-b/gpu0")]
    assert at_most_once(twice) == ["marker 'a' executed 2 times"]
    assert answered_once([ok("a")], twice) == ["marker 'a' answered 200 by edge-0 but executed 2 times"]
    assert violations([ok("a")], twice, CAPACITY) == [
        "marker 'a' executed 2 times",
        "marker 'a' answered 200 by edge-0 but executed 2 times",
    ]
    assert at_most_once(twice[:1]) == [] and answered_once([ok("a")], twice[:1]) == []


def test_a_200_never_executed_is_caught() -> None:
    assert answered_once([ok("a")], []) == ["marker 'a' answered 200 by edge-0 but executed 0 times"]


def test_a_refusal_before_the_run_must_not_have_run() -> None:
    refused = Attempt("a", "edge-1", 0.0, 0.1, 503, "not_leader")
    assert refused_never_ran([refused], [run("a", 0.0, 1.0)]) == [
        "marker 'a' refused 503 not_leader by edge-1 yet executed"
    ]
    assert refused_never_ran([refused], [run("b", 0.0, 1.0)]) == []
    cut = Attempt("a", "edge-1", 0.0, 0.1, 502, "node_disconnected")  # may have run: no promise
    assert refused_never_ran([cut], [run("a", 0.0, 1.0)]) == []


def test_capacity_is_checked_at_every_instant_per_provider() -> None:
    two = [run("a", 0.0, 2.0), run("b", 1.0, 3.0)]
    assert within_capacity(two, CAPACITY) == []
    three = [*two, run("c", 1.5, 1.6)]
    (found,) = within_capacity(three, CAPACITY)
    assert found.startswith("node-a/gpu0 ran 3 at once at 1.500")
    back_to_back = [*two, run("c", 2.0, 2.5)]  # "a" ends as "c" arrives: the slot was free
    assert within_capacity(back_to_back, CAPACITY) == []
    elsewhere = [*two, run("c", 1.5, 1.6, "node-b/gpu0")]
    assert within_capacity(elsewhere, CAPACITY) == []


def _log(*lines: tuple[float, str]) -> str:
    """An Edge's stderr: each line at ``seconds`` past 12:00:00 (local time, as the Edge logs)."""
    return "\n".join(f"2026-12-07 12:00:{at:06.3f}".replace(".", ",") + f" {text}" for at, text in lines) + "\n"


RENEWED = "DEBUG iop_edge.ha: renewed the lease of epoch 7 for 2 s"


def test_a_leader_that_steps_down_within_its_ttl_of_its_last_renewal_passes() -> None:
    log = _log(
        (1.0, "INFO iop_edge.ha: leading at epoch 7"),
        (1.6, RENEWED),
        (2.2, RENEWED),
        (3.9, "WARNING iop_edge.ha: stepped down (epoch 7)"),  # 1.7 s after its last renewal
        (4.5, "INFO iop_edge.ha: leading at epoch 9"),
        (5.0, RENEWED),
    )
    terms = terms_of("edge-0", log)
    assert [(t.epoch, len(t.alive), t.stepped_down) for t in terms] == [(7, 3, True), (9, 2, False)]
    assert stepped_down_in_time(terms, [], ttl=2.0) == []


def test_a_leader_that_steps_down_late_or_never_is_caught() -> None:
    late = _log(
        (1.0, "INFO iop_edge.ha: leading at epoch 7"),
        (1.5, RENEWED),
        (3.7, "WARNING iop_edge.ha: stepped down (epoch 7)"),
    )
    assert stepped_down_in_time(terms_of("edge-0", late), [], ttl=2.0) == [
        "edge-0 led epoch 7 2.200 s past a renewal (TTL 2 s) before it stepped down"
    ]
    never = _log((1.0, "INFO iop_edge.ha: leading at epoch 7"), (1.5, RENEWED), (4.0, "INFO iop_edge: serving"))
    assert stepped_down_in_time(terms_of("edge-0", never), [], ttl=2.0) == [
        "edge-0 led epoch 7 2.500 s past a renewal (TTL 2 s) before it went on"
    ]


def test_the_time_an_edge_was_stopped_does_not_count_against_its_step_down() -> None:
    """A leader stopped 3 s past its last renewal steps down 0.4 s after it wakes: 0.9 s of running
    time. The control: the same log without the stop, and a stop of another Edge, are late."""
    log = _log(
        (1.0, "INFO iop_edge.ha: leading at epoch 7"),
        (1.5, RENEWED),
        (5.4, "WARNING iop_edge.ha: stepped down (epoch 7)"),
    )
    terms = terms_of("edge-0", log)
    noon = terms[0].alive[0] - 1.0
    assert stepped_down_in_time(terms, [Stop("edge-0", noon + 2.0, noon + 5.0)], ttl=2.0) == []
    assert len(stepped_down_in_time(terms, [], ttl=2.0)) == 1
    assert len(stepped_down_in_time(terms, [Stop("edge-1", noon + 2.0, noon + 5.0)], ttl=2.0)) == 1
