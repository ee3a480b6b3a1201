"""How a secret a client presents is compared: :func:`presented_bytes`."""

from __future__ import annotations


def presented_bytes(token: str) -> bytes:
    """The bytes a client sent as a token. A header value, or a query value, is read as latin-1 (one
    character per byte), so this gives back exactly those bytes; a configured secret is its UTF-8, and
    the two are compared as bytes: ``tök`` matches only the client's UTF-8 ``t\\xc3\\xb6k``, never
    its latin-1 ``t\\xf6k``.
    """
    return token.encode("latin-1")
