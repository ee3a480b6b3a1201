"""Test your own use of :mod:`iop_admission`: property-based race runs on either layer.

Hypothesis draws programs -- requests (queued and immediate, long and short,
per tenant), bodies that end or fail, cancellations while queued and while
holding, node disconnects and reconnects (which revoke leases), refreshes that
remove providers with live leases or change capacities and timeouts, and
clock advances -- from *your* ``PoolConfig``; :func:`run_program` carries one
out against a new admission, with *your* code taking the leases, on virtual
time, and checks after every step what the library promises:

* no counter negative;
* nothing leaked: every live lease belongs to a call still inside its
  ``async with``, every queued waiter to a call still waiting;
* a grant goes only to a configured, enabled, connected provider with room:
  capacity and long slots are never exceeded;
* FIFO within a tenant: no call enters while an earlier call of the same
  tenant still waits that could have used its slot (same model and kind, or
  a model listing the provider of the lease the client's ``async with`` gave);
* calls end normally, by the body's failure, by cancellation, or with an
  admission error that answers a request (never a misuse error);
* every lease is released once (exactly once, by the end of the run), and at
  the end nothing is queued or leased and every counter is 0.

Usage (docs/testing.md walks through it)::

    from hypothesis import given, settings
    from iop_admission.testing import programs, run_program

    @settings(max_examples=100, deadline=None)
    @given(program=programs(CONFIG))
    def test_my_guard(program):
        run_program(program, CONFIG, layer="asyncio", client=my_client)

Also here: :class:`VirtualTimeLoop` (asyncio on virtual time, the fake clock
of the asyncio layer; trio has ``trio.testing.MockClock``) and the two layers
as :class:`Layer` objects, to write one scenario for both.

Hypothesis is an optional dependency: ``pip install "iop-admission[testing]"``.
"""

try:
    import hypothesis  # noqa: F401
except ImportError:  # pragma: no cover - tests/library/test_testing_module.py runs it in a subprocess
    raise ImportError('iop_admission.testing needs Hypothesis: pip install "iop-admission[testing]"') from None

from ._calls import BodyFailed, Call
from ._layers import AsyncioLayer, Handle, Layer, Signal, Spawn, TrioLayer, VirtualTimeLoop
from ._program import (
    Advance,
    Ask,
    Cancel,
    Disconnect,
    Finish,
    Reconnect,
    Refresh,
    Step,
    config_variants,
    programs,
    steps,
)
from ._runner import Client, lease_directly, run_program

__all__ = [
    "Advance",
    "Ask",
    "AsyncioLayer",
    "BodyFailed",
    "Call",
    "Cancel",
    "Client",
    "Disconnect",
    "Finish",
    "Handle",
    "Layer",
    "Reconnect",
    "Refresh",
    "Signal",
    "Spawn",
    "Step",
    "TrioLayer",
    "VirtualTimeLoop",
    "config_variants",
    "lease_directly",
    "programs",
    "run_program",
    "steps",
]
