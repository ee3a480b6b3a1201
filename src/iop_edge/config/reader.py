"""Read a reload's config file in a child process; rebuild it on the loop a slice at a time.

[reload-off-loop] Parsing and checking a 10,000-node ``edge.yaml`` takes
about a second of CPU. Done in a worker thread of the Edge, that thread
shares the GIL with the event loop: on a busy machine it is preempted while
it holds the GIL, and the loop, back from waiting for I/O, waits for it --
a running stream's events wait with it (up to 20-45 ms measured on a 2-core
box). A child process shares no lock with the Edge, and it runs at a lower
OS priority (:data:`NICENESS`), so the Edge, its nodes and the backends
keep most of the CPU they need while a reload still gets its share.

The child (:func:`reader_argv`: the Edge's own interpreter and import path
calling :func:`main` with the file's path) loads and validates the file, builds the pool
and the lookup tables, and writes the result to its stdout as pickles, one
per :data:`PIECE_WEIGHT` of objects: the objects are written leaves first,
each pickle refers to the objects of the earlier ones by number, and the
last one holds the config itself. The Edge reads that output and rebuilds
the config one pickle per loop turn, about a millisecond each: the loop
never holds longer for the reload, and no other Python thread runs in the
Edge meanwhile.

The pickles come from a process the Edge started from its own code, so they
are trusted as the Edge's own objects are.
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import time
import types
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO, Final

import attrs
import trio

from iop_admission import ConfigError
from iop_config import ConfigFileError
from iop_edge._off_loop import ATOMS, bulk_work, drop_in_slices, references
from iop_edge.config import EdgeConfig, load_edge_config

NICENESS: Final = 5
"""The ``nice`` value of the reader and of its session (its autogroup, where Linux groups processes
by session): about a quarter of a core's time against one busy process at ``nice`` 0, so a reload
on a saturated Edge takes a bounded multiple of the reader's CPU (docs/edge-config.md, Runtime
refresh; the measurement: ``python -m benchmarks reload_load``)."""

PIECE_WEIGHT: Final = 1000
"""Objects and references per pickle (about a millisecond to rebuild on the benchmark box);
a single object with more references (a table of every node) is a pickle of its own."""

READ_TIMEOUT: Final = 120.0
"""Seconds the reader may take before the reload gives up on it (a file that never ends)."""

_ERRORS, _PIECE, _TABLE, _ITEMS, _CONFIG = "errors", "piece", "table", "items", "config"


def error_lines(path: str | os.PathLike[str], exc: ConfigFileError | ConfigError) -> list[str]:
    """What a reload reports for ``exc``, one line per problem, each naming the file."""
    if isinstance(exc, ConfigFileError):
        return list(exc.errors)
    return [f"{path}: {problem}" for problem in exc.problems]


@attrs.frozen
class ReadResult:
    """A config read by the child, rebuilt in this process."""

    config: EdgeConfig
    """Validated, with its pool and lookup tables built."""
    reader_cpu: float
    """CPU seconds the child spent loading and writing it."""


async def run_reader(path: str | os.PathLike[str]) -> bytes:
    """Load and validate ``path`` in a child process; what it wrote, for :func:`rebuild`.

    The child runs in a session of its own at a lower priority
    (:func:`lower_priority`, set as soon as it exists, before its imports).
    Checkpoints. Cancelled, it kills the child and returns at once.

    Raises:
        ConfigFileError: the reader could not run, failed or took longer than :data:`READ_TIMEOUT`.
    """
    timeout = READ_TIMEOUT
    done: list[subprocess.CompletedProcess[bytes]] = []

    async def run(task_status: trio.TaskStatus[trio.Process]) -> None:
        done.append(
            await trio.run_process(
                reader_argv(path),
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                env=_reader_env(),
                start_new_session=True,  # its own autogroup (see lower_priority)
                task_status=task_status,
            )
        )

    try:
        with trio.move_on_after(timeout):
            async with trio.open_nursery() as nursery:
                process = await nursery.start(run)
                lower_priority(process.pid)
    except* OSError as group:
        cause = group.exceptions[0]
        raise ConfigFileError([f"{path}: cannot start the config reader: {cause}"]) from cause
    if not done:
        raise ConfigFileError([f"{path}: the config reader did not finish within {timeout:g} s"])
    if done[0].returncode != 0:
        last = done[0].stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        raise ConfigFileError([f"{path}: the config reader failed (exit code {done[0].returncode}): {last[0]}"])
    return done[0].stdout


def lower_priority(pid: int) -> None:
    """Put process ``pid`` at ``nice`` :data:`NICENESS`: below the Edge's loop, its nodes and the
    backends on the same machine, yet sure of its share of the CPU when they keep it busy.

    Where Linux shares the CPU between sessions first (autogroups), priorities
    only count inside a session, and a busy process in the Edge's session would
    take the CPU from the Edge's share; so the reader runs in a session of its
    own, niced as a whole (only a process that leads its session: niced, a
    shared session would take the Edge's priority with it), and niced itself.
    Not idle priority (Linux's ``SCHED_IDLE``): that runs only when nothing
    else would, so on a saturated Edge -- when an operator needs a reload most
    -- it starved. A process that has already ended is left alone.
    """
    try:
        if os.getsid(pid) == pid:  # never the autogroup of a session it shares (the Edge's)
            with open(f"/proc/{pid}/autogroup", "w") as autogroup:
                autogroup.write(str(NICENESS))
    except OSError:
        pass  # no autogroups here, or the process has ended
    try:
        os.setpriority(os.PRIO_PROCESS, pid, NICENESS)
    except OSError:
        pass  # it has ended


_READER_CODE: Final = f"import sys; from {__name__} import main; sys.exit(main(sys.argv))"


def reader_argv(path: str | os.PathLike[str]) -> list[str]:
    """The command line of the child that reads ``path``: :func:`main` imported, not this module run
    as ``__main__`` (``python -m``), which the package's own import of it would load a second time
    (Python warns about it on the child's stderr)."""
    return [sys.executable, "-c", _READER_CODE, os.fspath(path)]


def _reader_env() -> dict[str, str]:
    """This process's environment (the file's ``*_env`` secrets), with its import path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


async def rebuild(data: bytes) -> ReadResult:
    """The config that :func:`write_config` wrote to ``data``, one pickle per loop turn, inside
    :func:`~iop_edge._off_loop.bulk_work` (no collection meanwhile; the new objects join the
    oldest generation after).

    Checkpoints (after each pickle). Cancelled, it drops what it rebuilt so far.

    Raises:
        ConfigFileError: ``data`` holds the file's problems instead.
    """
    stream = io.BytesIO(data)
    objects: list[object] = []
    table: dict[Any, Any] = {}
    with bulk_work(keeps_objects=True):
        while True:
            message = _Rebuilder(stream, objects).load()
            kind = message[0]
            if kind == _CONFIG:
                break
            if kind == _ERRORS:
                raise ConfigFileError(message[1])
            if kind == _PIECE:
                objects.extend(message[1])
            else:
                if kind == _TABLE:
                    table = {}
                    objects.append(types.MappingProxyType(table) if message[1] else table)
                flat = message[-1]
                table.update(zip(flat[::2], flat[1::2], strict=True))
            await trio.lowlevel.checkpoint()
        _, config, cpu = message
        del message
        await drop_in_slices(objects)  # a reference to every object, each still in use
    return ReadResult(config, cpu)


class _Rebuilder(pickle.Unpickler):
    """Reads one of :func:`write_config`'s pickles: an object of an earlier one is written as its
    number (a persistent id), its place in ``objects``."""

    def __init__(self, file: BinaryIO, objects: list[object]) -> None:
        super().__init__(file)
        self.objects = objects

    def persistent_load(self, pid: Any) -> object:
        return self.objects[pid]


class _Writer(pickle.Pickler):
    """Writes what :func:`rebuild` reads: each message a pickle with a memo of its own, an object sent
    in an earlier message written as its number.

    With one memo for all of them, the reader's memo would hold every object
    of the config, and freeing it would hold the Edge's loop (10-20 ms at
    10,000 nodes); this way each pickle's memo goes with its loop turn.
    """

    def __init__(self, file: BinaryIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.sent: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> int | None:
        return self.sent.get(id(obj))

    def send(self, message: tuple[Any, ...], new: Iterable[object] = ()) -> None:
        """Pickle ``message``; the objects ``new`` (in the order :func:`rebuild` keeps them) are
        written by number from then on."""
        self.clear_memo()
        self.dump(message)
        for obj in new:
            self.sent[id(obj)] = len(self.sent)


def write_config(path: str | os.PathLike[str], out: BinaryIO, *, weight: int = PIECE_WEIGHT) -> None:
    """Load and validate ``path``, build its pool and lookups; write them to ``out`` as :func:`rebuild`
    reads them (pickles of about ``weight`` objects and references, then the config), or the file's
    problems."""
    writer = _Writer(out)
    try:
        config = load_edge_config(path)
        config.pool_config()
        config.build_lookups()
    except (ConfigFileError, ConfigError) as exc:
        writer.send((_ERRORS, error_lines(path, exc)))
        return
    for message, new in messages(config, weight):
        writer.send(message, new)
    writer.send((_CONFIG, config, time.process_time()))


def messages(root: object, weight: int) -> Iterator[tuple[tuple[Any, ...], list[object]]]:
    """What to send ahead of ``root`` so that no pickle costs much more than ``weight`` to rebuild:
    ``(message, the objects it adds)`` pairs.

    Every container and attrs instance reachable from ``root`` is met leaves
    first and goes in a ``("piece", [objects])`` message of about ``weight``
    objects plus the references they hold: a piece refers only to objects of
    earlier messages (by number) or its own. A mapping proxy, or a dict of
    more than ``weight // 4`` items (a table of every node: far more than a
    piece to rebuild in one go), is a table instead: ``("table", is_proxy,
    [key, value, ...])`` then ``("items", [key, value, ...])`` messages of
    ``weight // 4`` items each. ``root`` itself is not in any message.
    """
    seen: set[int] = {id(root)}
    piece: list[object] = []
    held = 0
    chunk = max(1, weight // 4)
    stack: list[tuple[object, bool]] = [(child, False) for child in reversed(references(root))]
    while stack:
        obj, expanded = stack.pop()
        if not expanded:
            if type(obj) not in ATOMS and id(obj) not in seen:
                seen.add(id(obj))
                stack.append((obj, True))
                stack.extend((child, False) for child in reversed(references(obj)))
            continue
        if isinstance(obj, types.MappingProxyType) or (type(obj) is dict and len(obj) > chunk):
            if piece:
                yield (_PIECE, piece), piece
                piece, held = [], 0
            items = list(obj.items())
            for first in range(0, max(len(items), 1), chunk):
                flat = [item for pair in items[first : first + chunk] for item in pair]
                if first:
                    yield (_ITEMS, flat), []
                else:
                    yield (_TABLE, isinstance(obj, types.MappingProxyType), flat), [obj]
            continue
        piece.append(obj)
        held += 1 + len(references(obj))
        if held >= weight:
            yield (_PIECE, piece), piece
            piece, held = [], 0
    if piece:
        yield (_PIECE, piece), piece


def main(argv: list[str]) -> int:
    """The child, run by :func:`reader_argv` (``argv``: its ``sys.argv``, ``[program, PATH]``); the
    pickles on stdout, exit status 0 (the file's problems are pickled too). Anything else printed
    goes to stderr."""
    if len(argv) != 2:
        print(f"usage: {argv[0]} PATH", file=sys.stderr)
        return 2
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt the pickles
    with out:
        write_config(argv[1], out)
    return 0
