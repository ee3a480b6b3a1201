"""The refresh part of the admission core: the configuration in force, replaced live (leases and waiters kept).

A refresh may be prepared off the event loop (:func:`prepare_refresh`: a
validated configuration and what it changes), then applied by :class:`Refresh`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import final

from iop_admission._config import PoolConfig, ProviderKey, paced, validate_pool

from .choice import groups_of
from .dispatch import Dispatcher
from .health import Health
from .pool import Pool
from .queue import Queue
from .records import Decision
from .slots import ProviderSlot
from .tenants import Tenants


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


class Refresh:
    """The configuration in force, and how a new one is put in force in every other part."""

    __slots__ = ("config", "_pool", "_queue", "_health", "_tenants", "_dispatcher")

    def __init__(
        self, config: PoolConfig, pool: Pool, queue: Queue, health: Health, tenants: Tenants, dispatcher: Dispatcher
    ) -> None:
        self.config = config
        self._pool = pool
        self._queue = queue
        self._health = health
        self._tenants = tenants
        self._dispatcher = dispatcher

    def prepare(self, config: PoolConfig, pause: Callable[[], None] | None = None) -> PreparedRefresh:
        """:func:`prepare_refresh` against the configuration in force now (reads nothing else)."""
        return prepare_refresh(config, self.config, pause)

    def apply(self, config: PoolConfig | PreparedRefresh) -> list[Decision]:
        """:meth:`AdmissionState.refresh <iop_admission.core.AdmissionState.refresh>`."""
        if isinstance(config, PreparedRefresh):
            if config.base is self.config:
                return self._apply_changes(config)
            config = config.config
        validate_pool(config)
        pool = self._pool
        self._set_config(config)
        for p in pool.providers.values():
            p.configured = False
        pool.install(config)
        for p in tuple(pool.providers.values()):
            if not p.configured:
                self._retire(p)
        decisions = self._queue.requeue(pool.groups)
        decisions.extend(self._dispatcher.dispatch(pool.groups.values()))
        return decisions

    def _apply_changes(self, prepared: PreparedRefresh) -> list[Decision]:
        """Apply ``prepared`` to the configuration it was prepared against: only what changed.

        The outcome is :meth:`apply`'s. Groups whose candidates did not change
        are kept, with their counts, index and queued waiters; providers whose
        spec did not change are not touched. Only the groups built anew and the
        groups of changed providers can gain a dispatchable candidate, so only
        they are dispatched (every other waiter could not run before and still cannot).
        """
        config = prepared.config
        pool = self._pool
        tenants_changed = self._set_config(config)
        providers = pool.providers
        for name in (*prepared.groups, *prepared.dropped):
            old = pool.groups.get(name)
            for p in old.providers if old is not None else ():
                p.groups = [entry for entry in p.groups if entry[0] is not old]
        touched = [providers[key] for key in prepared.removed]
        for p in touched:
            p.configured = False
        for key in prepared.changed:
            p = providers[key]
            p.set_spec(config.providers[key])
            touched.append(p)
        touched.extend(pool.configure(key, config.providers[key]) for key in prepared.added)
        built = {name: pool.build_group(name, config.models[name].candidates) for name in prepared.groups}
        kept = pool.groups
        pool.groups = {name: built[name] if name in built else kept[name] for name in config.models}
        if not prepared.same_order:
            pool.configured = tuple(map(providers.__getitem__, config.providers))
        for p in touched:
            p.update_eligibility()
        for key in prepared.removed:
            self._retire(providers[key])
        decisions = self._queue.requeue(pool.groups)
        # New tenant caps or bands can make any group's waiter dispatchable.
        groups = pool.groups.values() if tenants_changed else groups_of(touched, built.values())
        decisions.extend(self._dispatcher.dispatch(groups))
        return decisions

    def _retire(self, p: ProviderSlot) -> None:
        """``p`` left the config: healthy if it comes back, its runs held elsewhere forgotten
        ([held-elsewhere]), dropped at once if nothing runs on it."""
        self._health.forget(p)
        p.forget_held()
        if not p.busy:
            self._pool.drop(p)

    def _set_config(self, config: PoolConfig) -> bool:
        """Put ``config``'s policies and tenants in force; whether the tenants changed."""
        self.config = config
        self._queue.set_policy(config.policy)
        self._health.outlier = config.outlier
        return self._tenants.configure(config.tenants, self._queue.waiters.values(), self._pool.providers.values())
