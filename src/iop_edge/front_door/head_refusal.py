"""The head refusal: which completion requests the Edge refuses before their body is read.

One owner decides ([overload-shed], a full queue, the API key): :class:`HeadRefusal`
asks the front door (:class:`~iop_edge.front_door.overload.FrontDoor`) whether to shed or
whether the queue is full, checks the API key, counts the refusal and books the
client's return. The listener asks it on each request head (``refuse_head``);
the app asks it when the listener did not (another server, a query string), and
for the ``Retry-After`` of the queue's own refusals. A request is decided on
once: one the listener let through passed all three, its key included.
"""

from __future__ import annotations

import math
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING, Any, final

import trio

from iop_admission import AdmissionError
from iop_edge.api.rejections import CANNED_MAX, RequestRejected, admission_rejection, bearer, canned
from iop_edge.api.tenant_charge import charge_of
from iop_edge.front_door.queue_room import refuses_queue_full
from iop_edge.listener.cycle import ConnectionHooks
from iop_edge.listener.pacing import Headers
from iop_edge.listener.server import CannedResponse

if TYPE_CHECKING:
    from iop_edge.api.app import EdgeParts
    from iop_edge.config import EdgeConfig

COMPLETION_TARGETS = frozenset((b"/v1/chat/completions", b"/v1/completions", b"/v1/embeddings"))
"""The request targets a flood can be refused on, before a scope is built (:meth:`HeadRefusal.refuse`)."""


def _no_estimate() -> int:
    return 1  # the head has no body: a tenant's name needs no token estimate


@final
class HeadRefusal:
    """The refusals decided on a completion request's head, for one Edge (its :class:`EdgeParts`)."""

    def __init__(self, service: EdgeParts) -> None:
        self._service = service
        self._capacity_of: tuple[EdgeConfig | None, int] = (None, 0)
        self._head_refusals: dict[tuple[str, int, int], CannedResponse] = {}
        self._unauthorized: CannedResponse | None = None  # the 401 on the head, built once
        self._refusal_counters: dict[str, Callable[[], None]] = {}

    def refuse(self, method: bytes, target: bytes, headers: Headers) -> tuple[CannedResponse, float] | None:
        """The listener's ``refuse_head``: a completion request refused on its head, or None.

        Asked before a scope is built: the refusal is a response encoded once per
        kind and the time before which the connection is not read again (the
        client's booked return; a 401 books none). Anything else -- another route,
        a query string, a request that is not refused -- goes to the app as usual,
        which does not check it again.
        """
        if method != b"POST" or target not in COMPLETION_TARGETS:
            return None
        try:
            return self.refused(headers)
        except RequestRejected as rejection:  # the API key: refused before the body is read, no pause
            if self._unauthorized is None:
                head, body = canned(rejection)
                self._unauthorized = CannedResponse(rejection.status, head, body)
            return self._unauthorized, -math.inf

    def refuse_request(
        self, scope: MutableMapping[str, Any], hooks: ConnectionHooks | None
    ) -> tuple[CannedResponse, float] | None:
        """The app's question for a completion request: its refusal on the head, or None (go on).

        Decided once per request: when the listener asked :meth:`refuse` on this
        request's head (``hooks.head_let_through``, and the target is exactly a
        completion target without a query string, as :meth:`refuse` asks) and it
        let the request through, that decision stands (its API key included);
        otherwise it is decided here.

        Raises:
            RequestRejected: 401 when an API key is required and missing or wrong.
        """
        if self.let_through_by_listener(scope, hooks):
            return None
        return self.refused(scope["headers"])

    @staticmethod
    def let_through_by_listener(scope: MutableMapping[str, Any], hooks: ConnectionHooks | None) -> bool:
        """Whether the listener asked :meth:`refuse` on this request's head and it let the request
        through (the target is exactly a completion target without a query string, as :meth:`refuse` asks)."""
        return bool(
            hooks is not None
            and hooks.head_let_through
            and not scope["query_string"]
            and scope["raw_path"] in COMPLETION_TARGETS
        )

    def refused(self, headers: Headers) -> tuple[CannedResponse, float] | None:
        """The refusals decided before the body is read: overload, authorization, a full queue.

        Returns:
            For 503 ``overloaded`` ([overload-shed]) or 429 ``queue_full`` (the
            queue is full and the requests already asking for a lease fill it and
            every free slot, :meth:`FrontDoor.queue_full`: no request, whatever its
            model, could run or queue now; with tenants, only when admission too
            would answer this request ``queue_full``, :meth:`tenant_refuses`): the canned response, with the
            client's return booked, and the time before which its connection is
            not read again. None when the request may go on.

        Raises:
            RequestRejected: 401 when an API key is required and missing or wrong.
        """
        service = self._service
        door = service.front_door
        now = trio.current_time()
        if door.shed(service.admission.queue_depth):
            code = "overloaded"
        else:
            self.authorize(headers)
            max_queue = service.config.provider_pool.max_queue
            full = door.queue_full(max_queue, self.capacity(), service.admission.queue_depth, now)
            tenant = self.tenant_of(headers)
            if not full or not self.tenant_refuses(tenant, now):
                door.let_through(now, tenant)
                return None
            code = "queue_full"
        count = self._refusal_counters.get(code)
        if count is None:
            count = self._refusal_counters[code] = service.metrics.rejection_counter("", code)
        count()
        retry_after, delay = door.refusal(now, self.capacity())
        return self._refusal_on_head(code, retry_after), now + delay

    def tenant_of(self, headers: Headers) -> str | None:
        """The tenant a request with ``headers`` is charged to ([tenant-edge]), as the app names it;
        None without tenants."""
        config = self._service.config
        return charge_of(config, headers, _no_estimate).tenant if config.tenants else None

    def gave_up(self, scope: MutableMapping[str, Any]) -> None:
        """The request of ``scope``, let through on its head, ends without asking for a lease."""
        self._service.front_door.gave_up(self.tenant_of(scope["headers"]))

    def tenant_refuses(self, tenant: str | None, now: float) -> bool:
        """Whether admission too would refuse ``tenant``'s request ``queue_full``, the front door's
        tenant-blind count having found the queue full ([tenant-quotas]).

        Without tenants it would. With tenants, :func:`refuses_queue_full` decides from the
        tenants' rows and the requests in transit by tenant: a sheddable flood or a tenant at its
        own ``max_queue`` never turns another tenant's request into ``queue_full`` on the head.
        """
        service = self._service
        if not service.config.tenants:
            return True  # one queue: the front door's count is the whole rule
        snapshot = service.admission.snapshot(count=0)
        max_queue = service.config.provider_pool.max_queue
        transit = service.front_door.in_transit(now)
        return refuses_queue_full(tenant, snapshot.tenants, snapshot.queue_depth, max_queue, transit)

    def _refusal_on_head(self, code: str, retry_after: int) -> CannedResponse:
        """The canned ``overloaded`` or ``queue_full`` answer with ``retry_after``, built once per kind."""
        max_queue = self._service.config.provider_pool.max_queue
        key = (code, retry_after, max_queue)
        response = self._head_refusals.get(key)
        if response is None:
            if code == "overloaded":
                rejection = RequestRejected(
                    503, code, "the Edge is overloaded; retry later", type="service_unavailable"
                )
            else:
                message = f"the queue is full ({max_queue} waiting) and every provider is busy"
                rejection = RequestRejected(429, code, message, type="rate_limit_error")
            rejection.retry_after = retry_after
            head, body = canned(rejection)
            response = CannedResponse(rejection.status, head, body, retry_after)
            if len(self._head_refusals) < CANNED_MAX:
                self._head_refusals[key] = response
        return response

    def booked(self, rejection: RequestRejected, *, pace: bool = True) -> RequestRejected:
        """``rejection`` with the client's return booked: its ``Retry-After`` and (``pace``) the
        pause before its connection is read again (the front door's return schedule)."""
        now = trio.current_time()
        rejection.retry_after, delay = self._service.front_door.refusal(now, self.capacity())
        rejection.read_after = now + delay if pace else None
        return rejection

    def admission_refusal(self, exc: AdmissionError) -> RequestRejected:
        """The answer to an admission error; the queue's refusals book the client's return.

        A ``queue_timeout`` is not paced: that client already waited ``queue_timeout_ms``.
        """
        rejection = admission_rejection(exc)
        if rejection.code in ("queue_full", "queue_timeout"):
            self.booked(rejection, pace=rejection.code == "queue_full")
        return rejection

    def capacity(self) -> int:
        """Concurrent slots of every enabled provider in the config in force (cached per config)."""
        config = self._service.config
        if config is not self._capacity_of[0]:
            capacity = sum(p.capacity for node in config.nodes for p in node.providers if p.enabled)
            self._capacity_of = (config, capacity)
        return self._capacity_of[1]

    def authorize(self, headers: Headers) -> None:
        config = self._service.config
        if not config.api_keys_required:
            return
        key = bearer(headers)
        if key is None or not config.accepts_api_key(key):
            raise RequestRejected(
                401,
                "invalid_api_key",
                "a valid API key is required (Authorization: Bearer ...)",
                type="authentication_error",
            )
