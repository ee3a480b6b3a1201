"""What ``iop-edge`` and ``iop-node`` share before they serve: config problems on stderr and exit
code 2, the shutdown and reload signals, the garbage-collector policy (each daemon its figures)."""

from __future__ import annotations

import gc
import io
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from iop_config import EXIT_CONFIG, ConfigFileError, report_config_problems, shutdown_signals, tune_collector
from iop_edge import __main__ as edge_entry
from iop_node import __main__ as node_entry

EDGE_YAML = """\
listen: 127.0.0.1:0
node_listen: 127.0.0.1:0
nodes:
  - id: node-a
    token: t
    providers: [{id: gpu0, capacity: 1}]
models:
  - id: m
    candidates: [{node: node-a, provider: gpu0, upstream_model: m}]
"""
NODE_YAML = """\
node_id: node-a
edge_url: ws://127.0.0.1:9
token: t
providers:
  - {id: gpu0, adapter: mock, capacity: 1}
"""
DAEMONS = {"iop_edge": ("edge.yaml", EDGE_YAML), "iop_node": ("node.yaml", NODE_YAML)}
EDGE_READY = re.compile(rb"iop-edge listening: http://[^ ]+ \(API\)")


async def run_daemon(module: str, config: Path) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(30):
        return await trio.run_process(
            [sys.executable, "-m", module, "--config", str(config)],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


@pytest.mark.parametrize("module", sorted(DAEMONS))
async def test_a_bad_config_prints_every_problem_at_its_line_and_exits_2(tmp_path: Path, module: str) -> None:
    """Both daemons: one line per problem, ``FILE:LINE: field: problem``, nothing else; exit 2."""
    name, text = DAEMONS[module]
    config = tmp_path / name
    first, rest = text.split("\n", 1)
    config.write_text(f"{first}\nextra: 1\n{rest}other: 2\n")
    done = await run_daemon(module, config)
    assert done.returncode == EXIT_CONFIG == 2
    assert done.stderr.decode().splitlines() == [
        f"{config}:2: extra: unknown key 'extra'",
        f"{config}:{len(text.splitlines()) + 2}: other: unknown key 'other'",
    ]


@pytest.mark.parametrize("module", sorted(DAEMONS))
async def test_a_file_that_cannot_be_read_is_named_with_the_reason_and_exits_2(tmp_path: Path, module: str) -> None:
    missing = tmp_path / DAEMONS[module][0]
    done = await run_daemon(module, missing)
    assert done.returncode == 2
    assert done.stderr.decode().splitlines() == [f"{missing}: cannot read: No such file or directory"]


def test_an_os_error_reads_as_file_cannot_read_reason() -> None:
    out = io.StringIO()
    error = PermissionError(13, "Permission denied")
    assert report_config_problems("edge.yaml", error, out) == EXIT_CONFIG
    assert report_config_problems("edge.yaml", ConfigFileError(["edge.yaml:1: a: x", "edge.yaml:2: b: y"]), out) == 2
    assert out.getvalue().splitlines() == [
        "edge.yaml: cannot read: Permission denied",
        "edge.yaml:1: a: x",
        "edge.yaml:2: b: y",
    ]


def test_the_shutdown_signals_add_sigbreak_only_where_it_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without SIGBREAK (POSIX) the daemons stop on SIGINT and SIGTERM; on Windows on SIGBREAK too."""
    monkeypatch.delattr(signal, "SIGBREAK", raising=False)
    assert shutdown_signals() == (signal.SIGINT, signal.SIGTERM)
    monkeypatch.setattr(signal, "SIGBREAK", 21, raising=False)
    assert shutdown_signals() == (signal.SIGINT, signal.SIGTERM, 21)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
async def test_the_edge_stops_on_a_shutdown_signal_and_exits_0(tmp_path: Path, signum: signal.Signals) -> None:
    """On this platform (no SIGBREAK) the Edge still stops on SIGINT and SIGTERM, exit 0."""
    assert not hasattr(signal, "SIGBREAK")
    config = tmp_path / "edge.yaml"
    config.write_text(EDGE_YAML)
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "iop_edge", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert process.stderr is not None
    seen = b""
    try:
        with trio.fail_after(30):
            while not EDGE_READY.search(seen):
                chunk = await process.stderr.receive_some()
                assert chunk, seen.decode()
                seen += chunk
            process.send_signal(signum)
            while chunk := await process.stderr.receive_some():
                seen += chunk
            assert await process.wait() == 0, seen.decode()
    finally:
        process.kill()
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await process.wait()
    assert f"{signum.name} received, shutting down".encode() in seen


@pytest.fixture
def restored_collector() -> Iterator[None]:
    saved = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*saved)


@pytest.mark.usefixtures("restored_collector")
def test_the_policy_raises_only_the_young_threshold_and_freezes_on_request() -> None:
    gc.set_threshold(700, 10, 10)
    gc.unfreeze()
    tune_collector(edge_entry.YOUNG_THRESHOLD, freeze=False)
    assert gc.get_threshold() == (edge_entry.YOUNG_THRESHOLD, 10, 10)
    assert gc.get_freeze_count() == 0
    kept = [object(), {}]  # tracked objects alive at startup
    tune_collector(node_entry.YOUNG_THRESHOLD, freeze=True)
    assert gc.get_threshold() == (node_entry.YOUNG_THRESHOLD, 10, 10)
    assert gc.get_freeze_count() > len(kept)


@pytest.mark.usefixtures("restored_collector")
def test_the_edge_entry_point_tunes_before_it_runs(tmp_path: Path) -> None:
    """iop-edge's main() sets its policy before the Edge starts (a missing file: exit 2 right after)."""
    gc.set_threshold(700, 10, 10)
    with pytest.raises(SystemExit) as exit_info:
        edge_entry.main(["--config", f"{tmp_path}/missing.yaml"])
    assert exit_info.value.code == EXIT_CONFIG
    assert gc.get_threshold()[0] == edge_entry.YOUNG_THRESHOLD
