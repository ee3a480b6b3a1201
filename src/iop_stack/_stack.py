"""``iop-stack`` (``make run``): the mock backend, an Edge and a Node on loopback, as real processes.

By default it uses the example configs shipped inside this package
(``iop_stack/examples/edge.yaml`` and ``node.yaml``: two model keys,
``ornith:35b`` and ``ornith-fast``, sharing the capacity-1 provider
``node-a/gpu0``; ``ornith:35b`` can fall back to ``node-a/gpu1``). They are
package data, found with :mod:`importlib.resources`, so an installed wheel runs
the same stack as a source checkout. Waits until the node is registered, prints
a curl line and the ``/status`` URL, and stops all three cleanly on Ctrl-C
(SIGINT) or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.resources
import json
import pathlib
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence

from iop_config import ConfigFileError
from iop_edge import load_edge_config

READY_TIMEOUT = 20.0


def _get_json(url: str) -> object | None:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            body: object = json.loads(response.read())
            return body
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _wait_until(what: str, check: Callable[[], bool], procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise SystemExit(f"{_name(proc)}: exited with {proc.returncode} while waiting for {what}")
        if check():
            return
        time.sleep(0.1)
    raise SystemExit(f"timed out after {READY_TIMEOUT:.0f}s waiting for {what}")


def _name(proc: subprocess.Popen[bytes]) -> str:
    args = [str(arg) for arg in proc.args] if isinstance(proc.args, Sequence) else [str(proc.args)]
    return " ".join(args)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    # Node first, so it closes its socket to a live Edge; then Edge, then backend.
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="iop-stack", description=__doc__)
    parser.add_argument("--edge-config", help="edge config file (default: the packaged example)")
    parser.add_argument("--node-config", help="node config file (default: the packaged example)")
    parser.add_argument("--backend-port", type=int, default=9100)
    parser.add_argument("--latency-ms", type=int, default=200)
    parser.add_argument("--tokens-per-second", type=int, default=50)
    return parser.parse_args(argv)


def _start_all(args: argparse.Namespace, base: str, procs: list[subprocess.Popen[bytes]]) -> None:
    """Start backend, Edge and Node in that order, each once the previous one answers."""
    py = sys.executable
    backend = [py, "-m", "iop_mock", "--port", str(args.backend_port)]
    backend += ["--latency-ms", str(args.latency_ms), "--tokens-per-second", str(args.tokens_per_second)]
    procs.append(subprocess.Popen(backend))
    stats = f"http://127.0.0.1:{args.backend_port}/stats"
    _wait_until("the mock backend", lambda: _get_json(stats) is not None, procs)
    procs.append(subprocess.Popen([py, "-m", "iop_edge", "--config", args.edge_config]))
    _wait_until("the Edge", lambda: _get_json(f"{base}/healthz") is not None, procs)
    procs.append(subprocess.Popen([py, "-m", "iop_node", "--config", args.node_config]))

    def node_registered() -> bool:
        status = _get_json(f"{base}/status")
        return isinstance(status, dict) and any(n.get("connected") for n in status.get("nodes", []))

    _wait_until("the node to register", node_registered, procs)


def _banner(base: str) -> str:
    body = json.dumps(
        {"model": "ornith:35b", "stream": True, "max_tokens": 16, "messages": [{"role": "user", "content": "Hello"}]}
    )
    return (
        "\nIOP local stack is up (mock backend, Edge, Node). Try:\n\n"
        f"  curl -N {base}/v1/chat/completions -H 'content-type: application/json' \\\n"
        f"       -d '{body}'\n\n"
        f"  Status:  {base}/status   (or: {pathlib.Path(sys.executable).parent / 'iop'} status --edge {base})\n"
        f"  Models:  {base}/v1/models\n"
        f"  Metrics: {base}/metrics\n\n"
        "Ctrl-C stops all three.\n"
    )


def _run(args: argparse.Namespace) -> int:
    try:
        edge = load_edge_config(args.edge_config)
    except ConfigFileError as exc:
        print("\n".join(exc.errors), file=sys.stderr)
        return 2
    base = f"http://{edge.listen.host}:{edge.listen.port}"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        _start_all(args, base, procs)
        print(_banner(base), flush=True)
        while all(proc.poll() is None for proc in procs):
            time.sleep(0.5)
        for proc in procs:
            if proc.poll() is not None:
                print(f"{_name(proc)} exited with {proc.returncode}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping the local stack ...", file=sys.stderr)
        return 0
    finally:
        _stop(procs)


def main(argv: Sequence[str] | None = None) -> int:
    """Start the local stack and keep it running until Ctrl-C or SIGTERM."""
    # SIGTERM takes the Ctrl-C path: without it the process would die at once and
    # leave the backend, the Edge and the Node running. SIGINT is set too: a shell
    # without job control starts background commands with SIGINT ignored, and
    # Python then installs no KeyboardInterrupt handler of its own.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    args = _parse_args(argv)
    examples = importlib.resources.files("iop_stack") / "examples"
    with contextlib.ExitStack() as files:
        # A packaged file may not be on disk (zip import): as_file gives a real path for the child processes.
        if args.edge_config is None:
            args.edge_config = str(files.enter_context(importlib.resources.as_file(examples / "edge.yaml")))
        if args.node_config is None:
            args.node_config = str(files.enter_context(importlib.resources.as_file(examples / "node.yaml")))
        return _run(args)
