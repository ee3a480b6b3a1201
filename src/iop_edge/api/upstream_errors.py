"""A backend's own error answer, reshaped as an OpenAI error object for the client.

When a backend refuses a request (a 4xx, or 429), the Node reports its status and
body on the wire (``run_end.upstream_status`` / ``upstream_body``) and the Edge
answers the client with that status and this object (contract:
``docs/openai-api.md``, "Backend errors"). Which failures get here is decided by
``iop_wire.failure_kind``; this module only shapes the body.

The shapes met in practice:

- OpenAI's ``{"error": {"message", "type", "param", "code"}}`` (OpenAI, vLLM,
  llama.cpp's servers, the mock backend): the four fields are kept as they are;
  a missing or non-string ``type`` falls back to the status's default.
- Ollama's ``{"error": "text"}``: the text becomes ``message``.
- FastAPI's validation answer ``{"detail": ...}`` (a 422): ``detail`` becomes
  ``message`` (as JSON text when it is not a string).
- Anything else (plain text, HTML, an empty body): wrapped, the text (or the
  node's message) as ``message``.
"""

from __future__ import annotations

import json
from typing import Any, Final

_SCALARS: Final = (str, int, float, bool, type(None))


def default_error_type(status: int) -> str:
    """The OpenAI error ``type`` for a backend status when its body names none."""
    if status == 429:
        return "rate_limit_error"
    if status == 404:
        return "not_found_error"
    return "invalid_request_error"


def upstream_error_object(status: int, body: str | None, fallback_message: str) -> dict[str, Any]:
    """Build the OpenAI error object for a backend's error answer.

    Args:
        status: the backend's HTTP status.
        body: the backend's error body as text, or None when the node sent none.
        fallback_message: the node's message, used when the body carries none.

    Returns:
        ``{"message": str, "type": str, "param": ..., "code": ...}``; ``param`` and
        ``code`` are the backend's when they are JSON scalars, else None.
    """
    error: dict[str, Any] = {
        "message": fallback_message,
        "type": default_error_type(status),
        "param": None,
        "code": None,
    }
    text = (body or "").strip()
    if not text:
        return error
    try:
        value = json.loads(text)
    except ValueError:
        error["message"] = text
        return error
    if not isinstance(value, dict):
        error["message"] = text
        return error
    inner = value.get("error")
    if isinstance(inner, dict):
        message = inner.get("message")
        if message is not None:
            error["message"] = message if isinstance(message, str) else json.dumps(message)
        if isinstance(inner.get("type"), str) and inner["type"]:
            error["type"] = inner["type"]
        for field in ("param", "code"):
            value = inner.get(field)
            if isinstance(value, _SCALARS):
                error[field] = value
    elif isinstance(inner, str):
        error["message"] = inner
    elif "detail" in value:
        detail = value["detail"]
        error["message"] = detail if isinstance(detail, str) else json.dumps(detail, ensure_ascii=False)
    else:
        error["message"] = text
    return error
