"""iop_mock: a fake LLM backend for tests, benchmarks and ``make run``.

:mod:`iop_mock.backend` is the ``iop-mock-backend`` server (its command line and serving in
:mod:`iop_mock.cli`) (OpenAI- and
Ollama-compatible, records its peak concurrency on ``GET /stats``);
:mod:`iop_mock.completion` builds the fake completion objects it serves, and is
also what the Node's in-process ``mock`` adapter answers with. Nothing here
imports the Edge or the Node.

Its pieces are public for the tests that hold them: :class:`Pacer` (every stream's token
schedule on one timer) and :func:`serve_asgi` (the small HTTP/1.1 server it runs on).
"""

from ._pacing import Pacer
from ._server import serve_asgi
from .backend import MockBackend
from .cli import main, serve_mock_backend

__all__ = ["MockBackend", "Pacer", "main", "serve_asgi", "serve_mock_backend"]
