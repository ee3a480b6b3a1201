"""The refusals of a request (fixed status and text), the rules on its target, and llhttp's errors mapped onto them.

The verdicts :class:`iop_http.RequestReader` gives (:mod:`iop_http.reader` lists
its rules, ``docs/security.md`` their RFC sections). A refusal's text is fixed:
it never carries the request's bytes.
"""

from __future__ import annotations

import re
from typing import Final, final

MAX_LENGTH_DIGITS: Final = 18  # below 2**63: a length every parser holds in a machine word
_ABSOLUTE: Final = re.compile(rb"(?i:https?)://([^/?#]*)([^#]*)")
AUTHORITY: Final = re.compile(rb"[-A-Za-z0-9._~%!$&'()*+,;=:\[\]]*")
"""A ``Host`` value (or an absolute target's authority) the reader takes."""


@final
class Refusal:
    """A refused request: answer ``status`` with ``reason`` (fixed text), then close the connection."""

    __slots__ = ("status", "reason")

    def __init__(self, status: int, reason: str) -> None:
        self.status = status
        self.reason = reason

    def __repr__(self) -> str:
        return f"<Refusal {self.status} {self.reason}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Refusal) and (self.status, self.reason) == (other.status, other.reason)

    def __hash__(self) -> int:
        return hash((self.status, self.reason))


TOO_LARGE: Final = Refusal(431, "request head too large")
NOT_A_HEAD: Final = Refusal(400, "request head not terminated by an empty line")
BARE: Final = Refusal(400, "bare CR or LF in the request head")
BAD_REQUEST_LINE: Final = Refusal(400, "malformed request line")
VERSION: Final = Refusal(505, "HTTP version not supported")
BAD_TARGET: Final = Refusal(400, "request target is not a path")
OBS_FOLD: Final = Refusal(400, "folded header line (obs-fold)")
BAD_FIELD: Final = Refusal(400, "malformed header field")
BAD_LENGTH: Final = Refusal(400, "content-length is not a number")
LENGTHS: Final = Refusal(400, "several content-length fields")
BAD_HOST: Final = Refusal(400, "missing, repeated or malformed host")
LENGTH_AND_CODING: Final = Refusal(400, "both content-length and transfer-encoding")
CODING_IN_1_0: Final = Refusal(400, "transfer-encoding in an HTTP/1.0 request")
CODING: Final = Refusal(501, "transfer-encoding other than chunked")
UPGRADE_WITH_BODY: Final = Refusal(400, "protocol upgrade with a body")
MALFORMED_HEAD: Final = Refusal(400, "malformed request head")
MALFORMED_CHUNKS: Final = Refusal(400, "malformed chunked body")
"""The refusal of a chunked body whose framing llhttp refuses."""
CHUNK_EXTENSIONS_TOO_LONG: Final = Refusal(400, "chunk extensions too long")
"""The refusal of a chunked body whose extensions and trailer fields pass their bound (RFC 9112 §7.1.1)."""

LLHTTP_ERRORS: Final = (
    ("can't be present with", LENGTH_AND_CODING),
    ("Transfer-Encoding", CODING),  # a coding after chunked, a repeated chunked: not a single final chunked
    ("Duplicate Content-Length", LENGTHS),
    ("Content-Length", BAD_LENGTH),
    ("whitespace after header value", OBS_FOLD),
    ("HTTP version", VERSION),
    ("Expected CRLF", BARE),
    ("Missing expected LF", BARE),
    ("Missing expected CR", BARE),
    ("Expected LF", BARE),
    ("header", BAD_FIELD),
    ("method", BAD_REQUEST_LINE),
    ("url", BAD_TARGET),
    ("Expected HTTP/", BAD_REQUEST_LINE),
)
"""llhttp's error reasons (fragments, first match wins) and the refusal each maps onto; any other: 400."""


def routed(method: bytes, target: bytes) -> bytes | None:
    """The origin form ``target`` is routed by, or None when it is no target this server takes."""
    if target[:1] == b"/":
        return target
    if target == b"*":
        return target if method == b"OPTIONS" else None
    absolute = _ABSOLUTE.fullmatch(target)
    if absolute is None or method == b"CONNECT":
        return None
    authority, rest = absolute.groups()
    if not authority or AUTHORITY.fullmatch(authority) is None or b"@" in authority:
        return None
    if rest[:1] == b"/":
        return rest
    return b"/" + rest if rest[:1] == b"?" or not rest else None


def refusal_for(error: str, in_head: bool) -> Refusal:
    """The refusal for llhttp's ``error`` (its reason text), in a head or in a chunked body."""
    if not in_head:
        return MALFORMED_CHUNKS
    for fragment, refusal in LLHTTP_ERRORS:
        if fragment in error:
            return refusal
    return MALFORMED_HEAD
