"""The bytes of the mock backend's answers: JSON bodies, SSE and NDJSON frames, error objects."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from typing import Any

# ASGI servers pass TypedDicts; a raw ASGI app reads them as mappings and sends plain dicts.
Scope = Mapping[str, Any]
Message = Mapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Any], Awaitable[None]]

encode_json = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode

JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
NDJSON_HEADERS = [(b"content-type", b"application/x-ndjson")]
SSE_DONE = b"data: [DONE]\n\n"


def sse_frame(chunk: dict[str, Any]) -> bytes:
    return b"data: " + encode_json(chunk).encode() + b"\n\n"


def ndjson_frame(line: dict[str, Any]) -> bytes:
    return encode_json(line).encode() + b"\n"


def frames(objects: Iterable[dict[str, Any]], frame: Callable[[dict[str, Any]], bytes]) -> Iterator[bytes]:
    """Encode each object once; an object equal to the previous one reuses its bytes."""
    previous: dict[str, Any] | None = None
    encoded = b""
    for obj in objects:
        if obj != previous:
            previous, encoded = obj, frame(obj)
        yield encoded


def error_body(message: str, code: str, error_type: str = "invalid_request_error") -> bytes:
    return encode_json({"error": {"message": message, "type": error_type, "param": None, "code": code}}).encode()


async def send_json(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*JSON_HEADERS, (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
