"""The wire versions spoken at once: the current and the previous one (docs/wire.md, Versioning).

One table says what each version adds to the one before and how a message of it is said to a
peer of that one (:data:`_TO_PREVIOUS`); :func:`run_for` walks it down to the peer's version.
The daemons build every message in the current version's shape and ask this module for a
peer's frame, so no version branch lives above the link.

Adding version n+1 is a change here: append it to :data:`PROTOCOL_VERSIONS` and drop the oldest,
give it its row in :data:`_TO_PREVIOUS` (what n+1 adds, taken out for an n peer) and drop the
row of the version that is now the oldest.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Final

from ._messages import Run

PROTOCOL_VERSIONS: Final = (4, 5)
"""The versions this package speaks: the previous and the current. An Edge accepts nodes of
either; a node offers the current one and falls back to the previous."""

PROTOCOL_VERSION: Final = PROTOCOL_VERSIONS[-1]
"""The current version: the one a node offers first in :class:`~iop_wire.Register`."""

OLDEST_PROTOCOL: Final = PROTOCOL_VERSIONS[0]
"""The previous version: a node refused at it has no older one to offer."""

_RunAndBody = tuple[Run, str | None]
"""A run and the client's body text it carries as is (:func:`~iop_wire.encode_run`), or None."""


def _v5_run_to_v4(run: Run, body_json: str | None) -> _RunAndBody:
    """v5 adds ``run.model`` (the client's body as sent): a v4 peer gets the body with the upstream
    model (and ``stream``) put in, re-encoded (:meth:`Run.for_upstream`)."""
    if body_json is not None:
        run = Run(
            run.run_id, run.provider, run.endpoint, _object(body_json), run.stream, run.epoch, run.long, run.model
        )
    return run.for_upstream(), None


_TO_PREVIOUS: Final[dict[int, Callable[[Run, str | None], _RunAndBody]]] = {
    5: _v5_run_to_v4,
}
"""For every version spoken above the oldest: its run as the version before reads it."""


def run_for(version: int, run: Run, body_json: str | None = None) -> _RunAndBody:
    """``run`` (built in the current version's shape, ``body_json`` its client's body text when
    its body is empty) as a peer of ``version`` reads it.

    Raises:
        ValueError: ``version`` is not one of :data:`PROTOCOL_VERSIONS`.
    """
    if version not in PROTOCOL_VERSIONS:
        raise ValueError(f"wire v{version} is not spoken (speaks {spoken()})")
    for newer in reversed(PROTOCOL_VERSIONS):
        if newer == version:
            break
        run, body_json = _TO_PREVIOUS[newer](run, body_json)
    return run, body_json


def spoken() -> str:
    """The versions spoken, for a reason or a log line: ``"4 and 5"``."""
    *older, newest = PROTOCOL_VERSIONS
    return f"{', '.join(map(str, older))} and {newest}" if older else str(newest)


def _object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if type(value) is not dict:
        raise ValueError("a run's body must be a JSON object")
    return value
