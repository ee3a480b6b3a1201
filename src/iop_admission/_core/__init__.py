"""The sans-I/O admission core: the only code that changes admission state.

Like h11's connection object, this package does no I/O, has no clock of its own
(time is passed in as ``now``) and does not import trio. Every method is
synchronous and returns *decisions* -- :class:`Granted`, :class:`Failed`,
:class:`Revoked` -- that the layers (``iop_admission._layers``) carries out by
waking parked tasks or cancelling lease bodies. The Hypothesis state machine
drives it directly.

Composition: :class:`~iop_admission.core.AdmissionState` (``state.py``) walks
each request through its parts, as h11's ``Connection`` holds a
``ConnectionState``; each part owns its state behind a few methods:

* ``pool.py`` -- :class:`Pool`, slots and choice: providers, nodes, model
  groups and their choice index (``slots.py``, ``choice.py``); what a lease
  holds of a provider is counted in and out there only.
* ``queue.py`` -- :class:`Queue`, waiting: the global queue in arrival order,
  queued retries, deadlines, the requeue after a refresh.
* ``health.py`` -- :class:`Health`: ejection, probe, restore, stale reports; every
  change of a provider's health by its one table, ``TRANSITIONS``.
* ``tenants.py`` -- :class:`Tenants`: FairShare tickets, quotas, shedding,
  settlement; answers as the global FIFO when no tenant is configured.
* ``refresh.py`` -- :class:`Refresh`: the configuration in force, replaced live.
* ``dispatch.py`` -- :class:`Dispatcher`: a grant, and the hand-off of freed
  room to the earliest waiters that can use it.
* ``budgets.py`` -- :class:`Budgets`: the waiters passed over on a provider's
  token budget, and the headroom a departure gives back ([token-ledger]; each
  budget itself is a ``TokenLedger`` on its ``ProviderSlot``).

The queries of the state (configuration, waiters, generations, snapshot rows) are
:class:`~iop_admission._snapshot.StateReadings`, beside the frozen views they return;
``AdmissionState`` adds the calls that change the state.

Why it is built this way:

* **One state per provider.** A :class:`ProviderSlot` holds capacity and the
  in-flight counters for every model group that lists it ([provider-state],
  [long-state]). Model groups hold only references to provider states.

* **Hand-off, decided synchronously.** Whenever capacity may have appeared
  (release, fence, connect, refresh) the core grants waiters right away, before
  returning. A granted waiter owns its lease from that instant even though its
  task has not run yet, exactly like ``trio.CapacityLimiter``. Hence *work
  conservation* holds after every method: no queued waiter has a dispatchable
  candidate. A newcomer is therefore granted only a provider no earlier waiter
  could use -- it never overtakes.

* **Global arrival order without scanning.** Each model group keeps its
  waiters, normal and long separately, in arrival order. Arrival numbers only
  grow, so each is a FIFO deque with lazy deletion; a waiter that leaves
  (granted, cancelled, failed) is skipped when it reaches the front, and a
  deque is compacted when its dead entries outnumber its live ones. Waiters of
  one group share their candidates, so when a head cannot run, nobody behind
  it can. After a release on provider P the next waiter is the earliest head,
  over the groups listing P, that has a dispatchable candidate (the long head
  only when a long slot is free): one release costs O(groups of P),
  independent of queue length. A long waiter blocked on long slots is simply
  not looked at: the normal waiter behind it runs (no head-of-line blocking)
  [cross-group-wakeup].

* **Candidate choice is indexed** [candidate-choice-scale]. The rule --
  highest priority, then lowest ``in_flight / capacity``, then candidate
  order -- is kept per model group as a heap of dispatchable candidates with
  lazy deletion (see :class:`ModelGroup`); a change of a provider's load,
  eligibility or spec re-enters it in every group listing it, O(log n) each
  (:meth:`ProviderSlot.reindex`). Choosing costs the same with two candidates
  or ten thousand. Whoever changes what makes a provider eligible or loaded must
  call ``reindex`` afterwards. A group of one candidate keeps no heap: its
  choice is that candidate when it has room, read from the candidate itself
  (not admitting, it would put the group in panic mode, which chooses it all
  the same); so a grant or a release that changes only the load of a provider
  listed in no group of several needs no reindex (``ProviderSlot.indexed``),
  the short path of the usual lease.

* **Passive health** [outlier-ejection]. Every lease can carry one report,
  failure or success. ``outlier.consecutive_failures`` failures in a row
  eject the provider until a time (``base_ejection`` doubled per ejection in a
  row, capped at ``max_ejection``); :meth:`AdmissionState.advance` ends it, and
  then exactly one *probe* grant may run; its success restores the provider,
  its failure ejects it again for longer. A provider that is ejected or has
  its probe out is not *admitting*: it leaves its groups' choice heaps like a
  full provider (``reindex`` reads ``admitting``). Eligibility (config,
  enabled, connected) is unchanged, so an ejected provider never makes a
  waiter ``Unavailable``. Panic mode: a group whose every eligible candidate is
  non-admitting chooses among them anyway (a scan of its candidates, paid only
  in panic), so ejection never turns a model key with a single bad provider
  into one that admits nothing. A report is *stale* -- and changes nothing --
  when its lease was already reported, its node generation is over, or the
  provider changed health epoch (ejected or restored) since the grant:
  failures of leases granted before an ejection do not lengthen it.

* **Retry keeps the arrival place** [failover-before-first-byte]. Every
  request draws its arrival number when it asks, granted at once or queued.
  :meth:`AdmissionState.retry` asks again for the same request on a candidate
  it has not tried, with that old number and its old queue deadline. A queued
  retry does not share its group's candidates (it excludes the tried ones), so
  it waits in a short list of its own, in arrival order, which ``_dispatch``
  looks at beside the group heads: no later arrival that could use the same
  provider overtakes it. Retries are few (one per failed attempt), and each
  costs a scan of its candidates.

* **Runs held elsewhere** [held-elsewhere]. :meth:`AdmissionState.hold` sets
  a count of runs on a provider that this state did not grant (another
  Edge's, docs/ha.md), and how many of them are long; they are added to
  ``in_flight`` and ``long_in_flight``, so every capacity and long-slot check
  and the choice rule see them, and a lower count hands the room to waiters.

* **Generations fence.** ``connect`` starts a new generation of a node;
  ``disconnect`` with the current generation takes the node offline and
  revokes every live lease on its providers: the lease is no longer live
  (``in_flight`` of the fenced generation reads 0 at once, its tenant's slot
  is free), its body is told to stop (:class:`Revoked`), and each lease is
  still released exactly once, by its holder.

* **Capacity held until the body has left** [revoked-in-flight]. A revoked
  lease's body may still be running (trio runs it to its next checkpoint; an
  asyncio body may catch the cancellation), so its provider capacity (and
  long slot) comes back only when the holder releases it, at the body's exit.
  Until then it is *revoked, still running*: counted apart from ``in_flight``
  (``revoked_in_flight``, ``revoked_long_in_flight`` of the snapshot) and,
  with it, against capacity in every check and in the choice rule. So running
  bodies never exceed a provider's capacity, whatever a fenced body does.
"""
