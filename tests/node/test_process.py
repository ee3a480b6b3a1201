"""The real ``iop-node`` process (``sys.executable -m iop_node``) against the fake Edge."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from iop_wire import Rejected, Run, TunnelRequest, TunnelStart
from node.harness import TOKEN, FakeEdge

NODE_YAML = """\
node_id: node-a
edge_url: {url}
token_env: IOP_TEST_NODE_TOKEN
heartbeat_interval_ms: 5000
runtime: {{concurrency: 2}}
providers:
  - {{id: m0, adapter: mock, capacity: 2, latency_ms: 60000}}
"""


async def start_node(config: Path) -> trio.Process:
    env = {**os.environ, "IOP_TEST_NODE_TOKEN": TOKEN}
    return await trio.lowlevel.open_process(
        [sys.executable, "-m", "iop_node", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )


async def wait_and_read_stderr(process: trio.Process) -> str:
    assert process.stderr is not None
    chunks = []
    while chunk := await process.stderr.receive_some():
        chunks.append(chunk)
    await process.wait()
    return b"".join(chunks).decode()


async def stop(process: trio.Process) -> None:
    """Always called in finally: kill the child if it still runs, and reap it."""
    process.kill()
    with trio.CancelScope(shield=True), trio.move_on_after(5):
        await process.wait()


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "node.yaml"
    path.write_text(text)
    return path


@pytest.mark.req("disconnect-exclusion")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_shutdown_signal_sends_close_1001_and_exits_0(
    edge: FakeEdge, tmp_path: Path, signum: signal.Signals
) -> None:
    """[disconnect-exclusion] A graceful shutdown with a run in flight cancels it, sends a
    WebSocket close 1001 the Edge sees, and exits 0."""
    process = await start_node(write_config(tmp_path, NODE_YAML.format(url=edge.url)))
    try:
        with trio.fail_after(15):
            conn = await edge.next_connection()
            assert conn.register.token == TOKEN
            await conn.send(Run("r1", "m0", "chat/completions", {"max_tokens": 1}, True))
            await conn.send(TunnelRequest("r2", "m0", "GET", "/v1/models"))
            assert isinstance(await conn.receive_for("r2"), TunnelStart)  # r1 was dispatched before it
            process.send_signal(signum)
            stderr = await wait_and_read_stderr(process)
            await conn.closed.wait()
    finally:
        await stop(process)
    assert process.returncode == 0, stderr
    assert conn.close_reason is not None and conn.close_reason.code == 1001
    assert TOKEN not in stderr


async def test_final_rejection_exits_3(edge: FakeEdge, tmp_path: Path) -> None:
    """A bad_token rejection is logged with its reason; the process exits non-zero (3)."""
    edge.reject = Rejected("bad_token", "token does not match node-a", retryable=False)
    process = await start_node(write_config(tmp_path, NODE_YAML.format(url=edge.url)))
    try:
        with trio.fail_after(15):
            stderr = await wait_and_read_stderr(process)
    finally:
        await stop(process)
    assert process.returncode == 3, stderr
    assert "bad_token" in stderr and "token does not match node-a" in stderr
    assert TOKEN not in stderr
    assert len(edge.registers) == 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (NODE_YAML.replace("token_env: IOP_TEST_NODE_TOKEN\n", ""), "node.yaml:1: token: missing"),
        (NODE_YAML.replace("IOP_TEST_NODE_TOKEN", "IOP_TEST_UNSET_TOKEN"), "node.yaml:3: token_env:"),
        (NODE_YAML + "extra: 1\n", "node.yaml:8: extra: unknown key"),
    ],
)
async def test_config_problems_exit_2(tmp_path: Path, text: str, expected: str) -> None:
    """A missing token or any config problem is fatal: exit 2 with file:line: path."""
    process = await start_node(write_config(tmp_path, text.format(url="ws://127.0.0.1:9")))
    try:
        with trio.fail_after(15):
            stderr = await wait_and_read_stderr(process)
    finally:
        await stop(process)
    assert process.returncode == 2
    assert expected in stderr


async def read_stderr_until(process: trio.Process, seen: list[bytes], text: str) -> None:
    """Read the child's stderr into ``seen`` until ``text`` has appeared."""
    assert process.stderr is not None
    while text.encode() not in b"".join(seen):
        chunk = await process.stderr.receive_some()
        assert chunk, f"stderr ended before {text!r}"
        seen.append(chunk)


async def test_sighup_reloads_the_config_or_keeps_it(edge: FakeEdge, tmp_path: Path) -> None:
    """SIGHUP with a file that does not load: logged, the connection stays. With one that loads:
    close 1001, then a new registration with the new providers, in the same process."""
    config = write_config(tmp_path, NODE_YAML.format(url=edge.url))
    process = await start_node(config)
    try:
        with trio.fail_after(20):
            first = await edge.next_connection()
            config.write_text(NODE_YAML.format(url=edge.url) + "extra: 1\n")
            process.send_signal(signal.SIGHUP)
            seen: list[bytes] = []
            await read_stderr_until(process, seen, "reload rejected, keeping the running config")
            assert not first.closed.is_set()
            config.write_text(NODE_YAML.format(url=edge.url).replace("capacity: 2", "capacity: 1"))
            process.send_signal(signal.SIGHUP)
            second = await edge.next_connection()
            assert first.closed.is_set() and first.close_reason is not None and first.close_reason.code == 1001
            assert [p.capacity for p in second.register.providers] == [1]
            process.send_signal(signal.SIGTERM)
            stderr = b"".join(seen).decode() + await wait_and_read_stderr(process)
    finally:
        await stop(process)
    assert process.returncode == 0, stderr
    assert "reload rejected, keeping the running config" in stderr and "node.yaml:8: extra: unknown key" in stderr
    assert len(edge.registers) == 2
