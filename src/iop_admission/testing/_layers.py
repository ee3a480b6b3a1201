"""Either layer of admission on virtual time: one scenario, written once against
:class:`Layer`, runs on trio (:class:`~iop_admission.Admission`) or asyncio
(:class:`~iop_admission.aio.AsyncAdmission`).

``TrioLayer.run`` runs trio with ``MockClock(autojump_threshold=0)``;
``AsyncioLayer.run`` runs asyncio on :class:`VirtualTimeLoop`, whose clock jumps
to its next timer whenever nothing is ready. Both clocks start at 0, so the
two layers' event streams and errors can be compared exactly, times included.
``settle()`` lets every other task run until blocked: trio's
``wait_all_tasks_blocked``, asyncio's rounds of ``sleep(0)``. No real socket
may be involved: virtual time jumps over real waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, final

import attrs
import trio
import trio.testing

from iop_admission import Admission, PoolConfig
from iop_admission.aio import AsyncAdmission

__all__ = ["AsyncioLayer", "Handle", "Layer", "Signal", "Spawn", "TrioLayer", "VirtualTimeLoop"]


class Handle(Protocol):
    """A task started by :meth:`Layer.tasks`' spawn: how it ended, and a way to cancel it.

    ``outcome`` is None while it runs, then ``"ok"``, ``"cancelled"`` or the
    name of the exception class it raised.
    """

    outcome: str | None

    def cancel(self) -> None: ...


class Signal(Protocol):
    """A one-shot event of either runtime (``trio.Event``, ``asyncio.Event``)."""

    def set(self) -> None: ...

    async def wait(self) -> Any: ...


Spawn = Callable[[Callable[[], Awaitable[object]]], Handle]
"""Start ``fn()`` in a task of the layer's task group; returns its :class:`Handle`."""


class Layer(Protocol):
    """One layer of admission and its runtime, on virtual time."""

    name: str

    def admission(self, config: PoolConfig) -> Any:
        """A new admission of this layer (``Admission`` or ``AsyncAdmission``)."""
        ...

    async def settle(self) -> None:
        """Let every other task run until all are blocked. Checkpoints."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` of virtual time. Checkpoints."""
        ...

    def event(self) -> Signal:
        """A new one-shot event of the runtime."""
        ...

    def tasks(self) -> contextlib.AbstractAsyncContextManager[Spawn]:
        """A task group; leaving it waits for every task spawned in it."""
        ...

    def run(self, scenario: Callable[[], Awaitable[None]]) -> None:
        """Run ``scenario`` to its end on virtual time starting at 0."""
        ...

    def watch_ejections(self, admission: Any, spawn: Spawn) -> Handle | None:
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


@final
class TrioLayer:
    """The trio layer, :class:`~iop_admission.Admission`, on ``MockClock(autojump_threshold=0)``."""

    name = "trio"

    def admission(self, config: PoolConfig) -> Admission:
        return Admission(config)

    async def settle(self) -> None:
        await trio.testing.wait_all_tasks_blocked()

    async def sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)

    def event(self) -> Signal:
        return trio.Event()

    @contextlib.asynccontextmanager
    async def tasks(self) -> AsyncIterator[Spawn]:
        async with trio.open_nursery() as nursery:

            def spawn(fn: Callable[[], Awaitable[object]]) -> Handle:
                scope = trio.CancelScope()
                handle = _Handle(None, scope.cancel)

                async def body() -> None:
                    try:
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
                    except RuntimeError as exc:  # trio's, as the task left a cancel scope open (a lease's)
                        _record(handle, exc)

                nursery.start_soon(body)
                return handle

            yield spawn

    def run(self, scenario: Callable[[], Awaitable[None]]) -> None:
        trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))

    def watch_ejections(self, admission: Any, spawn: Spawn) -> Handle | None:
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


@final
class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """asyncio on virtual time, as trio's ``MockClock(autojump_threshold=0)``: ``time()`` starts at 0
    and moves only when every task waits on a timer (no real socket may be involved).

    Use it as ``asyncio.Runner(loop_factory=VirtualTimeLoop)``.
    """

    def __init__(self) -> None:
        self._virtual_clock = [0.0]
        super().__init__(_JumpingSelector(self._virtual_clock))

    def time(self) -> float:
        return self._virtual_clock[0]


@final
class AsyncioLayer:
    """The asyncio layer, :class:`~iop_admission.aio.AsyncAdmission`, on :class:`VirtualTimeLoop`."""

    name = "asyncio"

    def admission(self, config: PoolConfig) -> AsyncAdmission:
        return AsyncAdmission(config)

    async def settle(self) -> None:
        for _ in range(50):
            await asyncio.sleep(0)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def event(self) -> Signal:
        return asyncio.Event()

    @contextlib.asynccontextmanager
    async def tasks(self) -> AsyncIterator[Spawn]:
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

                def cancel() -> None:
                    task.cancel()

                handle._cancel = cancel
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

    def watch_ejections(self, admission: Any, spawn: Spawn) -> Handle | None:
        return None
