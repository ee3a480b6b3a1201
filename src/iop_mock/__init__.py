"""iop_mock: a fake LLM backend for tests, benchmarks and ``make run``.

:mod:`iop_mock.backend` is the ``iop-mock-backend`` server (its command line and serving in
:mod:`iop_mock.cli`) (OpenAI- and
Ollama-compatible, records its peak concurrency on ``GET /stats``);
:mod:`iop_mock.completion` builds the fake completion objects it serves, and is
also what the Node's in-process ``mock`` adapter answers with. Nothing here
imports the Edge or the Node.
"""

from .backend import MockBackend
from .cli import main, serve_mock_backend

__all__ = ["MockBackend", "main", "serve_mock_backend"]
