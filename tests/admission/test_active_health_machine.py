"""The core's state machine with the node's own health reports beside the failures of leases
([health-probe]): ``stalled``, ``not_ready`` and ``ready`` (recovered), fresh or stale.

The same machine as ``test_health_machine.py`` (:class:`HealthMachine`: the reference model and
its invariants after every step, the probe and panic paths of its fixed pool), plus a rule by
which a node reports one of its providers: ``stalled`` ejects a provider that is not ejected as
failures would (a growing time, then a probe); ``not_ready`` ejects it until a ``ready`` report,
or turns its ejection into one; ``ready`` ends such an ejection only; a reconnect ends it too
(the node's reports start over); a report of an older generation, or of a node that is offline,
changes nothing. The interactions it must reach, and their floors, are ``ACTIVE`` below;
docs/reliability.md states the counts.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule
from tests.admission.state_coverage import PROFILE, Coverage
from tests.admission.test_health_machine import ON_A, ON_B, VIAS, A, B, HealthMachine, M
from tests.admission.test_state_machine import EJECTED, KEYS, PROBE, PROBING, counted

from iop_admission import ProviderKey, ProviderReport
from iop_admission.core import Ejected, Restored

ACTIVE = Coverage(
    "active health",
    {
        "stalled ejects": 20,
        "stalled while its probe runs": 10,
        "not ready ejects until ready": 20,
        "not ready holds an ejection": 20,
        "ready ends the ejection": 20,
        "ready leaves an ejection for failures": 20,
        "a reconnect ends an ejection until ready": 20,
        "panic grants on a provider not ready": 10,
        "stale health reports": 20,
    },
)
_EXAMPLES, _STEPS = {"soak": (1_000, 60), "dev": (20, 20), "mutate": (30, 20)}.get(PROFILE, (100, 25))


class ActiveHealthMachine(HealthMachine):
    coverage = ACTIVE

    @rule(key=st.sampled_from(KEYS), state=st.sampled_from(("stalled", "not_ready", "ready")), stale=st.booleans())
    @counted
    def node_reports(self, key: object, state: str, stale: bool) -> None:
        """[health-probe] the node of ``key`` reports it; ``stale``: from its previous generation."""
        self.step_grants = []
        node = key.node_id  # type: ignore[attr-defined]
        generation = self.generation[node] - 1 if stale else self.generation[node]
        h = self.health[key]  # type: ignore[index]
        before = self.core.provider_snapshots(), list(self.core.waiters()), self.core.next_ejection_end()
        report = ProviderReport(state, f"{state} by the test", None, generation)
        decisions = self.core.report_health(key, report, self.now)  # type: ignore[arg-type]
        if stale or not self.connected[node] or key not in self.config.providers:
            self.fired("stale health reports")
            assert decisions == []
            assert (self.core.provider_snapshots(), list(self.core.waiters()), self.core.next_ejection_end()) == before
            return
        expect: type | None = None
        if state == "ready":
            if h.state == EJECTED and h.until == math.inf:
                self.restore(key)
                self.fired("ready ends the ejection")
                expect = Restored
            elif h.state == EJECTED:
                self.fired("ready leaves an ejection for failures")
        elif h.state == EJECTED:
            if state == "not_ready":
                h.until = math.inf
                self.fired("not ready holds an ejection")
        elif state == "stalled":
            if h.state == PROBING:
                self.fired("stalled while its probe runs")
            self.eject(key)
            self.fired("stalled ejects")
            expect = Ejected
        else:
            self.hold_out(key)
            self.fired("not ready ejects until ready")
            expect = Ejected
        snap = next(s for s in self.core.provider_snapshots() if (s.node_id, s.provider_id) == (node, key.provider_id))  # type: ignore[attr-defined]
        assert (snap.reported, snap.report_reason) == (state, f"{state} by the test")
        self.health_news(decisions, expect, key)  # type: ignore[arg-type]

    @initialize(data=st.data(), vias=st.permutations(VIAS))
    def start(self, data: st.DataObject, vias: list[str]) -> None:  # type: ignore[override]
        """The health machine's start, then each path of the rules below once: every example
        reaches each interaction, whatever the rules it draws next."""
        super().start(data, vias)
        self.not_ready_then(data, A, "ready", True)  # panic grants on A while not ready
        self.not_ready_then(data, B, "reconnect", False)
        self.not_ready_then(data, A, "ready", False)  # A online again: not ready ejects it until ready
        self.stalled_then_probed(A, False, True)
        self.stalled_then_probed(B, False, False)
        self.stalled_then_probed(A, False, False)

    @rule(
        data=st.data(),
        key=st.sampled_from((A, B)),
        end=st.sampled_from(("ready", "ready", "reconnect", "stalled")),
        other_stalled=st.booleans(),
    )
    @counted
    def not_ready_then(self, data: st.DataObject, key: ProviderKey, end: str, other_stalled: bool) -> None:
        """[health-probe] ``key`` reported not ready (a model loading), requests meanwhile -- with the
        other candidate stalled too, sometimes: panic mode -- then ready, a reconnect of its node, or
        a stall report (which leaves the ejection as it is)."""
        if not self.connected[key.node_id]:
            self.connect(key.node_id)
        self.node_reports(key, "not_ready", False)
        other = B if key == A else A
        if other_stalled and self.connected[other.node_id]:
            self.node_reports(other, "stalled", False)
        for _ in range(data.draw(st.integers(1, 3))):
            self.step_grants = []
            self.request_one(M, data.draw(st.booleans()))
        if end == "reconnect":
            self.connect(key.node_id)
        else:
            self.node_reports(key, end, False)

    @rule(key=st.sampled_from((A, B)), probe_ok=st.sampled_from((False, False, True)), restarted=st.booleans())
    @counted
    def stalled_then_probed(self, key: ProviderKey, probe_ok: bool, restarted: bool) -> None:
        """[health-probe] [outlier-ejection] ``key`` stalled (a stale report of it first, which changes
        nothing), then reported ready (the hung engine's probe answers: the ejection stays), its
        ejection time over, its probe granted (its leases released first while it is full), and either a second stall report while the probe runs
        (ejected again, for longer) or the probe's own report. ``restarted``: instead, the hung
        engine is restarted: not ready while its model loads (the ejection now waits for ready), then
        ready."""
        if not self.connected[key.node_id]:
            self.connect(key.node_id)
        self.node_reports(key, "stalled", True)
        self.node_reports(key, "stalled", False)
        if restarted:
            self.node_reports(key, "not_ready", False)
        self.node_reports(key, "ready", False)
        h = self.health[key]
        if h.state == EJECTED and h.until != math.inf:
            self.advance_time(h.until - self.now)
        if h.state == PROBE:
            self.step_grants = []
            self.request_one(ON_A if key == A else ON_B, False)
        while h.state == PROBE and (held := next((x for x in self.held if x.provider == key and not x.revoked), None)):
            self.step_grants = []
            self.release_lease(held)  # it was full: a release gives the probe to a waiter
        if h.state == PROBE:  # no waiter took it: a request does
            self.step_grants = []
            self.request_one(ON_A if key == A else ON_B, False)
        probe = next((x for x in self.held if x.id == h.probe), None) if h.state == PROBING else None
        if probe is None:
            return
        if probe_ok:
            self.report_lease(probe, ok=True)
        else:
            self.node_reports(key, "stalled", False)

    def restore_both(self) -> None:
        """As the health machine's, an ejection until ready ended first (by a ready report)."""
        for key in (A, B):
            h = self.health[key]
            if h.state == EJECTED and h.until == math.inf and self.connected[key.node_id]:
                self.node_reports(key, "ready", False)
        super().restore_both()

    def hold_out(self, key: object) -> None:
        """The reference of an ejection until a ``ready`` report: no end time, no probe before."""
        h = self.health[key]  # type: ignore[index]
        h.state, h.probe, h.until = EJECTED, None, math.inf
        h.epoch += 1
        self.probes[key] = 0  # type: ignore[index]
        self.figures["ejections"] += 1

    def take(self, seq: float, lease: object, candidates: tuple) -> None:  # type: ignore[override]
        key = lease.provider  # type: ignore[attr-defined]
        h = self.health[key]
        if h.state == EJECTED and h.until == math.inf:
            self.fired("panic grants on a provider not ready")
        super().take(seq, lease, candidates)  # type: ignore[arg-type]


@pytest.fixture(scope="module", autouse=True)
def _check_coverage() -> object:
    yield
    ACTIVE.check()


ActiveHealthMachine.TestCase.settings = settings(settings.default, max_examples=_EXAMPLES, stateful_step_count=_STEPS)
TestActiveHealthMachine = pytest.mark.req("health-probe", "outlier-ejection")(ActiveHealthMachine.TestCase)
