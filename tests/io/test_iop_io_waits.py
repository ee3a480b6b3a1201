"""iop_io's two waits, once for every user: :class:`DueQueue` (the mock's token pacing, the Edge's
paused connections) and :class:`ParkedTask` (a run's relay, a node link's writer, a disconnect watch).

Their checkpoint behaviour is the contract: a wait always parks (a schedule point,
and a cancel point that leaves nothing behind); a wake-up never waits.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from iop_io import DueQueue, ParkedTask


async def test_due_queue_wakes_each_waiter_at_its_time_sharing_a_quantum(
    autojump_clock: trio.testing.MockClock,
) -> None:
    queue = DueQueue(quantum=0.01)
    woke: dict[float, float] = {}

    async def wait(due: float) -> None:
        await queue.wait_until(start + due)
        woke[due] = trio.current_time() - start

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.run)
        async with trio.open_nursery() as waiters:
            for due in (0.5, 0.505, 0.3, 1.0):
                waiters.start_soon(wait, due)
        nursery.cancel_scope.cancel()
    assert woke[0.3] == pytest.approx(0.3)
    assert woke[0.5] == pytest.approx(0.5)
    assert woke[0.505] == pytest.approx(0.5)  # within the quantum of 0.5: the same wake-up, 5 ms early
    assert woke[1.0] == pytest.approx(1.0)
    assert len(queue) == 0


async def test_due_queue_cancelled_wait_leaves_nothing_behind(autojump_clock: trio.testing.MockClock) -> None:
    queue = DueQueue()
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.run)
        with trio.move_on_after(0.1) as scope:
            await queue.wait_until(start + 10.0)
        assert scope.cancelled_caught
        await queue.wait_until(start + 0.2)  # the cancelled entry does not hold this one back
        assert trio.current_time() - start == pytest.approx(0.2)
        await trio.sleep(10.0)  # the cancelled entry comes due: dropped, nothing woken
        assert len(queue) == 0
        nursery.cancel_scope.cancel()


async def test_due_queue_wait_for_a_past_time_is_a_schedule_point(autojump_clock: trio.testing.MockClock) -> None:
    queue = DueQueue()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.run)
        with trio.testing.assert_checkpoints():
            await queue.wait_until(trio.current_time() - 1.0)
        with trio.CancelScope() as scope:
            scope.cancel()
            with pytest.raises(trio.Cancelled):
                await queue.wait_until(trio.current_time() + 1.0)  # a cancel point
        nursery.cancel_scope.cancel()


async def test_due_queue_answer_keeps_the_task_waiting_or_wakes_it(autojump_clock: trio.testing.MockClock) -> None:
    queue = DueQueue()
    asked: list[float] = []
    start = trio.current_time()

    def answer(due: float) -> float | None:
        asked.append(due - start)
        return due + 1.0 if len(asked) < 3 else None  # answered twice without the task, then woken

    def broken(due: float) -> float | None:
        raise RuntimeError("boom")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.run)
        await queue.wait_until(start + 1.0, answer)
        assert asked == [pytest.approx(1.0), pytest.approx(2.0), pytest.approx(3.0)]
        assert trio.current_time() - start == pytest.approx(3.0)
        await queue.wait_until(start + 4.0, broken)  # a raising answer wakes the task (and is logged)
        assert trio.current_time() - start == pytest.approx(4.0)
        nursery.cancel_scope.cancel()


class _WakesPerRound(trio.abc.Instrument):
    """Counts the reschedules of ``tasks`` in each round of trio's run loop (rounds are split by its I/O wait)."""

    def __init__(self) -> None:
        self.tasks: set[trio.lowlevel.Task] = set()
        self.rounds: list[int] = [0]

    def before_io_wait(self, timeout: float) -> None:
        if self.rounds[-1]:
            self.rounds.append(0)

    def task_scheduled(self, task: trio.lowlevel.Task) -> None:
        if task in self.tasks:
            self.rounds[-1] += 1


@pytest.mark.parametrize(("batch", "rounds"), [(2, [2, 2, 1]), (0, [5])])
async def test_due_queue_wakes_at_most_a_batch_per_scheduling_round(
    autojump_clock: trio.testing.MockClock, batch: int, rounds: list[int]
) -> None:
    queue = DueQueue(batch=batch)
    due = trio.current_time() + 1.0
    counter = _WakesPerRound()

    async def wait() -> None:
        counter.tasks.add(trio.lowlevel.current_task())
        await queue.wait_until(due)

    trio.lowlevel.add_instrument(counter)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(queue.run)
            async with trio.open_nursery() as waiters:
                for _ in range(5):
                    waiters.start_soon(wait)
            nursery.cancel_scope.cancel()
    finally:
        trio.lowlevel.remove_instrument(counter)
    assert [n for n in counter.rounds if n] == rounds


def test_due_queue_refuses_negative_bounds() -> None:
    with pytest.raises(ValueError, match="quantum and batch"):
        DueQueue(quantum=-1.0)
    with pytest.raises(ValueError, match="quantum and batch"):
        DueQueue(batch=-1)


async def test_parked_task_is_woken_once_and_a_wake_never_waits() -> None:
    parked = ParkedTask()
    assert not parked.wake()  # nobody parked: nothing happens
    order: list[str] = []

    async def consumer() -> None:
        await parked.park()
        order.append("woken")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consumer)
        await trio.testing.wait_all_tasks_blocked()
        assert parked.task is not None
        with trio.testing.assert_no_checkpoints():
            assert parked.wake()
            assert not parked.wake()  # woken already
        assert order == []  # the wake-up only reschedules; the consumer runs later
    assert order == ["woken"]


async def test_parked_task_cancelled_unparks_and_is_a_cancel_point() -> None:
    parked = ParkedTask()
    with trio.testing.assert_checkpoints():
        with trio.move_on_after(0.01) as scope:
            await parked.park()
    assert scope.cancelled_caught
    assert parked.task is None
    assert not parked.wake()
