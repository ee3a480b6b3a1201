"""What the admission core hands out: leases, waiters, and the decisions it returns.

Plain records of :class:`~iop_admission.core.AdmissionState` (``_state.py``):
their private attributes are the core's bookkeeping, read and written only by
the core's modules.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, final

from iop_admission._config import ProviderKey
from iop_admission._errors import AdmissionError
from iop_admission._fairness import DEFAULT_TENANT, Ticket

if TYPE_CHECKING:
    from .slots import ModelGroup, ProviderSlot


@final
class WaiterState(enum.Enum):
    """Where a waiter is: ``QUEUED``, then exactly one of the others, for good."""

    QUEUED = "queued"
    GRANTED = "granted"
    FAILED = "failed"
    WITHDRAWN = "withdrawn"  # cancelled or timed out by its own task
    TIMED_OUT = "timed_out"  # expired by AdmissionState.expire()


QUEUED = WaiterState.QUEUED
GRANTED = WaiterState.GRANTED
FAILED = WaiterState.FAILED
WITHDRAWN = WaiterState.WITHDRAWN
TIMED_OUT = WaiterState.TIMED_OUT


@final
class Lease:
    """The right to run one request on one provider.

    A lease is created by a grant and released exactly once, by the holder's
    scope exit. Fencing its generation revokes it first (``revoked`` is true):
    it is no longer live, but its capacity stays counted until the release
    ([revoked-in-flight]).

    Attributes:
        id: unique (per :class:`AdmissionState`) lease number.
        provider: the provider the request runs on.
        generation: the node generation the lease belongs to.
        long: whether it holds a long-context slot too.
        model: the model key it was requested for.
        queue_wait: seconds spent queued before the grant (set by the trio layer).
        arrival: the request's arrival number (kept by its retries).
        enqueue_time: when the request first asked (its queue deadline counts from it).
        attempt: 1 for the first attempt, 2 for the first retry, ...
        tried: providers of this and every earlier attempt, in order.
        probe: whether this lease is its provider's probe after an ejection.
        tenant: the tenant it is charged to ([tenant-fair-share]; ``"default"`` without tenants).
        cost: the cost reserved for it (1 per request, or estimated tokens).
        tokens: the request's context tokens as asked (prompt plus output), or None ([token-ledger]).
    """

    __slots__ = (
        "tenant",
        "cost",
        "tokens",
        "_ticket",
        "id",
        "provider",
        "generation",
        "long",
        "model",
        "queue_wait",
        "arrival",
        "enqueue_time",
        "attempt",
        "tried",
        "probe",
        "_slot",
        "_released",
        "_revoked",
        "_epoch",
        "_reported",
        "_retried",
    )

    def __init__(
        self,
        id: int,
        slot: ProviderSlot,
        model: str,
        long: bool,
        arrival: int,
        enqueue_time: float,
        attempt: int,
        tried: tuple[ProviderKey, ...],
    ) -> None:
        self.id = id
        self.provider: ProviderKey = slot.key
        self.generation = slot.node.generation
        self.long = long
        self.model = model
        self.queue_wait = 0.0
        self.arrival = arrival
        self.enqueue_time = enqueue_time
        self.attempt = attempt
        self.tried: tuple[ProviderKey, ...] = (*tried, slot.key)
        self.probe = False
        self.tenant = DEFAULT_TENANT
        self.cost = 1.0
        self.tokens: int | None = None
        self._ticket: Ticket | None = None  # its FairShare ticket while tenants are configured
        self._slot = slot
        self._released = False
        self._revoked = False
        self._epoch = slot.epoch
        self._reported = False
        self._retried = False

    @property
    def released(self) -> bool:
        """True once the lease no longer counts against its provider (its holder released it)."""
        return self._released

    @property
    def revoked(self) -> bool:
        """True if fencing its generation revoked the lease (its body is told to stop)."""
        return self._revoked

    @property
    def reserved_tokens(self) -> int:
        """Context tokens it holds of its provider's budget now (0 without a budget, or once released)."""
        ledger = self._slot.ledger
        return 0 if ledger is None else ledger.holding(self.id)

    def __repr__(self) -> str:
        state = "revoked" if self._revoked else "released" if self._released else "live"
        kind = " long" if self.long else ""
        kind += " probe" if self.probe else ""
        kind += f" attempt {self.attempt}" if self.attempt > 1 else ""
        return f"<Lease {self.id} {self.provider} gen {self.generation}{kind} model {self.model!r} {state}>"


@final
class Waiter:
    """A request queued at the Edge with no provider yet.

    Attributes:
        seq: global arrival number; grants follow it among waiters that can use
            the same provider.
        model, long: what was requested.
        enqueue_time, deadline: in the caller's clock; ``deadline`` is
            ``enqueue_time + policy.queue_timeout`` and moves with a refresh.
        state: a :class:`WaiterState`, compared by identity.
        lease: the granted lease, once ``state == "granted"``.
        error: the failure, once ``state == "failed"``.
        attempt, tried: for a retry, its attempt number and the providers
            already tried (never candidates again); 1 and ``()`` otherwise.
        tenant, cost: the tenant it is charged to and its reserved cost.
        tokens: the request's context tokens as asked, or None ([token-ledger]).
    """

    __slots__ = (
        "tenant",
        "cost",
        "tokens",
        "_ticket",
        "seq",
        "model",
        "long",
        "enqueue_time",
        "deadline",
        "state",
        "lease",
        "error",
        "attempt",
        "tried",
        "_candidates",
        "_group",
        "_passed",
    )

    def __init__(
        self,
        seq: int,
        model: str,
        long: bool,
        now: float,
        deadline: float,
        attempt: int = 1,
        tried: tuple[ProviderKey, ...] = (),
        tokens: int | None = None,
    ) -> None:
        self.seq = seq
        self.model = model
        self.long = long
        self.enqueue_time = now
        self.deadline = deadline
        self.attempt = attempt
        self.tried = tried
        self.state: WaiterState = QUEUED
        self.lease: Lease | None = None
        self.error: AdmissionError | None = None
        self.tenant = DEFAULT_TENANT
        self.cost = 1.0
        self.tokens = tokens
        self._ticket: Ticket | None = None  # its FairShare ticket while tenants are configured
        self._candidates: tuple[ProviderSlot, ...] = ()
        self._group: ModelGroup | None = None  # the model group whose deque holds us while queued
        self._passed: list[ProviderSlot] | None = None  # providers whose ledgers count it passed over

    @property
    def candidates(self) -> tuple[ProviderKey, ...]:
        """The waiter's candidate providers, in preference order."""
        return tuple(p.key for p in self._candidates)

    def __repr__(self) -> str:
        kind = " long" if self.long else ""
        kind += f" attempt {self.attempt}" if self.attempt > 1 else ""
        return f"<Waiter {self.seq} {self.model!r}{kind} {self.state.value}>"


@final
class Granted:
    """Decision: ``waiter`` now holds ``lease``; wake it with the lease."""

    __slots__ = ("waiter", "lease")

    def __init__(self, waiter: Waiter, lease: Lease) -> None:
        self.waiter = waiter
        self.lease = lease

    def __repr__(self) -> str:
        return f"Granted({self.waiter!r}, {self.lease!r})"


@final
class Failed:
    """Decision: ``waiter`` left the queue with ``error``; wake it with the error."""

    __slots__ = ("waiter", "error")

    def __init__(self, waiter: Waiter, error: AdmissionError) -> None:
        self.waiter = waiter
        self.error = error

    def __repr__(self) -> str:
        return f"Failed({self.waiter!r}, {type(self.error).__name__})"


@final
class Revoked:
    """Decision: ``lease`` was released by fencing; cancel its body."""

    __slots__ = ("lease",)

    def __init__(self, lease: Lease) -> None:
        self.lease = lease

    def __repr__(self) -> str:
        return f"Revoked({self.lease!r})"


@final
class Ejected:
    """Decision: ``provider`` is ejected until ``until`` (``duration`` seconds) after ``failures`` failures."""

    __slots__ = ("provider", "until", "duration", "failures")

    def __init__(self, provider: ProviderKey, until: float, duration: float, failures: int) -> None:
        self.provider = provider
        self.until = until
        self.duration = duration
        self.failures = failures

    def __repr__(self) -> str:
        return f"Ejected({self.provider}, {self.duration}s after {self.failures} failures)"


@final
class Restored:
    """Decision: ``provider`` is admitting again after a success."""

    __slots__ = ("provider",)

    def __init__(self, provider: ProviderKey) -> None:
        self.provider = provider

    def __repr__(self) -> str:
        return f"Restored({self.provider})"


@final
class BudgetChanged:
    """Decision: the engine's report moved ``provider``'s effective token budget from ``before`` to
    ``budget`` tokens: lowered by a cut, or raised as the cut shrank or ended ([token-ledger])."""

    __slots__ = ("provider", "before", "budget")

    def __init__(self, provider: ProviderKey, before: int, budget: int) -> None:
        self.provider = provider
        self.before = before
        self.budget = budget

    def __repr__(self) -> str:
        return f"BudgetChanged({self.provider}, {self.before} -> {self.budget} tokens)"


Decision = Granted | Failed | Revoked | Ejected | Restored | BudgetChanged
