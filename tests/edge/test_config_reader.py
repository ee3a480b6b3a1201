"""[reload-off-loop] A reload's config is read in a child process and rebuilt on the loop a slice at a time."""

from __future__ import annotations

import gc
import io
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from edge.harness import EdgeLayout, running_edge
from iop_config import ConfigFileError
from iop_edge.config import load_edge_config
from iop_edge.config import reader as _config_reader
from iop_edge.config.reader import messages, rebuild, run_reader, write_config


def _fleet_yaml(nodes: int) -> str:
    """``nodes`` nodes, every other one with a second provider; model ``all`` lists every provider
    (the odd ones under another upstream name), model ``one`` the first."""
    lines = ["listen: 127.0.0.1:0", "node_listen: 127.0.0.1:0", "nodes:"]
    for n in range(nodes):
        lines += [f"  - id: node-{n}", f"    token: node-{n}-token-0123456789", "    providers:"]
        lines += ["      - {id: p0, capacity: 2}"] + (["      - {id: p1, capacity: 1}"] if n % 2 else [])
    lines += ["models:", "  - id: all", "    candidates:"]
    for n in range(nodes):
        lines.append(f"      - {{node: node-{n}, provider: p0}}")
        if n % 2:
            lines.append(f"      - {{node: node-{n}, provider: p1, upstream_model: other}}")
    lines += ["  - id: one", "    long_context_threshold_tokens: 100", "    candidates:"]
    lines.append("      - {node: node-0, provider: p0}")
    return "\n".join(lines) + "\n"


def _assert_same(rebuilt: Any, path: Path) -> None:
    """``rebuilt`` is the config ``load_edge_config(path)`` makes, its pool and lookups too, with the
    providers written alike still one object."""
    loaded = load_edge_config(path)
    assert rebuilt == loaded
    assert rebuilt.pool_config() == loaded.pool_config()
    loaded.build_lookups()
    assert rebuilt._lookups == loaded._lookups
    assert rebuilt.nodes[0].providers[0] is rebuilt.nodes[1].providers[0]
    assert rebuilt.upstream_model("all", rebuilt.candidates_of("all")[2]) == "other"
    assert rebuilt.provider_span("node-3") == (4, 2)


@pytest.mark.req("reload-off-loop")
async def test_the_reader_process_reads_the_config_load_edge_config_reads(tmp_path: Path) -> None:
    """[reload-off-loop] what the child process writes rebuilds to the config, pool and lookup
    tables that loading the file in this process gives, and the child reports its CPU time."""
    path = tmp_path / "edge.yaml"
    path.write_text(_fleet_yaml(300))
    with trio.fail_after(60):
        read = await rebuild(await run_reader(path))
    _assert_same(read.config, path)
    assert read.reader_cpu > 0


@pytest.mark.req("reload-off-loop")
def test_the_reader_loads_its_module_once_and_writes_nothing_else(tmp_path: Path) -> None:
    """[reload-off-loop] the child's command line imports the reader rather than running its module
    as ``__main__`` (the package imports it too: Python warned of the second copy on stderr), and a
    good file leaves its stderr empty."""
    path = tmp_path / "edge.yaml"
    path.write_text(_fleet_yaml(3))
    argv = _config_reader.reader_argv(path)
    assert "-m" not in argv
    child = subprocess.run(argv, capture_output=True, timeout=60, check=True)
    assert child.stderr == b""
    assert child.stdout


@pytest.mark.req("reload-off-loop")
@pytest.mark.parametrize("weight", [1, 7, 40, 1000])
async def test_the_config_rebuilds_the_same_one_pickle_per_loop_turn(tmp_path: Path, weight: int) -> None:
    """[reload-off-loop] whatever the pickles' weight, the rebuilt config is the loaded one, and the
    rebuild gives the loop a turn after each pickle but the last; the big tables (every node's
    providers, every candidate) arrive in items of ``weight // 4``, not in one pickle."""
    path = tmp_path / "edge.yaml"
    path.write_text(_fleet_yaml(30))
    out = io.BytesIO()
    write_config(path, out, weight=weight)
    sent: list[Any] = []
    # Any number finds an object (an empty tuple: it may stand for the arguments of a class's __new__).
    stream, objects = io.BytesIO(out.getvalue()), [()] * 10**6
    while not sent or sent[-1][0] != "config":
        sent.append(_config_reader._Rebuilder(stream, objects).load())
    tables = [message for message in sent if message[0] in ("table", "items")]
    assert all(len(message[-1]) <= 2 * max(1, weight // 4) for message in tables)
    if weight <= 40:  # the pool's providers (a proxy) and the nodes by id (45 and 30 items) are tables
        assert sum(message[0] == "table" for message in tables) >= 5

    steps: list[int] = []

    class Steps(trio.abc.Instrument):
        def before_task_step(self, task: trio.lowlevel.Task) -> None:
            if task.name.endswith("rebuilding"):
                steps.append(1)

    results: list[Any] = []

    async def rebuilding() -> None:
        results.append(await rebuild(out.getvalue()))

    instrument = Steps()
    trio.lowlevel.add_instrument(instrument)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(rebuilding)
    trio.lowlevel.remove_instrument(instrument)
    _assert_same(results[0].config, path)
    assert len(steps) == len(sent)  # the first step, then one after each pickle but the last


@pytest.mark.req("reload-off-loop")
async def test_the_rebuild_runs_without_collection_and_keeps_its_objects_old(tmp_path: Path) -> None:
    """[reload-off-loop] no garbage collection runs while the config is rebuilt on the loop (a young
    collection over it would hold the loop); afterwards its objects are in the oldest generation."""
    path = tmp_path / "edge.yaml"
    path.write_text(_fleet_yaml(20))
    out = io.BytesIO()
    write_config(path, out, weight=10)
    collecting: list[bool] = []

    async def watch() -> None:
        while True:
            collecting.append(gc.isenabled())
            await trio.lowlevel.checkpoint()

    assert gc.isenabled()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)  # its steps come between the rebuild's pickles
        read = await rebuild(out.getvalue())
        nursery.cancel_scope.cancel()
    assert collecting and not any(collecting)
    assert gc.isenabled()
    oldest = {id(obj) for obj in gc.get_objects(generation=2)}
    assert id(read.config) in oldest and id(read.config.nodes[5]) in oldest


@st.composite
def _nested(draw: st.DrawFn) -> Any:
    """Nested tuples, lists, dicts and mapping proxies of ints and strings, some parts shared."""
    leaves = st.one_of(st.integers(), st.text(max_size=3))
    shared = draw(st.lists(leaves, max_size=3))

    def extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.one_of(
            st.tuples(children, children),
            st.lists(children, max_size=6),
            st.dictionaries(st.text(max_size=3), children, max_size=8),
            st.dictionaries(st.integers(), children, max_size=3).map(types.MappingProxyType),
            st.just(shared),
        )

    return draw(st.recursive(leaves, extend, max_leaves=40))


@pytest.mark.req("reload-off-loop")
@given(root=_nested(), weight=st.integers(1, 20))
def test_any_nested_value_is_rebuilt_equal_and_shared_parts_stay_shared(root: Any, weight: int) -> None:
    """[reload-off-loop] the pieces and tables the writer cuts rebuild any value made of
    containers equal to the original, a part reached twice still one object."""
    pair = (root, root)
    out = io.BytesIO()
    writer = _config_reader._Writer(out)
    for message, new in messages(pair, weight):
        writer.send(message, new)
    writer.send(("config", pair, 0.0))
    first, second = trio.run(rebuild, out.getvalue()).config
    assert _plain(first) == _plain(root)
    assert first is second or isinstance(root, int)


def _plain(value: Any) -> Any:
    """``value`` with mapping proxies as dicts (for comparing)."""
    if isinstance(value, types.MappingProxyType):
        return ("proxy", {key: _plain(item) for key, item in value.items()})
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(item) for item in value)
    return value


@pytest.mark.req("reload-off-loop")
async def test_a_bad_file_is_reported_as_loading_it_here_reports_it(tmp_path: Path) -> None:
    """[reload-off-loop] the child's errors are those of loading the file in this process
    (``file:line: field``), and a missing file says it cannot be read."""
    path = tmp_path / "edge.yaml"
    path.write_text(_fleet_yaml(2).replace("capacity: 2", "capacity: lots"))
    with pytest.raises(ConfigFileError) as here:
        load_edge_config(path)
    with trio.fail_after(60):
        with pytest.raises(ConfigFileError) as child:
            await rebuild(await run_reader(path))
        assert child.value.errors == here.value.errors
        assert child.value.errors[0] == f"{path}:7: nodes[0].providers[0].capacity: must be an integer, got a string"
        missing = tmp_path / "missing.yaml"
        with pytest.raises(ConfigFileError) as here:
            load_edge_config(missing)
        with pytest.raises(ConfigFileError) as child:
            await rebuild(await run_reader(missing))
        assert child.value.errors == here.value.errors == (f"{missing}: cannot read: No such file or directory",)


def _child(monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    """Make the reader run ``python -c code`` instead."""
    monkeypatch.setattr(_config_reader, "reader_argv", lambda path: [sys.executable, "-c", code])


@pytest.mark.req("reload-off-loop")
async def test_a_reader_that_fails_or_hangs_is_an_error_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """[reload-off-loop] a reader that exits non-zero gives its exit code and last stderr line; one
    that takes longer than READ_TIMEOUT is killed and said to be late."""
    path = tmp_path / "edge.yaml"
    _child(monkeypatch, "import sys; print('first', file=sys.stderr); print('boom', file=sys.stderr); sys.exit(3)")
    with trio.fail_after(30):
        with pytest.raises(ConfigFileError) as failed:
            await run_reader(path)
        assert failed.value.errors == (f"{path}: the config reader failed (exit code 3): boom",)
        _child(monkeypatch, "import time; time.sleep(60)")
        monkeypatch.setattr(_config_reader, "READ_TIMEOUT", 0.3)
        with pytest.raises(ConfigFileError) as late:
            await run_reader(path)
        assert late.value.errors == (f"{path}: the config reader did not finish within 0.3 s",)
        monkeypatch.setattr(_config_reader, "reader_argv", lambda path: [str(tmp_path / "no-such-python")])
        with pytest.raises(ConfigFileError, match="cannot start the config reader"):
            await run_reader(path)


@pytest.mark.req("reload-off-loop")
async def test_a_reader_cancelled_is_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """[reload-off-loop] cancelling the read (a shutdown during a reload) kills the child at once."""
    pid_file = tmp_path / "pid"
    _child(monkeypatch, f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)")
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_reader, tmp_path / "edge.yaml")
            while not pid_file.exists() or not pid_file.read_text():
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)


@pytest.mark.req("reload-off-loop")
async def test_what_the_reader_prints_does_not_reach_its_pickles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """[reload-off-loop] anything printed in the child while it loads goes to its stderr, not into
    the pickles on its stdout."""
    path = tmp_path / "edge.yaml"
    path.write_text(_fleet_yaml(4))
    code = (
        "import sys\n"
        "from iop_edge.config import reader as r\n"
        "load = r.load_edge_config\n"
        "r.load_edge_config = lambda p: (print('stray output'), load(p))[1]\n"
        f"sys.exit(r.main(['reader', {str(path)!r}]))\n"
    )
    _child(monkeypatch, code)
    with trio.fail_after(60):
        read = await rebuild(await run_reader(path))
    assert read.config == load_edge_config(path)


@pytest.mark.req("reload-off-loop")
async def test_a_reload_whose_reader_fails_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """[reload-off-loop] a reader that dies makes the reload fail with its error; the config in
    force stays, and the next reload applies."""
    with trio.fail_after(60):
        async with running_edge(tmp_path) as edge:
            before = edge.service.config
            edge.rewrite(EdgeLayout(gpu0_capacity=3))
            _child(monkeypatch, "import os; os.abort()")
            (error,) = await edge.service.reload()
            assert error.startswith(f"{edge.config_path}: the config reader failed (exit code -6)")
            assert edge.service.config is before
            monkeypatch.undo()
            assert await edge.service.reload() == []
            assert edge.provider("node-a", "gpu0")["capacity"] == 3


@pytest.mark.req("reload-off-loop")
async def test_the_reader_runs_at_a_lower_priority_in_a_session_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """[reload-off-loop] the reader is given nice NICENESS as soon as it exists (it waits to see it
    here, up to 20 s), not idle priority (which starves on a saturated Edge), in a session of its
    own, so its CPU time is not charged to the Edge's."""
    code = (
        "import os, time\n"
        "deadline = time.monotonic() + 20\n"
        f"while os.getpriority(os.PRIO_PROCESS, 0) != {_config_reader.NICENESS} and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        f"print(os.getpriority(os.PRIO_PROCESS, 0) == {_config_reader.NICENESS},"
        " os.sched_getscheduler(0) == os.SCHED_OTHER, os.getsid(0) == os.getpid())\n"
    )
    _child(monkeypatch, code)
    with trio.fail_after(60):
        assert (await run_reader(tmp_path / "edge.yaml")).split() == [b"True", b"True", b"True"]


@pytest.mark.req("reload-off-loop")
def test_lowering_a_process_that_shares_our_session_leaves_the_session_alone() -> None:
    """[reload-off-loop] lower_priority renices an autogroup only for a process that leads its own
    session: given one in this process's session, it renices that process and leaves the
    session's (this process's) priority as it was."""
    before = Path("/proc/self/autogroup").read_text() if Path("/proc/self/autogroup").exists() else None
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        _config_reader.lower_priority(child.pid)
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == _config_reader.NICENESS
        assert os.sched_getscheduler(child.pid) == os.SCHED_OTHER
        after = Path("/proc/self/autogroup").read_text() if before is not None else None
        assert after == before
    finally:
        child.kill()
        child.wait()
