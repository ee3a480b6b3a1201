"""The runner: carry a program's steps out against one layer of admission and the code under
test, on virtual time, checking the library's promises after every step and at the end."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, final

import attrs

from iop_admission import Lease, PoolConfig

from ._calls import BodyFailed, Call
from ._checks import Books, check_end, check_step
from ._layers import AsyncioLayer, Layer, Spawn, TrioLayer
from ._program import Advance, Ask, Cancel, Disconnect, Finish, Reconnect, Refresh, Step

__all__ = ["Client", "lease_directly", "run_program"]

Client = Callable[[Ask], AbstractAsyncContextManager[object]]
"""The code under test: for an :class:`Ask`, an async context manager that holds a lease
(or whatever the user's code holds it in) while it is entered."""

LAYERS: dict[str, Layer] = {"trio": TrioLayer(), "asyncio": AsyncioLayer()}
EVENT_BUFFER = 1 << 20


def lease_directly(admission: Any) -> Client:
    """The client that takes the lease itself: ``admission.lease(ask.model, long=ask.long, tenant=ask.tenant)``."""

    def client(ask: Ask) -> AbstractAsyncContextManager[object]:
        scope: AbstractAsyncContextManager[object] = admission.lease(ask.model, long=ask.long, tenant=ask.tenant)
        return scope

    return client


@final
@attrs.define(eq=False)
class _Run:
    layer: Layer
    admission: Any
    client: Client
    spawn: Spawn
    books: Books
    calls: list[Call] = attrs.Factory(list)

    async def ask(self, step: Ask) -> None:
        for _ in range(step.count):
            call = Call(len(self.calls) + 1, step, self.layer.event())
            self.calls.append(call)
            call.handle = self.spawn(lambda call=call: self._body(call))  # type: ignore[misc]
            await self.layer.settle()  # one at a time: arrival order is call order

    async def _body(self, call: Call) -> None:
        try:
            async with self.client(call.ask) as held:
                call.entered = True
                call.entered_step = self.books.step
                call.lease = held if isinstance(held, Lease) else None
                if call.ask.hold:
                    await call.finish.wait()
                    if call.fail:
                        raise BodyFailed(f"call #{call.number}'s body failed (planted by Finish(fail=True))")
        except Exception as exc:
            call.error = exc

    def pick(self, pick: int, holding: bool) -> Call | None:
        chosen = [c for c in self.calls if (c.holding if holding else c.waiting)]
        return chosen[pick % len(chosen)] if chosen else None

    async def step(self, step: Step) -> None:
        """Carry ``step`` out, then let every task run until blocked."""
        if type(step) is Ask:
            await self.ask(step)
        elif type(step) is Finish:
            call = self.pick(step.pick, holding=True)
            if call is not None:
                call.fail = step.fail
                call.finish.set()
        elif type(step) is Cancel:
            call = self.pick(step.pick, step.holding)
            if call is not None and call.handle is not None:
                call.cancelled = True
                call.handle.cancel()
        elif type(step) is Disconnect:
            self.admission.disconnect(step.node, self.admission.generation(step.node))
        elif type(step) is Reconnect:
            self.admission.connect(step.node)
        elif type(step) is Refresh:
            self.admission.refresh(step.config)
        elif type(step) is Advance:
            await self.layer.sleep(step.seconds)
        await self.layer.settle()

    async def end(self) -> None:
        """Finish every holding call and cancel every waiting one."""
        for call in self.calls:
            if call.holding:
                call.finish.set()
            elif call.waiting and call.handle is not None:
                call.cancelled = True
                call.handle.cancel()
        await self.layer.settle()

    def cancel_all(self) -> None:
        """Cancel every call still running (a check failed: the run stops here)."""
        for call in self.calls:
            if not call.ended and call.handle is not None:
                call.cancelled = True
                call.handle.cancel()


def run_program(
    program: Sequence[Step],
    config: PoolConfig,
    *,
    layer: str | Layer = "trio",
    client: Callable[[Any], Client] = lease_directly,
    allowed: tuple[type[BaseException], ...] = (),
    check: Callable[[Any], None] | None = None,
) -> None:
    """Run ``program`` against a new admission of ``layer`` over ``config``, with every node
    connected at the start, on virtual time; check the library's promises after every step.

    Args:
        program: the steps, as :func:`programs` draws them.
        config: the pool.
        layer: ``"trio"`` (:class:`~iop_admission.Admission`), ``"asyncio"``
            (:class:`~iop_admission.aio.AsyncAdmission`), or a :class:`Layer`.
        client: makes the code under test from the admission (once per run); by
            default :func:`lease_directly`.
        allowed: exceptions the code under test may raise out of a call besides
            the admission errors that answer a request (``QueueTimeout``, ...).
        check: called with the admission at the end, after every call ended.

    Raises:
        AssertionError: a promise was broken; the message says which, after which step.
    """
    chosen = LAYERS[layer] if isinstance(layer, str) else layer
    broken: list[str] = []
    chosen.run(lambda: _scenario(chosen, config, program, client, allowed, check, broken))
    if broken:  # raised here, outside the task group, so that no exception group wraps it
        raise AssertionError(broken[0])


async def _scenario(
    layer: Layer,
    config: PoolConfig,
    program: Sequence[Step],
    client: Callable[[Any], Client],
    allowed: tuple[type[BaseException], ...],
    check: Callable[[Any], None] | None,
    broken: list[str],
) -> None:
    admission = layer.admission(config)
    for node in dict.fromkeys(k.node_id for k in config.providers):
        admission.connect(node)
    books = Books(allowed=allowed)
    async with layer.tasks() as spawn, admission.subscribe(EVENT_BUFFER) as events:

        async def read() -> None:
            async for event in events:
                books.events.append(event)

        reader = spawn(read)
        run = _Run(layer, admission, client(admission), spawn, books)
        for number, step in enumerate(program, 1):
            books.step = number
            await run.step(step)
            if _broken(f"after step {number}, {step!r}", lambda: check_step(admission, run.calls, books), broken):
                run.cancel_all()
                break
        else:
            await run.end()
            if not _broken("at the end", lambda: check_end(admission, run.calls, books), broken) and check:
                _broken("at the end", lambda: check(admission), broken)
            run.cancel_all()  # a call that never ended (reported above) must not hold the task group open
        reader.cancel()


def _broken(where: str, check: Callable[[], None], broken: list[str]) -> bool:
    """Run ``check``; a broken promise is noted in ``broken`` (True) instead of raised."""
    try:
        check()
    except AssertionError as exc:
        broken.append(f"{where}: {exc}")
        return True
    return False
