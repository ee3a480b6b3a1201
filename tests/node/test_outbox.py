"""The Outbox: what the session's writer takes for one write."""

from __future__ import annotations

import trio
import trio.testing

from iop_node.edges.outbox import MAX_FRAME, Outbox


async def writes_once(outbox: Outbox, taken: list[list[str | bytes]]) -> None:
    """A writer's one write: what it takes from ``outbox``, appended to ``taken``."""
    taken.append(await outbox.next_frames())


async def test_next_frames_takes_everything_queued_records_first() -> None:
    """Every data record queued joined into one binary frame (in queue order), then the text frames as
    queued, all for one write: a run's end still follows its records, and the records of runs whose
    ends are queued in between are not split into a frame per run (a non-stream answer and its run end
    queued together go out in one ``send()``)."""
    outbox = Outbox()
    await outbox.put_record(b"h1", b"a")
    outbox.put_record_nowait(b"h2", b"b")
    await outbox.put_text('{"type":"run_end"}')
    await outbox.put_record(b"h3", b"c")
    await outbox.put_text("heartbeat")
    assert await outbox.next_frames() == [b"h1ah2bh3c", '{"type":"run_end"}', "heartbeat"]
    await outbox.put_text("end")
    assert await outbox.next_frames() == ["end"]


async def test_next_frames_waits_for_a_frame_and_stops_past_the_frame_bound() -> None:
    """An empty outbox waits for the next frame; one write takes frames while they total under
    MAX_FRAME bytes, the rest wait for the next write, in order."""
    outbox = Outbox()
    taken: list[list[str | bytes]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writes_once, outbox, taken)
        await trio.testing.wait_all_tasks_blocked()
        assert taken == []
        await outbox.put_text("first")
    assert taken == [["first"]]

    half = b"x" * (MAX_FRAME // 2)
    await outbox.put_record(b"h", half)
    await outbox.put_text("end")
    await outbox.put_record(b"h", half)
    outbox.put_record_nowait(b"h", b"y")  # past the bound: the next write
    assert await outbox.next_frames() == [b"h" + half + b"h" + half, "end"]
    assert await outbox.next_frames() == [b"hy"]


async def test_take_if_idle_only_while_the_writer_waits_with_nothing_queued() -> None:
    """A run's last record and end are handed back for the caller to write only while the writer
    waits for work with nothing queued (and without waking it); otherwise they are for the queue."""
    outbox = Outbox()
    assert outbox.take_if_idle((b"h", b"data"), "end") is None  # no writer waiting
    taken: list[list[str | bytes]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writes_once, outbox, taken)
        await trio.testing.wait_all_tasks_blocked()
        assert outbox.take_if_idle((b"h", b"data"), "end") == [b"hdata", "end"]
        assert outbox.take_if_idle(None, "end") == ["end"]
        await trio.testing.wait_all_tasks_blocked()
        assert taken == []  # the writer was not woken
        await outbox.put_text("heartbeat")
        assert outbox.take_if_idle(None, "end") is None  # something is queued: behind it
    assert taken == [["heartbeat"]]
    outbox.close()
    assert outbox.take_if_idle(None, "end") is None
