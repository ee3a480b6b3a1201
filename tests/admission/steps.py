"""Small steps the sans-I/O tests of the core share: narrowing what ``request`` or ``retry`` returned."""

from __future__ import annotations

from iop_admission.core import Lease, Waiter

__all__ = ["as_lease", "as_waiter"]


def as_lease(result: Lease | Waiter) -> Lease:
    """``result``, which must be a lease (granted at once)."""
    assert isinstance(result, Lease), result
    return result


def as_waiter(result: Lease | Waiter) -> Waiter:
    """``result``, which must be a waiter (queued)."""
    assert isinstance(result, Waiter), result
    return result
