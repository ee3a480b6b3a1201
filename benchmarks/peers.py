"""Peer gateways measured in the same run as ours: a LiteLLM proxy (``make bench-peers``).

LiteLLM lives in its own virtualenv, ``benchmarks/.peers`` (git-ignored), created on
first use with ``python -m venv`` and ``pip install litellm[proxy]==LITELLM_VERSION``;
it is never imported into the project's environment and never runs in ``make test``.
The proxy runs as a subprocess on loopback with one model, ``mock``, an
OpenAI-compatible model (``openai/mock``) whose ``api_base`` is the mock backend.
Telemetry, the remote model-cost-map fetch, the UI/docs and spend logging are off, and
no database is configured.

Why the pin: the newest releases' ``proxy`` extra depends on ``litellm-proxy``, which
is not installable from this machine's package index; 1.100.0 is the newest release
whose ``proxy`` extra resolves here.
"""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys

import trio

from .harness import BenchmarkFailed, Daemon, HttpConnection

ROOT = pathlib.Path(__file__).resolve().parent
VENV = ROOT / ".peers"
LITELLM_VERSION = "1.100.0"
REQUIREMENT = f"litellm[proxy]=={LITELLM_VERSION}"

CONFIG = """\
model_list:
  - model_name: mock
    litellm_params:
      model: openai/mock
      api_base: http://127.0.0.1:{backend_port}/v1
      api_key: sk-bench-not-checked
litellm_settings:
  telemetry: false
  drop_params: true
  set_verbose: false
  request_timeout: 60
general_settings:
  disable_spend_logs: true
  disable_error_logs: true
  background_health_checks: false
"""

ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch of the cost map from the network
    "LITELLM_TELEMETRY": "False",
    "LITELLM_LOG": "ERROR",
    "NO_DOCS": "True",
    "NO_REDOC": "True",
    "DISABLE_ADMIN_UI": "True",
    # LiteLLM ends a stream with an error after 100 identical chunks ("the model is
    # repeating the same chunk"); every token of the mock is "tok ".
    "REPEATED_STREAMING_CHUNK_LIMIT": "1000000",
}


class PeerUnavailable(Exception):
    """The peer cannot be installed or started here; ``str()`` says why."""


def _bin(name: str) -> pathlib.Path:
    return VENV / "bin" / name


def version() -> str:
    """The pinned LiteLLM version."""
    return LITELLM_VERSION


def ensure_installed() -> pathlib.Path:
    """Create ``benchmarks/.peers`` and install LiteLLM there if needed; return ``litellm``'s path.

    Raises:
        PeerUnavailable: the venv cannot be created or pip fails (the last lines of its output).
    """
    litellm = _bin("litellm")
    stamp = VENV / f".installed-{LITELLM_VERSION}"
    if litellm.exists() and stamp.exists():
        return litellm
    print(f"   installing {REQUIREMENT} into {VENV} (first use) ...", file=sys.stderr, flush=True)
    steps = [
        [sys.executable, "-m", "venv", str(VENV)],
        [str(_bin("python")), "-m", "pip", "install", "--quiet", REQUIREMENT],
    ]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            lines = [line for line in (done.stdout + done.stderr).splitlines() if not line.startswith("WARNING")]
            raise PeerUnavailable(f"`{' '.join(step[-3:])}` failed: {' | '.join(lines[-3:])}")
    if not litellm.exists():
        raise PeerUnavailable(f"{REQUIREMENT} installed no `litellm` command")
    stamp.touch()
    return litellm


def free_port() -> int:
    """A loopback port that was free a moment ago (LiteLLM cannot report a port-0 bind)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def litellm_command(backend_port: int, workdir: pathlib.Path) -> tuple[list[str], dict[str, str], int]:
    """Install if needed and return ``(argv, extra env, port)`` of a LiteLLM proxy for the mock.

    Raises:
        PeerUnavailable: LiteLLM cannot be installed here.
    """
    litellm = ensure_installed()
    config = workdir / "litellm.yaml"
    config.write_text(CONFIG.format(backend_port=backend_port))
    port = free_port()
    argv = [str(litellm), "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    return argv, dict(ENV), port


_PROBE = json.dumps({"model": "mock", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}).encode()


async def start_litellm(backend_port: int, workdir: pathlib.Path, daemons: list[Daemon]) -> int:
    """Start a LiteLLM proxy in front of the mock backend; return its port once it answers."""
    argv, env, port = await trio.to_thread.run_sync(litellm_command, backend_port, workdir)
    litellm = Daemon("litellm", argv, workdir, env)
    daemons.append(litellm)
    probe = HttpConnection("127.0.0.1", port)

    async def answers() -> bool:
        try:
            status, _ = await probe.request(HttpConnection.build("POST", "/v1/chat/completions", _PROBE))
        except OSError:
            return False
        if status != 200:
            raise BenchmarkFailed(f"LiteLLM answered {status} to a chat completion:\n{litellm.tail()}")
        return True

    with trio.move_on_after(120):  # its first start imports a lot
        while not await answers():
            litellm.check_alive()
            await trio.sleep(0.25)
        await probe.aclose()
        return port
    raise BenchmarkFailed(f"LiteLLM did not answer within 120 s:\n{litellm.tail()}")
