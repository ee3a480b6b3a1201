"""An independent counting backend for the HA chaos tests: the witness of what really ran.

Not the project's mock (nothing of the project is imported): an OpenAI-style
``POST /<provider>/v1/chat/completions`` answering after ``--latency-ms``, that
records each request's marker (its last message's content), its arrival and its
end (the answer written, or the client gone: a cancelled run ends when its node
closes the connection), and each provider's concurrency (the first path
segment: the node's ``base_url`` names the provider). ``GET /stats``:
``{"arrivals": [marker, ...] in arrival order, "executions": {marker: count},
"in_flight": {provider: n}, "peak": {provider: n}}``.

Run as a script: ``python counting_backend.py --port 0 --latency-ms 400``; it
prints ``counting-backend listening on http://127.0.0.1:<port>`` on stderr.
"""

from __future__ import annotations

import argparse
import collections
import json
import select
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

READY = "counting-backend listening on http://127.0.0.1:"


class Record:
    """What ran: every counter under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.arrivals: list[str] = []
        self.executions: collections.Counter[str] = collections.Counter()
        self.in_flight: collections.Counter[str] = collections.Counter()
        self.peak: collections.Counter[str] = collections.Counter()

    def began(self, provider: str, marker: str) -> None:
        with self.lock:
            self.arrivals.append(marker)
            self.executions[marker] += 1
            self.in_flight[provider] += 1
            self.peak[provider] = max(self.peak[provider], self.in_flight[provider])

    def ended(self, provider: str) -> None:
        with self.lock:
            self.in_flight[provider] -= 1

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {
                "arrivals": list(self.arrivals),
                "executions": dict(self.executions),
                "in_flight": dict(self.in_flight),
                "peak": dict(self.peak),
            }


def client_gone_within(connection: socket.socket, seconds: float) -> bool:
    """Wait ``seconds`` unless the client closes its connection first (then True)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([connection], [], [], left)
        if readable and not connection.recv(1, socket.MSG_PEEK):
            return True
    return False


def handler(record: Record, latency: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def answer(self, status: int, document: object) -> None:
            body = json.dumps(document).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self.answer(200, record.stats()) if self.path == "/stats" else self.answer(404, {})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))))
            provider = self.path.strip("/").split("/")[0]
            marker = str(body["messages"][-1]["content"])
            record.began(provider, marker)
            try:
                if client_gone_within(self.connection, latency):
                    self.close_connection = True
                    return
                message = {"role": "assistant", "content": "ok"}
                self.answer(
                    200,
                    {
                        "id": "c",
                        "object": "chat.completion",
                        "created": 0,
                        "model": body.get("model", ""),
                        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                    },
                )
            finally:
                record.ended(provider)

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency-ms", type=float, default=400)
    args = parser.parse_args()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), handler(Record(), args.latency_ms / 1000))
    server.daemon_threads = True
    print(f"{READY}{server.server_address[1]}", file=sys.stderr, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
