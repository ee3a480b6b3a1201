"""The core's state machine on a pool built for the health paths: every probe's start that puts a
waiter in panic mode, by each of the four ways a probe is granted, counted and enforced.

The random pools of ``test_state_machine.py`` reach a probe's start with a waiter left in panic
mode almost never (it takes two providers ejected at once, a long slot taken, a long waiter
queued, then the last admitting candidate's probe granted). This machine is the same machine
(:class:`AdmissionMachine`: the same reference model and invariants after every step) on a fixed
pool -- ``ornith:35b`` on gpu A and gpu B, ``m2`` on A alone, ``m3`` on B alone, one failure
ejects -- whose random refreshes are left out, plus a rule that builds that moment and then
grants B's probe by one of the four ways: to a new request, to a retry, to a waiter a release
lets in, to a waiter a refresh lets in. The probes then report (a restore, or a second ejection
in a row). The interactions it must reach, and their floors, are ``HEALTH`` below;
docs/reliability.md states the counts.
"""

from __future__ import annotations

import collections

import attrs
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule
from tests.admission.state_coverage import PROFILE, Coverage
from tests.admission.test_state_machine import EJECTED, HEALTHY, KEYS, NODES, PROBE, AdmissionMachine, counted

from iop_admission import ModelGroup, OutlierPolicy, PoolConfig, ProviderSpec, QueuePolicy, RetryPolicy
from iop_admission.core import AdmissionState, Lease

A, B = KEYS[0], KEYS[2]
M, ON_A, ON_B = "ornith:35b", "m2", "m3"
VIAS = ("request", "retry", "waiter", "refresh")  # how B's probe is granted

HEALTH = Coverage(
    "health",
    {
        "panic grants a probe's start caused: request": 20,
        "panic grants a probe's start caused: retry": 20,
        "panic grants a probe's start caused: waiter": 20,
        "panic grants a probe's start caused: refresh": 20,
        "restores": 20,
        "repeated ejections": 20,
        "two ejections pending": 20,
    },
)
_EXAMPLES, _STEPS = {"soak": (1_000, 60), "dev": (20, 20), "mutate": (30, 20)}.get(PROFILE, (100, 20))


def _spec(capacity: int = 3) -> ProviderSpec:
    return ProviderSpec(
        capacity=capacity, long_context_capacity=1, context_window_tokens=1024, total_context_tokens=1024
    )


def health_pool(capacity: int = 3) -> PoolConfig:
    return PoolConfig(
        policy=QueuePolicy(max_queue=8, queue_timeout=10),
        providers={A: _spec(capacity), B: _spec(capacity)},
        models={M: ModelGroup((A, B)), ON_A: ModelGroup((A,)), ON_B: ModelGroup((B,))},
        retry=RetryPolicy(max_attempts=2),
        outlier=OutlierPolicy(consecutive_failures=1, base_ejection=1.0, max_ejection=4.0),
    )


class HealthMachine(AdmissionMachine):
    coverage = HEALTH
    steer = True

    def __init__(self) -> None:
        super().__init__()
        self.figures = collections.Counter()  # its own: the core machine's figures are the random pools'

    @initialize(data=st.data(), vias=st.permutations(VIAS))
    def start(self, data: st.DataObject, vias: list[str]) -> None:  # type: ignore[override]
        """The pool, both nodes connected, and the moment of the rule below by each way, in ``vias`` order."""
        self.config = health_pool()
        self.core = AdmissionState(self.config)
        for node in NODES:
            self.connect(node)
        for via in vias:
            self.probe_start_puts_a_waiter_in_panic(data, via)

    # The pool stays: these are plain methods here, not rules (the rules that call them still do).
    def refresh(self, config: PoolConfig, prepared: bool) -> None:  # type: ignore[override]
        AdmissionMachine.refresh(self, config, prepared)

    def prepare_refresh(self, data: st.DataObject) -> None:  # type: ignore[override]
        raise AssertionError("not a rule of this machine")

    def refresh_tweak(self, data: st.DataObject) -> None:  # type: ignore[override]
        AdmissionMachine.refresh_tweak(self, data)

    def remove_and_re_add(self, data: st.DataObject, prepared: bool) -> None:  # type: ignore[override]
        raise AssertionError("not a rule of this machine")

    def time_out_together(self, data: st.DataObject) -> None:  # type: ignore[override]
        raise AssertionError("not a rule of this machine")

    # ------------------------------------------------------------- the moment

    def lease_on(self, key: object, model: str, *, long: bool = False) -> Lease | None:
        return next(
            (
                lease
                for lease in self.held
                if lease.provider == key and lease.model == model and lease.long == long and not lease.revoked
            ),
            None,
        )

    def fail_until_ejected(self, key: object, model: str) -> None:
        """Failures of ``model``'s leases on ``key`` (a request first when none can report) until it is ejected."""
        for _ in range(3):
            if self.health[key].state != HEALTHY:  # type: ignore[index]
                return
            lease = next((x for x in self.held if x.provider == key and x.model == model and self.reportable(x)), None)
            if lease is None:
                self.step_grants = []
                self.request_one(model, False)
            else:
                self.report_lease(lease, ok=False)

    @precondition(lambda self: self.config.models.keys() == {M, ON_A, ON_B})
    @rule(data=st.data(), via=st.sampled_from(VIAS))
    @counted
    def probe_start_puts_a_waiter_in_panic(self, data: st.DataObject, via: str) -> None:
        """[outlier-ejection] [failover-before-first-byte] B's long slot taken (and, for a waiter or
        a refresh to grant B's probe, B full with a waiter of m3); A and B ejected, their time over;
        A's probe out; a long waiter of ornith:35b waits (B admits but has no long slot). Then B's
        probe goes to a new request, a retry, the m3 waiter after a release on B, or the m3 waiter
        after a refresh raises B's capacity: nothing admits, the long waiter is in panic mode and
        granted on A. Then the probes report."""
        for node in NODES:
            if not self.connected[node]:
                self.connect(node)
        self.step_grants = []
        for waiter in list(self.queued):  # a clean slate: nothing queued, nothing held
            assert self.core.withdraw(waiter)
            self.queued.remove(waiter)
        for lease in list(self.held):
            self.release_lease(lease)
        for key in (A, B):
            self.hold_runs(key, 0, 0)
        if self.config != health_pool():
            self.refresh(health_pool(), prepared=False)
        self.restore_both()
        first = None
        if via == "retry":
            self.request_one(M, False)
            first = next((x for x in self.held if x.model == M and x.tried == (A,) and x.id not in self.reported), None)
        if self.lease_on(B, ON_B, long=True) is None:
            self.request_one(ON_B, True)
        if via in ("waiter", "refresh"):
            for _ in range(4):  # B full, then one m3 waiter
                if any(w.model == ON_B for w in self.queued):
                    break
                self.request_one(ON_B, False)
        self.fail_until_ejected(A, ON_A)
        self.fail_until_ejected(B, ON_B)
        for lease in [x for x in self.held if x.provider == A and x.model == ON_A and x.id in self.reported]:
            self.release_lease(lease)
        ends = [self.health[k].until for k in (A, B) if self.health[k].state == EJECTED]
        if ends and max(ends) > self.now:
            self.advance_time(max(ends) - self.now)
        if self.health[A].state == PROBE:
            self.request_one(ON_A, False)
        self.request_one(M, True)
        self.grant_b_probe(data, via, first)
        for key in (A, B):
            probe = self.health[key].probe
            lease = next((x for x in self.held if x.id == probe), None)
            if lease is not None:
                self.report_lease(lease, ok=data.draw(st.booleans()))

    def restore_both(self) -> None:
        """Time to the end of A's and B's ejections, then a probe on each that succeeds: both healthy."""
        ends = [self.health[k].until for k in (A, B) if self.health[k].state == EJECTED]
        if ends and max(ends) > self.now:
            self.advance_time(max(ends) - self.now)
        for key, model in ((A, ON_A), (B, ON_B)):
            if self.health[key].state == PROBE:
                self.step_grants = []
                self.request_one(model, False)
                probe = next(x for x in self.held if x.id == self.health[key].probe)
                self.report_lease(probe, ok=True)
                self.release_lease(probe)

    def grant_b_probe(self, data: st.DataObject, via: str, first: Lease | None) -> None:
        self.step_grants = []
        if via == "request":
            self.request_one(M, False)
        elif via == "retry":
            if first is not None and first in self.held:
                self.retry_lease(first)
        elif via == "waiter":
            lease = self.lease_on(B, ON_B)
            if lease is not None:
                self.release_lease(lease)
        else:
            spec = self.config.providers[B]
            raised = attrs.evolve(spec, capacity=spec.capacity + 1)
            self.refresh(
                attrs.evolve(self.config, providers={**self.config.providers, B: raised}), data.draw(st.booleans())
            )

    @precondition(lambda self: self.config != health_pool())
    @rule(prepared=st.booleans())
    @counted
    def back_to_the_pool(self, prepared: bool) -> None:
        """The refresh of the last rule (B's capacity raised) undone."""
        self.refresh(health_pool(), prepared)


@pytest.fixture(scope="module", autouse=True)
def _check_coverage() -> object:
    yield
    HEALTH.check()


HealthMachine.TestCase.settings = settings(settings.default, max_examples=_EXAMPLES, stateful_step_count=_STEPS)
TestHealthMachine = pytest.mark.req("outlier-ejection", "failover-before-first-byte", "refresh-consistency")(
    HealthMachine.TestCase
)
