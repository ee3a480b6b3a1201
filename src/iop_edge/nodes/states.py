"""The state machines of a node connection (:class:`~iop_edge.nodes.link.NodeLink`) and of one run
on it (:class:`~iop_edge.nodes.runs.RunChannel`), each a table of transitions.

As in h11's ``_state.py``: everything that moves a link or a run from one state to another is
here, in a table (state -> input -> next state); the objects hold one state each and feed it
inputs, and an input the table has no entry for in the current state is a bug in the caller:
:class:`IllegalTransition`. An input that leaves the state as it is is listed too, so the table
says every input a state accepts.
"""

from __future__ import annotations

import enum
from typing import Final


class IllegalTransition(RuntimeError):
    """A state machine was given an input its state has no transition for (a bug in its caller)."""


# ------------------------------------------------------------------------------------------- runs


class RunState(enum.IntEnum):
    """Where one run stands, as its channel sees it (:class:`~iop_edge.nodes.runs.RunChannel`)."""

    OPEN = enum.auto()
    """Its messages arrive; its relay has taken none yet (the link's reader may answer it whole)."""
    READING = enum.auto()
    """Its messages arrive; its relay has taken one."""
    END_QUEUED = enum.auto()
    """Its end arrived (nothing more is taken); its relay has not read it yet."""
    ANSWER_QUEUED = enum.auto()
    """As END_QUEUED, and the link's reader wrote the whole answer to the client."""
    ENDED = enum.auto()
    """Its relay read the end."""
    ANSWERED = enum.auto()
    """Its relay read the end of a run the link's reader answered."""
    LOST = enum.auto()
    """The connection ended (or the link forgot the run) before its end: its relay gets what was
    buffered, then :class:`~iop_edge.nodes.runs.NodeGone`."""
    OVERFLOWED = enum.auto()
    """Its client fell too far behind: as LOST, the relay's error says the client was too slow."""
    LEFT = enum.auto()
    """Its relay left the run."""


class RunInput(enum.IntEnum):
    """What happens to a run."""

    TAKE = enum.auto()
    """The relay took a message that is not the end."""
    END = enum.auto()
    """The run's end arrived from the node."""
    WRITE_WHOLE = enum.auto()
    """The link's reader wrote the whole answer to the client."""
    READ_END = enum.auto()
    """The relay read the end."""
    LOSE = enum.auto()
    """The connection ended, or the link forgot the run."""
    OVERFLOW = enum.auto()
    """The client is too far behind (the run's buffer is full, or its sink refused)."""
    LEAVE = enum.auto()
    """The relay left the run."""


# The members by their own names, as h11's sentinels (and cheaper: reading a member off its enum
# class is a descriptor call, and a run goes through several transitions per message).
OPEN, READING, END_QUEUED, ANSWER_QUEUED, ENDED, ANSWERED, LOST, OVERFLOWED, LEFT = RunState
TAKE, END, WRITE_WHOLE, READ_END, LOSE, OVERFLOW, LEAVE = RunInput

_RUN_TRANSITIONS: Final[dict[RunState, dict[RunInput, RunState]]] = {
    OPEN: {
        TAKE: READING,
        END: END_QUEUED,
        LOSE: LOST,
        OVERFLOW: OVERFLOWED,
        LEAVE: LEFT,
    },
    READING: {
        TAKE: READING,
        END: END_QUEUED,
        LOSE: LOST,
        OVERFLOW: OVERFLOWED,
        LEAVE: LEFT,
    },
    # An end in the buffer outlives the connection: the relay still reads it.
    END_QUEUED: {
        TAKE: END_QUEUED,
        WRITE_WHOLE: ANSWER_QUEUED,
        READ_END: ENDED,
        LOSE: END_QUEUED,
        LEAVE: LEFT,
    },
    ANSWER_QUEUED: {
        TAKE: ANSWER_QUEUED,
        READ_END: ANSWERED,
        LOSE: ANSWER_QUEUED,
        LEAVE: LEFT,
    },
    ENDED: {LOSE: ENDED, LEAVE: LEFT},
    ANSWERED: {LOSE: ANSWERED, LEAVE: LEFT},
    LOST: {TAKE: LOST, LOSE: LOST, LEAVE: LEFT},
    OVERFLOWED: {TAKE: OVERFLOWED, LOSE: OVERFLOWED, LEAVE: LEFT},
    LEFT: {LOSE: LEFT},
}

RUN_RECEIVING: Final = frozenset({OPEN, READING})
"""The states in which a run takes messages from its node; in every other one nothing more comes."""

RUN_READ_END: Final = frozenset({ENDED, ANSWERED})
"""The states in which the relay has read the run's end."""

RUN_ANSWERED: Final = frozenset({ANSWER_QUEUED, ANSWERED})
"""The states in which the link's reader wrote the whole answer."""


def next_run_state(state: RunState, given: RunInput) -> RunState:
    """The state a run in ``state`` goes to on ``given``.

    Raises:
        IllegalTransition: ``state`` has no transition on ``given``.
    """
    try:
        return _RUN_TRANSITIONS[state][given]
    except KeyError:
        raise _illegal("a run", state, given) from None


# ------------------------------------------------------------------------------------------ links


class LinkState(enum.IntEnum):
    """Where one node connection stands, as its writer sees it (:class:`~iop_edge.nodes.link.NodeLink`)."""

    IDLE = enum.auto()
    """Its writer has nothing queued: a frame goes to the socket at once, from the task that has it."""
    BUSY = enum.auto()
    """Frames are queued for its writer (or taken and not written yet): a frame queues behind them."""
    ENDING = enum.auto()
    """It is being dropped: frames still queue, none is written at once."""
    CLOSED = enum.auto()
    """It ended: no frame is taken; its writer sends what is queued and stops."""


class LinkInput(enum.IntEnum):
    """What happens to a node connection."""

    QUEUE = enum.auto()
    """A frame was queued for the writer (or the rest of one written at once)."""
    DRAIN = enum.auto()
    """The writer wrote everything queued."""
    ABORT = enum.auto()
    """The connection is dropped (stalled, lost, heartbeat timeout)."""
    CLOSE = enum.auto()
    """The connection ended: its runs end with it."""


IDLE, BUSY, ENDING, CLOSED = LinkState
QUEUE, DRAIN, ABORT, CLOSE = LinkInput

_LINK_TRANSITIONS: Final[dict[LinkState, dict[LinkInput, LinkState]]] = {
    IDLE: {QUEUE: BUSY, ABORT: ENDING, CLOSE: CLOSED},
    BUSY: {QUEUE: BUSY, DRAIN: IDLE, ABORT: ENDING, CLOSE: CLOSED},
    ENDING: {QUEUE: ENDING, DRAIN: ENDING, ABORT: ENDING, CLOSE: CLOSED},
    CLOSED: {DRAIN: CLOSED, ABORT: CLOSED, CLOSE: CLOSED},
}


def next_link_state(state: LinkState, given: LinkInput) -> LinkState:
    """The state a node connection in ``state`` goes to on ``given``.

    Raises:
        IllegalTransition: ``state`` has no transition on ``given``.
    """
    try:
        return _LINK_TRANSITIONS[state][given]
    except KeyError:
        raise _illegal("a node link", state, given) from None


def _illegal(what: str, state: enum.Enum, given: enum.Enum) -> IllegalTransition:
    return IllegalTransition(f"{what} cannot {given.name} when {state.name}")
