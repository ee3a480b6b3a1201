"""Node-local concurrency gate: reject at once, never queue.

The Node guards every adapter instance with this gate ([tunnel-guard],
[runtime-concurrency]). Both execution paths -- normalized runs and raw tunnel
requests, foreground and background -- take a permit *before* the adapter opens
an upstream request. There is deliberately no wait queue here: the Edge owns the
one fair queue, and a Node that queued too would hide overload from it.

The gate is synchronous and has no trio dependency: taking or returning a
permit never yields, so a cancelled task cannot skip the release.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import final

import attrs

from ._errors import ConcurrencyLimitExceeded


@final
@attrs.frozen
class GateStatistics:
    """Frozen view of a :class:`LocalGate`.

    Attributes:
        in_use: permits held per name.
        limits: configured limit per name.
        total_in_use: permits held across all names.
        global_limit: node-wide limit, or None when unbounded.
        rejected: total number of rejected ``try_acquire`` calls.
    """

    in_use: Mapping[str, int]
    limits: Mapping[str, int]
    total_in_use: int
    global_limit: int | None
    rejected: int


@final
class Permit:
    """One permit of a :class:`LocalGate`; returned exactly once.

    The permit is already held when :meth:`LocalGate.try_acquire` returns. Return
    it by leaving a ``with`` block or by calling :meth:`release`; a second
    release is a no-op, so a permit handed to a background task cannot be
    returned twice.
    """

    __slots__ = ("_gate", "name", "_held")

    def __init__(self, gate: LocalGate, name: str) -> None:
        self._gate = gate
        self.name = name
        self._held = True

    @property
    def held(self) -> bool:
        """True until the permit is released."""
        return self._held

    def release(self) -> None:
        """Return the permit to its gate. Idempotent."""
        if self._held:
            self._held = False
            self._gate._release(self.name)

    def __enter__(self) -> Permit:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "held" if self._held else "released"
        return f"<Permit {self.name!r} {state}>"


@final
class LocalGate:
    """Per-name and node-wide concurrency limits that reject instead of waiting.

    Args:
        limits: max concurrent permits per name (e.g. per provider id); each >= 1.
        global_limit: max concurrent permits across all names, or None.

    Example::

        gate = LocalGate(limits={"gpu0": 1}, global_limit=4)
        with gate.try_acquire("gpu0"):
            ...  # open the upstream request
    """

    def __init__(self, limits: Mapping[str, int], global_limit: int | None = None) -> None:
        problems = [
            f"limits[{name!r}]: must be an integer >= 1, got {limit!r}"
            for name, limit in limits.items()
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1
        ]
        if global_limit is not None and (
            not isinstance(global_limit, int) or isinstance(global_limit, bool) or global_limit < 1
        ):
            problems.append(f"global_limit: must be an integer >= 1 or None, got {global_limit!r}")
        if problems:
            from ._errors import ConfigError

            raise ConfigError(problems)
        self._limits = dict(limits)
        self._in_use = dict.fromkeys(self._limits, 0)
        self._global_limit = global_limit
        self._total = 0
        self._rejected = 0

    def try_acquire(self, name: str) -> Permit:
        """Take one permit for ``name`` now, or fail at once.

        Does not checkpoint (it is synchronous).

        Raises:
            ConcurrencyLimitExceeded: the per-name or the global limit is reached.
            KeyError: ``name`` has no configured limit.
        """
        try:
            used = self._in_use[name]
        except KeyError:
            raise KeyError(f"LocalGate has no limit for {name!r}") from None
        limit = self._limits[name]
        if used >= limit:
            self._rejected += 1
            raise ConcurrencyLimitExceeded(name, "provider", limit)
        if self._global_limit is not None and self._total >= self._global_limit:
            self._rejected += 1
            raise ConcurrencyLimitExceeded(name, "global", self._global_limit)
        self._in_use[name] = used + 1
        self._total += 1
        return Permit(self, name)

    def _release(self, name: str) -> None:
        self._in_use[name] -= 1
        self._total -= 1

    def statistics(self) -> GateStatistics:
        """Return a frozen view of the permits in use."""
        return GateStatistics(
            in_use=dict(self._in_use),
            limits=dict(self._limits),
            total_in_use=self._total,
            global_limit=self._global_limit,
            rejected=self._rejected,
        )

    def __repr__(self) -> str:
        parts = ", ".join(f"{n} {self._in_use[n]}/{lim}" for n, lim in self._limits.items())
        glob = "" if self._global_limit is None else f"; {self._total}/{self._global_limit} global"
        return f"<LocalGate {parts}{glob}>"
