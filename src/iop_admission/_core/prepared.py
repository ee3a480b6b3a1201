"""A refresh prepared off the event loop: a validated configuration and what it changes."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import final

from iop_admission._config import PoolConfig, ProviderKey, paced, validate_pool


@final
class PreparedRefresh:
    """A validated configuration and what it changes against the one in force when prepared.

    Made by :func:`prepare_refresh` from the two (immutable) configurations
    only, so it can be made in a worker thread while the state keeps
    changing; :meth:`AdmissionState.refresh` applies it. Applied to the
    configuration it was compared with, the refresh touches only what changed;
    applied to any other (a refresh came in between), it is applied whole.

    Attributes:
        config: the configuration to put in force.
    """

    __slots__ = ("config", "base", "added", "changed", "removed", "groups", "dropped", "same_order")

    def __init__(self, config: PoolConfig, base: PoolConfig) -> None:
        self.config = config
        self.base = base  # the configuration the differences below are against
        self.added: list[ProviderKey] = []  # providers configured now and not in base, in config order
        self.changed: list[ProviderKey] = []  # providers in both whose spec differs
        self.removed: list[ProviderKey] = []  # providers in base only
        self.groups: list[str] = []  # model keys new or with other candidates, in config order
        self.dropped: list[str] = []  # model keys in base only
        self.same_order = False  # the configured providers are base's, in base's order

    def __repr__(self) -> str:
        return (
            f"<PreparedRefresh +{len(self.added)} ~{len(self.changed)} -{len(self.removed)} providers,"
            f" {len(self.groups)} model groups new or changed>"
        )


def prepare_refresh(config: PoolConfig, base: PoolConfig, pause: Callable[[], None] | None = None) -> PreparedRefresh:
    """Validate ``config`` and find what it changes against ``base``; reads nothing else.

    O(providers + candidates), pure: safe in a worker thread. ``pause``: see
    :func:`validate_pool`.

    Raises:
        ConfigError: listing every problem of ``config``.
    """
    validate_pool(config, pause=pause)
    prepared = PreparedRefresh(config, base)
    old, new = base.providers, config.providers
    for key, spec in paced(new.items(), pause):
        before = old.get(key)
        if before is None:
            prepared.added.append(key)
        elif before is not spec and before != spec:
            prepared.changed.append(key)
    if len(old) + len(prepared.added) != len(new):
        prepared.removed = [key for key in paced(old, pause) if key not in new]
    prepared.same_order = not prepared.added and not prepared.removed and _same_items(old, new, pause)
    old_models = base.models
    for name, group in config.models.items():
        before_group = old_models.get(name)
        if before_group is None or not _same_items(before_group.candidates, group.candidates, pause):
            prepared.groups.append(name)
    prepared.dropped = [name for name in old_models if name not in config.models]
    return prepared


def _same_items(old: Iterable[object], new: Iterable[object], pause: Callable[[], None] | None) -> bool:
    """Whether ``old`` and ``new`` hold equal items in the same order (``pause``: as in :func:`paced`)."""
    done = object()
    pairs = itertools.zip_longest(old, new, fillvalue=done)
    return all(a is b or a == b for a, b in paced(pairs, pause))
