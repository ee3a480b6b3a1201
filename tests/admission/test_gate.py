"""LocalGate: the Node's reject-at-once concurrency gate.

[tunnel-guard] [runtime-concurrency]
"""

from __future__ import annotations

import pytest
import trio

from iop_admission import ConcurrencyLimitExceeded, ConfigError, GateStatistics, LocalGate


def _drained(gate: LocalGate) -> None:
    """The gate's drain check: no permit held anywhere."""
    stats = gate.statistics()
    assert stats.total_in_use == 0 and set(stats.in_use.values()) <= {0}


@pytest.mark.req("tunnel-guard")
def test_per_name_limit_rejects_at_once():
    """[tunnel-guard] a second request on a capacity-1 provider is rejected with scope
    "provider"; another provider is unaffected."""
    gate = LocalGate(limits={"gpu0": 1, "gpu1": 2})
    with gate.try_acquire("gpu0") as permit:
        assert permit.held and permit.name == "gpu0"
        with pytest.raises(ConcurrencyLimitExceeded) as info:
            gate.try_acquire("gpu0")
        assert (info.value.name, info.value.scope, info.value.limit) == ("gpu0", "provider", 1)
        with gate.try_acquire("gpu1"), gate.try_acquire("gpu1"), pytest.raises(ConcurrencyLimitExceeded):
            gate.try_acquire("gpu1")
    assert not permit.held
    with gate.try_acquire("gpu0"):  # freed
        pass
    _drained(gate)


@pytest.mark.req("runtime-concurrency")
def test_global_limit_rejects_with_global_scope():
    """[runtime-concurrency] the node-wide limit applies across names, scope "global"."""
    gate = LocalGate(limits={"gpu0": 2, "gpu1": 2}, global_limit=3)
    permits = [gate.try_acquire("gpu0"), gate.try_acquire("gpu1"), gate.try_acquire("gpu1")]
    with pytest.raises(ConcurrencyLimitExceeded) as info:
        gate.try_acquire("gpu0")  # gpu0 has room, the node does not
    assert (info.value.scope, info.value.limit) == ("global", 3)
    # A full provider reports its own limit first.
    with pytest.raises(ConcurrencyLimitExceeded) as info:
        gate.try_acquire("gpu1")
    assert info.value.scope == "provider"
    for p in permits:
        p.release()
    _drained(gate)


@pytest.mark.req("runtime-concurrency")
def test_release_is_idempotent_and_statistics():
    """[runtime-concurrency] a permit is returned exactly once; statistics count holders and
    rejections."""
    gate = LocalGate(limits={"gpu0": 1}, global_limit=4)
    permit = gate.try_acquire("gpu0")
    with pytest.raises(ConcurrencyLimitExceeded):
        gate.try_acquire("gpu0")
    stats = gate.statistics()
    assert stats == GateStatistics(in_use={"gpu0": 1}, limits={"gpu0": 1}, total_in_use=1, global_limit=4, rejected=1)
    permit.release()
    permit.release()
    with permit:  # leaving a with block after release is a no-op too
        pass
    stats = gate.statistics()
    assert (stats.in_use["gpu0"], stats.total_in_use, stats.rejected) == (0, 0, 1)
    assert "gpu0 0/1" in repr(gate)
    _drained(gate)


@pytest.mark.req("tunnel-guard")
def test_unknown_name_is_key_error():
    """[tunnel-guard] a name without a configured limit is a KeyError, not a rejection."""
    gate = LocalGate(limits={"gpu0": 1})
    with pytest.raises(KeyError, match="gpu9"):
        gate.try_acquire("gpu9")
    assert gate.statistics().rejected == 0
    _drained(gate)


@pytest.mark.req("runtime-concurrency")
@pytest.mark.parametrize(
    ("limits", "global_limit", "count"),
    [
        ({"gpu0": 0}, None, 1),
        ({"gpu0": True}, None, 1),
        ({"gpu0": 1.5, "gpu1": -1}, 0, 3),
        ({"gpu0": 1}, False, 1),
        ({"gpu0": 1}, 2.5, 1),  # a float global limit, even >= 1
    ],
)
def test_invalid_limits_config_error(limits, global_limit, count):
    """[runtime-concurrency] invalid limits raise ConfigError listing every problem."""
    with pytest.raises(ConfigError) as info:
        LocalGate(limits=limits, global_limit=global_limit)
    assert len(info.value.problems) == count


@pytest.mark.req("tunnel-guard")
async def test_concurrent_tasks_open_only_one_upstream(autojump_clock):
    """[tunnel-guard] two concurrent tunnel requests on a capacity-1 adapter: one runs, the
    other is rejected at once (no virtual time passes, no queue at the Node)."""
    gate = LocalGate(limits={"gpu0": 1}, global_limit=4)
    upstream = 0
    outcomes: list[tuple[str, float]] = []

    async def tunnel() -> None:
        nonlocal upstream
        try:
            with gate.try_acquire("gpu0"):
                upstream += 1
                await trio.sleep(1)
                outcomes.append(("ran", trio.current_time()))
        except ConcurrencyLimitExceeded:
            outcomes.append(("rejected", trio.current_time()))

    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tunnel)
        nursery.start_soon(tunnel)
    assert upstream == 1
    assert sorted(outcomes) == [("ran", t0 + 1), ("rejected", t0)]
    _drained(gate)


@pytest.mark.req("runtime-concurrency")
async def test_cancelled_holder_returns_permit(autojump_clock):
    """[runtime-concurrency] cancelling the run (its connection closed) returns the permit."""
    gate = LocalGate(limits={"gpu0": 1})

    async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with gate.try_acquire("gpu0"):
            task_status.started()
            await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        await nursery.start(run)
        assert gate.statistics().total_in_use == 1
        nursery.cancel_scope.cancel()
    _drained(gate)


@pytest.mark.req("tunnel-guard")
def test_permit_repr_names_it_and_its_state():
    """A permit's repr names its provider and says whether it is still held (the Node's logs)."""
    gate = LocalGate(limits={"gpu0": 1})
    permit = gate.try_acquire("gpu0")
    assert repr(permit) == "<Permit 'gpu0' held>"
    permit.release()
    assert repr(permit) == "<Permit 'gpu0' released>"


@pytest.mark.req("runtime-concurrency")
def test_global_limit_of_one_is_valid():
    """[runtime-concurrency] 1 is the smallest valid global limit: one permit, node-wide."""
    gate = LocalGate(limits={"gpu0": 1, "gpu1": 1}, global_limit=1)
    with gate.try_acquire("gpu0"), pytest.raises(ConcurrencyLimitExceeded):
        gate.try_acquire("gpu1")
    _drained(gate)


@pytest.mark.req("runtime-concurrency")
def test_every_rejection_counts_once_and_names_its_provider():
    """[runtime-concurrency] each rejection, per-provider or global, adds exactly one to
    ``rejected``; a global rejection names the provider asked for."""
    gate = LocalGate(limits={"gpu0": 1, "gpu1": 2}, global_limit=2)
    first = gate.try_acquire("gpu0")
    for count in (1, 2):
        with pytest.raises(ConcurrencyLimitExceeded):
            gate.try_acquire("gpu0")
        assert gate.statistics().rejected == count
    second = gate.try_acquire("gpu1")
    for count in (3, 4):
        with pytest.raises(ConcurrencyLimitExceeded) as info:
            gate.try_acquire("gpu1")
        assert (info.value.name, info.value.scope, info.value.limit) == ("gpu1", "global", 2)
        assert gate.statistics().rejected == count
    first.release()
    second.release()
    assert first.held is False and second.held is False
    _drained(gate)


@pytest.mark.req("tunnel-guard")
def test_gate_repr_shows_each_provider_and_the_global_count():
    """The gate's repr (the Node's logs): every provider's permits in use over its limit, then
    the node-wide count when there is a global limit."""
    gate = LocalGate(limits={"gpu0": 1, "gpu1": 2}, global_limit=3)
    with gate.try_acquire("gpu1"):
        assert repr(gate) == "<LocalGate gpu0 0/1, gpu1 1/2; 1/3 global>"
    assert repr(LocalGate(limits={"gpu0": 1})) == "<LocalGate gpu0 0/1>"
