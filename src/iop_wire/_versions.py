"""The wire versions spoken at once: the current and the previous one (docs/wire.md, Versioning).

One table (:data:`_ADDED`) says what each version adds to the one before and how a message of it
is said to a peer of that one: a run from the Edge, an end code and a health report from the node,
and which message types are new in it. :func:`run_for`, :func:`end_code_for` and :func:`health_for`
walk it down to the peer's version, :func:`speaks` says whether a peer reads a message type. The daemons build every message in the
current version's shape and ask this module for a peer's frame, so no version branch lives above
the link.

Adding version n+1 is a change here: append it to :data:`PROTOCOL_VERSIONS` and drop the oldest,
give it its row in :data:`_ADDED` (what n+1 adds, taken out for an n peer) and drop the row of the
version that is now the oldest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final, final

import attrs

from ._messages import Message, ProviderHealth, Run

PROTOCOL_VERSIONS: Final = (6, 7)
"""The versions this package speaks: the previous and the current. An Edge accepts nodes of
either; a node offers the current one and falls back to the previous."""

PROTOCOL_VERSION: Final = PROTOCOL_VERSIONS[-1]
"""The current version: the one a node offers first in :class:`~iop_wire.Register`."""

OLDEST_PROTOCOL: Final = PROTOCOL_VERSIONS[0]
"""The previous version: a node refused at it has no older one to offer."""

_RunAndBody = tuple[Run, str | None]
"""A run and the client's body text it carries as is (:func:`~iop_wire.encode_run`), or None."""


def _as_is(run: Run, body_json: str | None) -> _RunAndBody:
    return run, body_json


def _health_as_is(health: ProviderHealth) -> ProviderHealth:
    return health


@final
@attrs.frozen
class _Added:
    """What a version adds to the one before, as a peer of that one is told it."""

    run_to_previous: Callable[[Run, str | None], _RunAndBody] = _as_is
    """Its run as a peer of the version before reads it (what it added, taken out)."""
    end_codes: Mapping[str, str] = attrs.field(factory=dict)
    """Its new ``run_end`` codes in the words of the version before."""
    messages: frozenset[type[Message]] = frozenset()
    """The message types new in it: never sent to a peer of the version before (:func:`speaks`)."""
    health_to_previous: Callable[[ProviderHealth], ProviderHealth] = _health_as_is
    """Its ``provider_health`` as a peer of the version before reads it (what it added, taken out)."""


def _v7_health_to_v6(health: ProviderHealth) -> ProviderHealth:
    """v7 adds ``provider_health.engine`` (the engine's own view of its KV cache, [token-ledger]):
    a v6 peer gets the report without it (its Edge does not cut a budget by the engine's view)."""
    return health if health.engine is None else attrs.evolve(health, engine=None)


_ADDED: Final[dict[int, _Added]] = {
    7: _Added(health_to_previous=_v7_health_to_v6),
}
"""For every version spoken above the oldest: what it adds to the version before."""


def run_for(version: int, run: Run, body_json: str | None = None) -> _RunAndBody:
    """``run`` (built in the current version's shape, ``body_json`` its client's body text when
    its body is empty) as a peer of ``version`` reads it.

    Raises:
        ValueError: ``version`` is not one of :data:`PROTOCOL_VERSIONS`.
    """
    for newer in _newer_than(version):
        run, body_json = _ADDED[newer].run_to_previous(run, body_json)
    return run, body_json


def end_code_for(version: int, code: str | None) -> str | None:
    """A ``run_end`` code (the current version's) as a peer of ``version`` reads it.

    Raises:
        ValueError: ``version`` is not one of :data:`PROTOCOL_VERSIONS`.
    """
    for newer in _newer_than(version):
        if code is not None:
            code = _ADDED[newer].end_codes.get(code, code)
    return code


def health_for(version: int, health: ProviderHealth) -> ProviderHealth:
    """``health`` (built in the current version's shape) as a peer of ``version`` reads it.

    Raises:
        ValueError: ``version`` is not one of :data:`PROTOCOL_VERSIONS`.
    """
    for newer in _newer_than(version):
        health = _ADDED[newer].health_to_previous(health)
    return health


def speaks(version: int, message: type[Message]) -> bool:
    """Whether a peer of ``version`` reads messages of type ``message`` (not one a later version added).

    Raises:
        ValueError: ``version`` is not one of :data:`PROTOCOL_VERSIONS`.
    """
    return not any(message in _ADDED[newer].messages for newer in _newer_than(version))


def _newer_than(version: int) -> list[int]:
    """The versions spoken above ``version``, newest first: the rows to walk down to it."""
    if version not in PROTOCOL_VERSIONS:
        raise ValueError(f"wire v{version} is not spoken (speaks {spoken()})")
    return [newer for newer in reversed(PROTOCOL_VERSIONS) if newer > version]


def spoken() -> str:
    """The versions spoken, for a reason or a log line: ``"6 and 7"``."""
    *older, newest = PROTOCOL_VERSIONS
    return f"{', '.join(map(str, older))} and {newest}" if older else str(newest)
