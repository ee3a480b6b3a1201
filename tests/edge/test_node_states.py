"""The state tables of a node link and of a run on it (``iop_edge.nodes.states``), and the objects
that follow them: every state's row, illegal inputs refused, a run's and a link's life."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio

from edge.harness import FAST, eventually, fake_node, running_edge, start_chat
from iop_edge.nodes.runs import NodeGone, RunChannel
from iop_edge.nodes.states import (
    IllegalTransition,
    LinkInput,
    LinkState,
    RunInput,
    RunState,
    next_link_state,
    next_run_state,
)
from iop_wire import Run, RunData, RunEnd

TERMINAL_INPUTS = {RunInput.LOSE, RunInput.LEAVE}


def accepted(state: RunState) -> set[RunInput]:
    """The inputs the run table has a transition for in ``state``."""
    legal = set()
    for given in RunInput:
        try:
            next_run_state(state, given)
        except IllegalTransition:
            continue
        legal.add(given)
    return legal


def test_every_run_state_takes_the_loss_of_its_connection_and_all_but_left_its_relay_leaving() -> None:
    for state in RunState:
        assert RunInput.LOSE in accepted(state), state
        assert (RunInput.LEAVE in accepted(state)) is (state is not RunState.LEFT)
    assert next_run_state(RunState.LEFT, RunInput.LOSE) is RunState.LEFT


def test_a_run_takes_messages_only_while_receiving_and_its_end_once() -> None:
    assert (
        accepted(RunState.OPEN)
        == accepted(RunState.READING)
        == set(RunInput) - {RunInput.WRITE_WHOLE, RunInput.READ_END}
    )
    for state in set(RunState) - {RunState.OPEN, RunState.READING}:
        assert RunInput.END not in accepted(state), state
        assert RunInput.OVERFLOW not in accepted(state), state
    assert accepted(RunState.ENDED) == accepted(RunState.ANSWERED) == TERMINAL_INPUTS
    assert accepted(RunState.LOST) == accepted(RunState.OVERFLOWED) == TERMINAL_INPUTS | {RunInput.TAKE}


@pytest.mark.parametrize(
    ("state", "given"),
    [
        (RunState.ENDED, RunInput.END),
        (RunState.ENDED, RunInput.TAKE),
        (RunState.READING, RunInput.READ_END),
        (RunState.ANSWER_QUEUED, RunInput.WRITE_WHOLE),
        (RunState.LOST, RunInput.OVERFLOW),
        (RunState.LEFT, RunInput.LEAVE),
    ],
)
def test_an_input_a_run_state_has_no_row_for_is_refused(state: RunState, given: RunInput) -> None:
    with pytest.raises(IllegalTransition, match=f"a run cannot {given.name} when {state.name}"):
        next_run_state(state, given)


def test_the_link_table() -> None:
    assert next_link_state(LinkState.IDLE, LinkInput.QUEUE) is LinkState.BUSY
    assert next_link_state(LinkState.BUSY, LinkInput.DRAIN) is LinkState.IDLE
    for state in LinkState:
        assert next_link_state(state, LinkInput.CLOSE) is LinkState.CLOSED
        expected = LinkState.CLOSED if state is LinkState.CLOSED else LinkState.ENDING
        assert next_link_state(state, LinkInput.ABORT) is expected
    assert next_link_state(LinkState.ENDING, LinkInput.QUEUE) is LinkState.ENDING  # queued, never written at once
    with pytest.raises(IllegalTransition, match="a node link cannot QUEUE when CLOSED"):
        next_link_state(LinkState.CLOSED, LinkInput.QUEUE)
    with pytest.raises(IllegalTransition, match="a node link cannot DRAIN when IDLE"):
        next_link_state(LinkState.IDLE, LinkInput.DRAIN)


async def test_a_run_relayed_by_its_relay_goes_open_reading_ended_left() -> None:
    channel = RunChannel("r1", None)  # type: ignore[arg-type]  # the link is used only when left unended
    assert channel.state is RunState.OPEN
    assert channel.deliver(RunData("r1", 0, b"a"))
    assert await channel.next() == RunData("r1", 0, b"a")
    assert channel.state is RunState.READING
    assert channel.deliver(RunEnd("r1", "ok"))
    assert channel.state is RunState.END_QUEUED and not channel.ended
    assert not channel.deliver(RunData("r1", 1, b"late"))  # nothing is taken after the end
    channel.close()  # the connection ends: the end in the buffer is still read
    assert await channel.next() == RunEnd("r1", "ok")
    assert channel.state is RunState.ENDED and channel.ended and not channel.answered
    async with channel:
        pass
    assert channel.state is RunState.LEFT


async def test_a_whole_answer_written_by_the_reader_goes_open_answer_queued_answered() -> None:
    written: list[bytes] = []
    channel = RunChannel("r1", None)  # type: ignore[arg-type]
    channel.answer_whole(lambda body: written.append(body) is None)
    assert channel.deliver(RunData("r1", 0, b"{}"))
    assert channel.deliver(RunEnd("r1", "ok"))
    assert channel.state is RunState.ANSWER_QUEUED and channel.answered and written == [b"{}"]
    assert channel.buffered() == [RunData("r1", 0, b"{}"), RunEnd("r1", "ok")]
    assert channel.state is RunState.ANSWERED and channel.answered and channel.ended


async def test_a_lost_or_overflowed_run_gives_its_buffer_then_raises() -> None:
    lost = RunChannel("r1", None)  # type: ignore[arg-type]
    assert lost.deliver(RunData("r1", 0, b"a"))
    lost.close()
    assert lost.state is RunState.LOST and not lost.overflowed
    assert await lost.next() == RunData("r1", 0, b"a")
    with pytest.raises(NodeGone, match="connection lost"):
        await lost.next()
    slow = RunChannel("r2", None)  # type: ignore[arg-type]
    assert slow.attach(lambda data: False)  # the client's writer refuses: too far behind
    assert not slow.deliver_data(0, b"a")
    assert slow.state is RunState.OVERFLOWED and slow.overflowed
    slow.close()  # the link forgets it: still overflowed
    with pytest.raises(NodeGone, match="client too slow"):
        await slow.next()


async def test_a_link_is_idle_between_frames_and_closed_once_its_node_left(tmp_path: Path) -> None:
    """The link writes a run's frame at once from an idle writer, comes back to IDLE when its writer
    has sent everything, and is CLOSED (taking no frame) after its node left."""
    with trio.fail_after(10):
        async with running_edge(tmp_path) as edge:
            async with fake_node(edge) as node:
                (link,) = edge.service.registry.links()
                await eventually(lambda: link.state is LinkState.IDLE)
                results: dict[str, httpx.Response] = {}
                async with trio.open_nursery() as nursery:
                    start_chat(nursery, edge, results, "one", FAST)
                    run = await node.next_run()
                    await eventually(lambda: link.state is LinkState.IDLE)
                    await node.answer(run)
                assert results["one"].status_code == 200
            await eventually(lambda: link.state is LinkState.CLOSED)
            with pytest.raises(NodeGone):
                link.open_run(Run("late", "gpu0", "completions", {"prompt": "x"}, False))
            assert link.active_runs == 0
