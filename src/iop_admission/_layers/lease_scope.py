"""The trio layer's lease scope: the ``async with`` that :meth:`Admission.lease` returns."""

from __future__ import annotations

from types import TracebackType
from typing import final

import trio

from iop_admission._errors import LeaseScopeError
from iop_admission.core import Lease

from .trio_handoff import Handoff

__all__ = ["LeaseScope"]


@final
class LeaseScope:
    """The async context manager :meth:`Admission.lease` and :meth:`Admission.retry` return:
    single use, a thin shell over the admission's acquire (on entry) and release (on exit)."""

    __slots__ = (
        "_handoff",
        "_model",
        "_long",
        "_lease",
        "_entered",
        "_retry_of",
        "_reason",
        "_tenant",
        "_cost",
        "_revocable",
        "_tokens",
    )

    def __init__(
        self,
        handoff: Handoff,
        model: str,
        long: bool,
        retry_of: Lease | None = None,
        reason: str | None = None,
        tenant: str | None = None,
        cost: float = 1.0,
        revocable: bool = True,
        tokens: int | None = None,
    ) -> None:
        self._handoff = handoff
        self._model = model
        self._long = long
        self._lease: Lease | None = None
        self._entered = False
        self._retry_of = retry_of
        self._reason = reason
        self._tenant = tenant
        self._cost = cost
        self._revocable = revocable
        self._tokens = tokens

    async def __aenter__(self) -> Lease:
        if self._entered:
            raise LeaseScopeError("a lease scope can be entered only once")
        self._entered = True
        try:
            self._lease = await self._handoff.acquire(
                self._model,
                self._long,
                self._retry_of,
                self._reason,
                self._tenant,
                self._cost,
                self._revocable,
                self._tokens,
            )
        except RuntimeError as exc:
            if trio.lowlevel.in_trio_run():
                raise
            raise RuntimeError(
                "Admission.lease() runs under trio only; under asyncio use iop_admission.aio.AsyncAdmission"
            ) from exc
        return self._lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        lease = self._lease
        if lease is None:
            raise LeaseScopeError("a lease scope can be exited only after it was entered")
        self._lease = None
        return self._handoff.release(lease, exc_type, exc, tb)
