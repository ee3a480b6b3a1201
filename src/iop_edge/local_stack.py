"""``make run``: the mock backend, an Edge and a Node on loopback, as real processes.

Uses ``examples/edge.yaml`` and ``examples/node.yaml`` (two model keys,
``ornith:35b`` and ``ornith-fast``, sharing the capacity-1 provider
``node-a/gpu0``; ``ornith:35b`` can fall back to ``node-a/gpu1``). Waits until
the node is registered, prints a curl line and the ``/status`` URL, and stops
all three cleanly on Ctrl-C (SIGINT) or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from iop_config import ConfigFileError

from .config import load_edge_config

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
READY_TIMEOUT = 20.0


def _get_json(url: str) -> object | None:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:  # noqa: S310 (loopback only)
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _wait_until(what: str, check: object, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise SystemExit(
                    f"{proc.args[2] if len(proc.args) > 2 else proc.args}: exited with {proc.returncode} while waiting for {what}"
                )  # type: ignore[index]
        if check():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise SystemExit(f"timed out after {READY_TIMEOUT:.0f}s waiting for {what}")


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


def main(argv: Sequence[str] | None = None) -> int:
    """Start the local stack and keep it running until Ctrl-C or SIGTERM."""
    # SIGTERM takes the Ctrl-C path: without it the process would die at once and
    # leave the backend, the Edge and the Node running.
    signal.signal(signal.SIGTERM, _interrupt)
    parser = argparse.ArgumentParser(prog="python -m iop_edge.local_stack", description=__doc__)
    parser.add_argument("--edge-config", default=str(EXAMPLES / "edge.yaml"))
    parser.add_argument("--node-config", default=str(EXAMPLES / "node.yaml"))
    parser.add_argument("--backend-port", type=int, default=9100)
    parser.add_argument("--latency-ms", type=int, default=200)
    parser.add_argument("--tokens-per-second", type=int, default=50)
    args = parser.parse_args(argv)
    try:
        edge = load_edge_config(args.edge_config)
    except ConfigFileError as exc:
        print("\n".join(exc.errors), file=sys.stderr)
        return 2
    base = f"http://{edge.listen.host}:{edge.listen.port}"
    py = sys.executable
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(
            subprocess.Popen(
                [
                    py,
                    "-m",
                    "iop_node.mock_backend",
                    "--port",
                    str(args.backend_port),
                    "--latency-ms",
                    str(args.latency_ms),
                    "--tokens-per-second",
                    str(args.tokens_per_second),
                ]
            )
        )
        _wait_until(
            "the mock backend",
            lambda: _get_json(f"http://127.0.0.1:{args.backend_port}/stats") is not None,
            procs,
        )
        procs.append(subprocess.Popen([py, "-m", "iop_edge", "--config", args.edge_config]))
        _wait_until("the Edge", lambda: _get_json(f"{base}/healthz") is not None, procs)
        procs.append(subprocess.Popen([py, "-m", "iop_node", "--config", args.node_config]))

        def node_registered() -> bool:
            status = _get_json(f"{base}/status")
            return isinstance(status, dict) and any(n.get("connected") for n in status.get("nodes", []))

        _wait_until("the node to register", node_registered, procs)
        body = json.dumps(
            {
                "model": "ornith:35b",
                "stream": True,
                "max_tokens": 16,
                "messages": [{"role": "user", "content": "Hello"}],
            }
        )
        print(
            "\nIOP local stack is up (mock backend, Edge, Node). Try:\n\n"
            f"  curl -N {base}/v1/chat/completions -H 'content-type: application/json' \\\n"
            f"       -d '{body}'\n\n"
            f"  Status:  {base}/status   (or: .venv/bin/iop status --edge {base})\n"
            f"  Models:  {base}/v1/models\n"
            f"  Metrics: {base}/metrics\n\n"
            "Ctrl-C stops all three.\n",
            flush=True,
        )
        while all(proc.poll() is None for proc in procs):
            time.sleep(0.5)
        for proc in procs:
            if proc.poll() is not None:
                print(f"{' '.join(map(str, proc.args))} exited with {proc.returncode}", file=sys.stderr)  # type: ignore[arg-type]
        return 1
    except KeyboardInterrupt:
        print("\nstopping the local stack ...", file=sys.stderr)
        return 0
    finally:
        _stop(procs)


if __name__ == "__main__":
    raise SystemExit(main())
