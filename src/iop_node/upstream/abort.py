"""An aborted upstream request held until its backend lets go ([cancel-upstream]).

Closing the connection of a cancelled request tells the backend to stop, but the backend
notices on its own time: one that reads the next request first counts two at once on a
provider of capacity 1. So a connection given back while its run is being cancelled (the
client went away, the deadline passed) is not closed at once: the pool ends its sending side
(a TCP FIN, which vLLM's, llama.cpp's and Ollama's servers read as the client gone), keeps
its slot, and hands it to the run's :class:`Abandoned`. The run awaits
:meth:`Abandoned.settle` before it returns its gate permit: each connection is read (what
the backend still sends is dropped) until the backend closes it or resets it, or until the
provider's ``abort_grace_ms`` passed; then it is closed and its pool slot returned. A grace
that ran out is logged and counted by the pool (``H11Transport.let_go_late``): the capacity
returns then, whether the backend let go or not.

Which run a connection belongs to is the task's context (:data:`LETTING_GO`, set by the run's
relay around the adapter's call): the pool finds it where the connection is given back, in
the run's own task, whatever adapter or body reader was unwinding.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import final

import trio

from iop_io import PeerGone
from iop_node.upstream.connection import Connection


@final
class Lingering:
    """One aborted request's connection, its sending side ended, waiting for the backend's end.

    ``release``: closes the connection and returns its pool slot, told whether the backend let go
    in time (called once, by :meth:`wait` or :meth:`release`).
    """

    __slots__ = ("connection", "grace", "_release")

    def __init__(self, connection: Connection, grace: float, release: Callable[[bool], None]) -> None:
        self.connection = connection
        self.grace = grace
        self._release = release

    def release(self) -> None:
        """Close the connection and return its slot now, not waiting for the backend."""
        self._release(True)

    async def wait(self) -> bool:
        """Read until the backend closes (or resets) the connection, at most :attr:`grace` seconds;
        then close it and return its slot. Whether the backend let go in time. Checkpoints."""
        io = self.connection.io
        let_go = False
        try:
            with trio.move_on_after(self.grace):
                while await io.receive_when_readable():  # what it still sends is nobody's
                    pass
                let_go = True
        except PeerGone:  # reset, or closed under us (the pool closing): it let go
            let_go = True
        finally:
            self._release(let_go)
        return let_go


@final
class Abandoned:
    """The aborted upstream requests of one run, held until their backends let go."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: list[Lingering] = []

    def hold(self, lingering: Lingering) -> None:
        """Keep ``lingering`` until :meth:`settle`."""
        self._held.append(lingering)

    def let_go_now(self) -> None:
        """Close every held connection now, without waiting for its backend (a failure, not an abort)."""
        held, self._held = self._held, []
        for lingering in held:
            lingering.release()

    async def settle(self) -> None:
        """Wait for every held connection's backend to let go (each within its grace), shielded from
        the caller's cancellation. Checkpoints only when something is held."""
        if not self._held:
            return
        held, self._held = self._held, []
        with trio.CancelScope(shield=True):
            for lingering in held:
                await lingering.wait()


LETTING_GO: ContextVar[Abandoned | None] = ContextVar("iop_node_letting_go", default=None)
"""The current run's :class:`Abandoned` (None outside a run: an aborted request is closed at once)."""
