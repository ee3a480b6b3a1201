"""llama.cpp's server (llama-cpp-python) as a child process of the real tier's tests."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import trio

from e2e.harness import POLL_INTERVAL, Daemon, DaemonExited, Stack

LLAMA_READY_TIMEOUT = 180.0
"""Seconds the server has to load the model and answer ``GET /v1/models``."""
N_CTX = 2048


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def llama_argv(model: Path, port: int) -> list[str]:
    """The arguments after ``python`` that start llama.cpp's server for ``model`` on ``port``.

    ``--interrupt_requests false``: by default llama-cpp-python ends a running stream with
    ``data: [DONE]`` (no ``finish_reason``) as soon as another request waits for the model, and
    the Node's readiness probe (``GET /v1/models``) is such a request: every stream would be cut
    short, and look complete.
    """
    return [
        "-m", "llama_cpp.server", "--model", str(model), "--chat_format", "gemma",
        "--n_ctx", str(N_CTX), "--embedding", "true", "--host", "127.0.0.1", "--port", str(port),
        "--interrupt_requests", "false",
    ]  # fmt: skip


async def llama_answers(stack: Stack, port: int) -> bool:
    """Whether llama.cpp's server on ``port`` answers ``GET /v1/models`` with 200 (it binds its port
    only once the model is loaded)."""
    try:
        response = await stack.http.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
    except httpx.TransportError:
        return False
    return response.status_code == 200


async def start_llama(stack: Stack, model: Path, port: int, *, wait: bool = True) -> Daemon:
    """Start llama.cpp's server on ``port`` as a child of ``stack`` (reaped with it); with ``wait``,
    return once it answers ``/v1/models``.

    Raises:
        DaemonExited: it exited before answering.
        trio.TooSlowError: not ready within ``LLAMA_READY_TIMEOUT``.
    """
    daemon = await stack.spawn("llama", llama_argv(model, port))
    if wait:
        await llama_ready(stack, daemon, port)
    return daemon


async def llama_ready(stack: Stack, daemon: Daemon, port: int) -> None:
    """Wait until ``daemon`` (llama.cpp's server on ``port``) answers ``/v1/models``."""
    with trio.fail_after(LLAMA_READY_TIMEOUT):
        while not await llama_answers(stack, port):
            if not daemon.running:
                raise DaemonExited(f"llama.cpp server exited:\n{daemon.stderr()[-4000:]}")
            await trio.sleep(POLL_INTERVAL)
