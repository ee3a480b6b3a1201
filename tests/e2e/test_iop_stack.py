"""``make run``: ``iop-stack`` (``python -m iop_stack``) with copies of its packaged example configs.

The examples use fixed ports (8080, 8081, 9100); the test rewrites copies to free ports
and passes them with ``--edge-config``/``--node-config``/``--backend-port``, so the
example files themselves are what gets started.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

EXAMPLES = importlib.resources.files("iop_stack") / "examples"
CURL = re.compile(r"curl -N (\S+) -H '[^']*' \\\n\s*-d ('[^\n]*')")


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free a moment ago (bind port 0, read it, close)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux ``/proc``)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


@pytest.mark.req("capacity-smoke")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
async def test_make_run_local_stack_serves_printed_request_and_stops(tmp_path: Path, signum: signal.Signals) -> None:
    """[capacity-smoke] ``make run``'s program on the example configs (ports rewritten):
    it prints a curl line once the node is registered; that request streams to [DONE];
    SIGINT (Ctrl-C) or SIGTERM stops it with exit 0 and none of its three children
    survives (SIGTERM used to kill it at once and leave all three running)."""
    http_port, node_port, backend_port = free_ports(3)
    edge_yaml = tmp_path / "edge.yaml"
    node_yaml = tmp_path / "node.yaml"
    edge_yaml.write_text(
        (EXAMPLES / "edge.yaml")
        .read_text()
        .replace("127.0.0.1:8080", f"127.0.0.1:{http_port}")
        .replace("127.0.0.1:8081", f"127.0.0.1:{node_port}")
    )
    node_yaml.write_text(
        (EXAMPLES / "node.yaml")
        .read_text()
        .replace("127.0.0.1:8081", f"127.0.0.1:{node_port}")
        .replace("127.0.0.1:9100", f"127.0.0.1:{backend_port}")
    )
    assert str(http_port) in edge_yaml.read_text() and str(backend_port) in node_yaml.read_text()
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    kids: list[int] = []
    with out_path.open("wb") as out, err_path.open("wb") as err:
        process = await trio.lowlevel.open_process(
            [
                sys.executable,
                "-m",
                "iop_stack",
                "--edge-config",
                str(edge_yaml),
                "--node-config",
                str(node_yaml),
                "--backend-port",
                str(backend_port),
                "--latency-ms",
                "20",
                "--tokens-per-second",
                "0",
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
        )
    try:
        with trio.fail_after(60):
            while not (match := CURL.search(out_path.read_text())):
                assert process.poll() is None, err_path.read_text()
                await trio.sleep(0.05)
            url, body = match[1], json.loads(shlex.split(match[2])[0])
            kids = children(process.pid)
            async with httpx.AsyncClient(timeout=10) as client:
                response = await client.post(url, json=body)
            process.send_signal(signum)
            code = await process.wait()
    finally:
        for pid in [*kids, process.pid]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            await process.wait()
    assert url == f"http://127.0.0.1:{http_port}/v1/chat/completions"
    assert body["model"] == "ornith:35b" and body["stream"] is True
    assert response.status_code == 200, response.text
    assert response.headers["x-iop-provider"] in ("node-a/gpu0", "node-a/gpu1")
    assert response.text.rstrip().endswith("data: [DONE]")
    assert code == 0, err_path.read_text()
    assert len(kids) == 3
    assert not [pid for pid in kids if alive(pid)]
