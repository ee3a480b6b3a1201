"""The whole-system check's counting backend: an OpenAI-shaped server that records what it ran.

Independent of the project's mock on purpose (a few dozen lines on h11): it is the witness. Each
chat completion request is one *execution*: the line it writes to its log holds the request's
marker (the last message's content), the backend's label (one backend per provider), and the
system-wide monotonic times of its arrival and its end. A request runs ``--latency-ms`` unless
its client goes away first (the Node cancelled it): then it ends at once, as an engine that
stops generating would, and is logged ``abandoned``.

Run: ``python -m tests.system.backend --label node-a/gpu0 --log FILE [--latency-ms 150]``; it
prints ``counting backend listening on PORT`` on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import h11
import trio

ANSWER = {
    "id": "chatcmpl-counted",
    "object": "chat.completion",
    "created": 0,
    "model": "counted",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


def marker_of(body: bytes) -> str:
    """The request's marker: its last message's content (the clients put a unique one there)."""
    messages: list[dict[str, Any]] = json.loads(body).get("messages") or [{}]
    return str(messages[-1].get("content", ""))


class Log:
    """One JSON line per execution, flushed at once (the checker reads it after a SIGKILL too)."""

    def __init__(self, path: str, label: str) -> None:
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 -- open for the process's life
        self.label = label

    def write(self, marker: str, arrival: float, end: float, outcome: str) -> None:
        line = {"marker": marker, "provider": self.label, "arrival": arrival, "end": end, "outcome": outcome}
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()


async def serve_connection(stream: trio.SocketStream, log: Log, latency: float) -> None:
    conn = h11.Connection(h11.SERVER)
    while True:
        body = b""
        method = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                if not data:
                    return
                conn.receive_data(data)
            elif isinstance(event, h11.Request):
                method = event.method
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                return
        if method == b"GET":  # the Node's readiness probe (GET /v1/models): not an execution
            models = b'{"object":"list","data":[]}'
            head = h11.Response(status_code=200, headers=[("content-length", str(len(models)))])
            await stream.send_all(conn.send(head) + conn.send(h11.Data(data=models)) + conn.send(h11.EndOfMessage()))
            conn.start_next_cycle()
            continue
        arrival = time.monotonic()
        marker = marker_of(body) if body else ""
        outcome = "answered"
        deadline = trio.current_time() + latency
        while outcome == "answered" and trio.current_time() < deadline:
            with trio.move_on_at(deadline):
                data = await stream.receive_some(65536)  # b"": the client left (the Node cancelled the run)
                if not data:
                    outcome = "abandoned"
                else:
                    conn.receive_data(data)  # not expected before the answer; kept for the next cycle
        if outcome == "abandoned":
            log.write(marker, arrival, time.monotonic(), outcome)
            return
        payload = json.dumps(ANSWER).encode()
        headers = [("content-type", "application/json"), ("content-length", str(len(payload)))]
        try:
            await stream.send_all(conn.send(h11.Response(status_code=200, headers=headers)) or b"")
            await stream.send_all(conn.send(h11.Data(data=payload)) or b"")
            await stream.send_all(conn.send(h11.EndOfMessage()) or b"")
        except trio.BrokenResourceError:
            outcome = "abandoned"
        log.write(marker, arrival, time.monotonic(), outcome)
        if outcome == "abandoned" or conn.our_state is h11.MUST_CLOSE:
            return
        conn.start_next_cycle()


async def main(label: str, log_path: str, latency: float) -> None:
    log = Log(log_path, label)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    print(f"counting backend listening on {port}", file=sys.stderr, flush=True)

    async def handler(stream: trio.SocketStream) -> None:
        try:
            await serve_connection(stream, log, latency)
        except (trio.BrokenResourceError, h11.RemoteProtocolError):
            pass
        finally:
            await stream.aclose()

    await trio.serve_listeners(handler, listeners)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m tests.system.backend")
    parser.add_argument("--label", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--latency-ms", type=float, default=150.0)
    args = parser.parse_args()
    trio.run(main, args.label, args.log, args.latency_ms / 1000)
