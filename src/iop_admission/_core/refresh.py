"""Live refresh of the pool configuration: leases and waiters are kept."""

from __future__ import annotations

from collections.abc import Callable

from iop_admission._config import PoolConfig, validate_pool
from iop_admission._errors import ModelNotFound, Unavailable

from .choice import could_run, groups_of, untried
from .health import HealthRules
from .prepared import PreparedRefresh, prepare_refresh
from .records import FAILED, Decision, Failed, Waiter


class RefreshRules(HealthRules):
    """The refresh side of :class:`~iop_admission.core.AdmissionState`."""

    def prepare_refresh(self, config: PoolConfig, pause: Callable[[], None] | None = None) -> PreparedRefresh:
        """:func:`prepare_refresh` against the configuration in force now (reads nothing else).

        Safe in a worker thread while this state changes on another.

        Raises:
            ConfigError: listing every problem of ``config``.
        """
        return prepare_refresh(config, self._config, pause)

    def refresh(self, config: PoolConfig | PreparedRefresh) -> list[Decision]:
        """Apply a new configuration atomically; leases are kept.

        Validates first (on error nothing changes). Then: provider specs are
        replaced (a provider dropped from the config keeps its live leases
        until they end, but takes no new work); model groups are replaced;
        every queued waiter gets its model's new candidates and the deadline
        ``enqueue_time + new queue_timeout``; a waiter whose model is gone
        fails with :class:`ModelNotFound`, one with no eligible candidate left
        with :class:`Unavailable`; finally waiters are re-evaluated in arrival
        order against every provider.

        A :class:`PreparedRefresh` applies its configuration with exactly the
        same outcome. Prepared against the configuration in force, only what
        it changes is touched: the providers whose spec changed (or that were
        added or removed) and the model groups whose candidates changed; the
        other groups keep their index and their waiters' places (O(changes +
        queued waiters)). Otherwise the whole configuration is installed.

        Raises:
            ConfigError: listing every problem; the state is unchanged.
        """
        if isinstance(config, PreparedRefresh):
            if config.base is self._config:
                return self._refresh_changes(config)
            config = config.config
        validate_pool(config)
        self._set_config(config)
        for p in self._providers.values():
            p.configured = False
        self._install(config)
        for p in tuple(self._providers.values()):
            if not p.configured:
                self._forget_health(p)
                p.forget_held()  # [held-elsewhere] a provider that leaves the config forgets them
                if not p.busy:
                    self._drop_retired(p)
        decisions = self._requeue()
        decisions.extend(self._dispatch(self._groups.values()))
        return decisions

    def _refresh_changes(self, prepared: PreparedRefresh) -> list[Decision]:
        """Apply ``prepared`` to the configuration it was prepared against: only what changed.

        The outcome is :meth:`refresh`'s. Groups whose candidates did not change
        are kept, with their counts, index and queued waiters; providers whose
        spec did not change are not touched. Only the groups built anew and the
        groups of changed providers can gain a dispatchable candidate, so only
        they are dispatched (every other waiter could not run before and still cannot).
        """
        config = prepared.config
        tenants_changed = self._set_config(config)
        providers = self._providers
        for name in (*prepared.groups, *prepared.dropped):
            old = self._groups.get(name)
            for p in old.providers if old is not None else ():
                p.groups = [entry for entry in p.groups if entry[0] is not old]
        touched = [providers[key] for key in prepared.removed]
        for p in touched:
            p.configured = False
        for key in prepared.changed:
            p = providers[key]
            p.set_spec(config.providers[key])
            touched.append(p)
        touched.extend(self._configure(key, config.providers[key]) for key in prepared.added)
        built = {name: self._build_group(name, config.models[name].candidates) for name in prepared.groups}
        kept = self._groups
        self._groups = {name: built[name] if name in built else kept[name] for name in config.models}
        if not prepared.same_order:
            self._configured = tuple(map(providers.__getitem__, config.providers))
        for p in touched:
            p.update_eligibility()
        for key in prepared.removed:
            p = providers[key]
            self._forget_health(p)
            p.forget_held()
            if not p.busy:
                self._drop_retired(p)
        decisions = self._requeue()
        # New tenant caps or bands can make any group's waiter dispatchable.
        groups = self._groups.values() if tenants_changed else groups_of(touched, built.values())
        decisions.extend(self._dispatch(groups))
        return decisions

    def _set_config(self, config: PoolConfig) -> bool:
        """Put ``config``'s policy and tenants in force; whether the tenants changed."""
        self._config = config
        self._max_queue = config.policy.max_queue
        self._timeout = config.policy.queue_timeout
        return self._set_tenants(config.tenants)

    def _requeue(self) -> list[Decision]:
        """After a refresh: each queued waiter's new deadline, candidates and place, in arrival order.

        A waiter of a model key that is gone fails with ModelNotFound, one whose
        candidates can no longer run it with Unavailable. A waiter whose group
        was kept stays where it is; the others join their new group's queue.
        """
        decisions: list[Decision] = []
        retries: list[Waiter] = []
        for w in tuple(self._waiters.values()):
            group = self._groups.get(w.model)
            if group is None:
                w._group = None
                decisions.append(self._fail_unindexed(w, ModelNotFound(w.model)))
                continue
            w.deadline = w.enqueue_time + self._timeout
            if w.attempt > 1:  # a queued retry: its own candidates, its own list
                w._candidates = untried(group.providers, w.tried)
                if could_run(w._candidates, w.long):
                    retries.append(w)
                else:
                    decisions.append(self._fail_unindexed(w, Unavailable(w.model, w.long)))
                continue
            if w._group is group:  # a kept group: the waiter keeps its place
                if not group.could_run(w.long):
                    self._remove(w, FAILED)
                    w.error = Unavailable(w.model, w.long)
                    decisions.append(Failed(w, w.error))
                continue
            w._group = None
            w._candidates = group.providers
            if group.could_run(w.long):
                group.enqueue(w)
            else:
                decisions.append(self._fail_unindexed(w, Unavailable(w.model, w.long)))
        self._retries = retries
        return decisions
