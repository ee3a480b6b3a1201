"""The layer harness of the contract tests: one scenario, written once against
:class:`Layer`, runs on either layer of admission, trio (``Admission``) or
asyncio (``AsyncAdmission``), each on virtual time.

``trio.run`` runs with ``MockClock(autojump_threshold=0)``; asyncio runs on
:class:`VirtualTimeLoop`, whose clock jumps to its next timer whenever nothing
is ready. Both clocks start at 0, so the two layers' event streams and errors
can be compared exactly, times included. ``settle()`` lets every other task
run until blocked: trio's ``wait_all_tasks_blocked``, asyncio's round of
``sleep(0)`` steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import attrs
import trio
import trio.testing

from iop_admission import Admission, PoolConfig
from iop_admission.aio import AsyncAdmission

__all__ = ["AsyncioLayer", "Handle", "Layer", "TrioLayer", "VirtualTimeLoop", "books_closed"]


def books_closed(admission: Any) -> None:
    """Nothing queued or leased, and nothing left in the layer's own tables (a leak would show here)."""
    assert admission.queue_depth == 0
    assert all(p.in_flight == 0 for p in admission.snapshot().providers)
    if isinstance(admission, Admission):
        assert not admission._handoff._parked and not admission._handoff._bodies
    else:
        assert not admission._futures and not admission._timers and not admission._bodies
        assert not admission._revoking


class Handle(Protocol):
    outcome: str | None

    def cancel(self) -> None: ...


class Layer(Protocol):
    name: str

    def admission(self, config: PoolConfig) -> Any: ...

    async def settle(self) -> None: ...

    async def sleep(self, seconds: float) -> None: ...

    def tasks(self) -> contextlib.AbstractAsyncContextManager[Callable[[Callable[[], Awaitable[object]]], Handle]]: ...

    def run(self, scenario: Callable[[], Awaitable[None]]) -> None: ...

    def watch_ejections(
        self, admission: Any, spawn: Callable[[Callable[[], Awaitable[object]]], Handle]
    ) -> Handle | None:
        """End ejections at their time: trio's ``watch_ejections`` task (asyncio's layer has its own timer)."""
        ...


@attrs.define
class _Handle:
    outcome: str | None = None
    _cancel: Callable[[], None] | None = None

    def cancel(self) -> None:
        assert self._cancel is not None
        self._cancel()


def _record(handle: _Handle, exc: BaseException | None) -> None:
    handle.outcome = "ok" if exc is None else type(exc).__name__


class TrioLayer:
    name = "trio"

    def admission(self, config: PoolConfig) -> Admission:
        return Admission(config)

    async def settle(self) -> None:
        await trio.testing.wait_all_tasks_blocked()

    async def sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)

    @contextlib.asynccontextmanager
    async def tasks(self) -> AsyncIterator[Callable[[Callable[[], Awaitable[object]]], Handle]]:
        async with trio.open_nursery() as nursery:

            def spawn(fn: Callable[[], Awaitable[object]]) -> Handle:
                scope = trio.CancelScope()
                handle = _Handle(None, scope.cancel)

                async def body() -> None:
                    with scope:
                        try:
                            await fn()
                        except Exception as exc:
                            _record(handle, exc)
                            return
                        except trio.Cancelled:
                            handle.outcome = "cancelled"
                            raise
                        _record(handle, None)

                nursery.start_soon(body)
                return handle

            yield spawn

    def run(self, scenario: Callable[[], Awaitable[None]]) -> None:
        trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))

    def watch_ejections(
        self, admission: Any, spawn: Callable[[Callable[[], Awaitable[object]]], Handle]
    ) -> Handle | None:
        return spawn(admission.watch_ejections)


class _JumpingSelector(selectors.DefaultSelector):
    """Polls instead of sleeping: with nothing ready before the next timer, the loop's clock jumps to it."""

    def __init__(self, clock: list[float]) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:  # no timer at all: only another thread can wake the loop (its shutdown)
            return super().select(None)
        ready = super().select(0)
        if not ready:
            self._clock[0] += timeout
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """asyncio on virtual time, as trio's ``MockClock(autojump_threshold=0)``: ``time()`` starts at 0
    and moves only when every task waits on a timer (no real socket may be involved)."""

    def __init__(self) -> None:
        self._virtual_clock = [0.0]
        super().__init__(_JumpingSelector(self._virtual_clock))

    def time(self) -> float:
        return self._virtual_clock[0]


class AsyncioLayer:
    name = "asyncio"

    def admission(self, config: PoolConfig) -> AsyncAdmission:
        return AsyncAdmission(config)

    async def settle(self) -> None:
        for _ in range(50):
            await asyncio.sleep(0)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    @contextlib.asynccontextmanager
    async def tasks(self) -> AsyncIterator[Callable[[Callable[[], Awaitable[object]]], Handle]]:
        async with asyncio.TaskGroup() as group:

            def spawn(fn: Callable[[], Awaitable[object]]) -> Handle:
                handle = _Handle()

                async def body() -> None:
                    try:
                        await fn()
                    except Exception as exc:
                        _record(handle, exc)
                        return
                    except asyncio.CancelledError:
                        handle.outcome = "cancelled"
                        return
                    _record(handle, None)

                task = group.create_task(body())
                handle._cancel = task.cancel
                return handle

            yield spawn

    def run(self, scenario: Callable[[], Awaitable[None]]) -> None:
        """Run ``scenario`` on a :class:`VirtualTimeLoop`; an exception the loop only logged (raised in
        a timer's or a callback's code, where asyncio catches it) fails the run too."""
        logged: list[dict[str, Any]] = []
        with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
            runner.get_loop().set_exception_handler(lambda loop, context: logged.append(context))
            runner.run(asyncio.wait_for(scenario(), 3600))  # virtual seconds: a scenario that hangs fails
        assert not logged, logged

    def watch_ejections(
        self, admission: Any, spawn: Callable[[Callable[[], Awaitable[object]]], Handle]
    ) -> Handle | None:
        return None
