"""The Edge's HTTP API: a raw ASGI app served by the Edge's own HTTP/1.1 listener (``_http_server``).

Endpoints (contract: ``docs/openai-api.md``): ``GET /v1/models``, ``POST
/v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings``,
``GET /status``, ``GET /healthz``, ``GET /metrics``, ``POST /admin/reload``.

Every completion or embeddings request runs inside one admission lease, from before the run
is sent to the node until the last byte reaches the client or the client goes
away. A run that fails for a provider reason before its first byte reached the
client is tried again under a new lease on another candidate
([failover-before-first-byte], ``_failover.py``); the answer names the
provider that served it and the number of attempts. The client going away
cancels the handler (the listener's ``cancel_on_disconnect`` watcher, or a
watcher task turning ``http.disconnect`` into cancellation): a queued
request leaves the queue, a running one releases its lease and cancels its run
on the node. This module decides nothing about admission; it maps the
library's outcomes to HTTP.

:class:`EdgeAPI` routes each request: a completion to :class:`Completions` (the request's
walk), every other route to :class:`ServiceRoutes` (the Edge's own answers); request bodies
are read by :class:`~iop_edge.api.request_body.BodyReader`.
"""

from __future__ import annotations

import contextlib
import logging
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol, final

import trio

from iop_admission import (
    Admission,
    AdmissionError,
    Lease,
)
from iop_edge._off_loop import run_off_loop
from iop_edge.api.attempts import attempt_failure, count_cancelled, counted_failure, within_deadline
from iop_edge.api.deadline import RequestDeadline, request_deadline
from iop_edge.api.not_leader import not_leader_on_head, ran_earlier, standby_refusal
from iop_edge.api.rejections import JSON as _JSON
from iop_edge.api.rejections import RequestRejected, node_disconnected
from iop_edge.api.rejections import bearer as _bearer
from iop_edge.api.rejections import dumps as _dumps
from iop_edge.api.relay import AnswerBudget, first_message, relay_stream, relay_whole
from iop_edge.api.request_body import BodyReader, ClientBody, ClientGone, checked_stream, estimate_tokens
from iop_edge.api.responder import Responder, header_pairs
from iop_edge.api.tenant_charge import Charge, charge_of
from iop_edge.config import EdgeConfig
from iop_edge.config.edge import admits_by_tokens
from iop_edge.front_door.head_refusal import HeadRefusal
from iop_edge.front_door.overload import FrontDoor
from iop_edge.ha import EdgeHa
from iop_edge.ha.fencing import NotLeading
from iop_edge.listener.asgi import CONNECTION
from iop_edge.listener.asgi import last_value as _last
from iop_edge.listener.asgi import watch_disconnect as _watch_disconnect
from iop_edge.listener.cycle import PAUSE_READING, ConnectionHooks
from iop_edge.listener.pacing import Headers
from iop_edge.listener.server import CannedResponse
from iop_edge.metrics import EdgeMetrics
from iop_edge.nodes.registry import NodeRegistry
from iop_edge.nodes.runs import NodeGone, RunChannel, RunNotSent
from iop_edge.status import StatusRows, status_json_rows
from iop_edge.ui.page import PATHS as QUEUE_PAGE_PATHS
from iop_edge.ui.page import QueuePage
from iop_io import answer_lifespan
from iop_wire import Run, RunData

logger = logging.getLogger("iop_edge.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
_Request = tuple[str, bool, str, ClientBody, bool, Charge, RequestDeadline]
"""A completion request as :meth:`EdgeAPI._admit_and_run` takes it (model, long, endpoint, body, stream, charge,
deadline)."""


class EdgeParts(Protocol):
    """What :class:`EdgeAPI` uses of the Edge; :class:`~iop_edge.EdgeService` is one.

    The API depends on this and not on the service, so the import arrow runs
    one way (the service builds the API). ``config`` is read on every request:
    a reload replaces it.
    """

    @property
    def config(self) -> EdgeConfig: ...
    @property
    def admission(self) -> Admission: ...
    @property
    def metrics(self) -> EdgeMetrics: ...
    @property
    def registry(self) -> NodeRegistry: ...
    @property
    def front_door(self) -> FrontDoor: ...
    @property
    def ha(self) -> EdgeHa | None:
        """This Edge's part in the election; None without ``ha:`` (the Edge always admits)."""
        ...

    def status(self) -> dict[str, Any]:
        """The ``/status`` body."""
        ...

    async def status_rows(self, *, node: str | None = None, model: str | None = None) -> StatusRows:
        """What ``/status`` writes, optionally filtered by node or model key (read in slices)."""
        ...

    async def reload(self) -> list[str]:
        """Re-read and apply the config file; every error (empty: applied)."""
        ...


def _hooks(scope: Scope) -> ConnectionHooks | None:
    """The listener's hooks for this request (None under another server)."""
    hooks: ConnectionHooks | None = scope.get("extensions", {}).get(CONNECTION)
    return hooks


@final
class EdgeAPI:
    """The ASGI application of one Edge (its :class:`EdgeParts`): each request to its route, the
    completion walk's (:class:`Completions`) or the Edge's own answers' (:class:`ServiceRoutes`), or
    to the live queue page."""

    def __init__(self, service: EdgeParts) -> None:
        self.service = service
        self.head_refusal = HeadRefusal(service)
        self.queue_page = QueuePage(service)
        self.answers = AnswerBudget()  # the non-stream answers held ([upstream-bounds])
        service.metrics.follow_answers(lambda: self.answers.held)
        walk = Completions(service, self.head_refusal, BodyReader(OFF_LOOP_BODY_BYTES), self.answers)
        own = ServiceRoutes(service, self.head_refusal)
        self._routes: dict[tuple[str, str], Callable[[Scope, Receive, Responder], Awaitable[None]]] = {
            ("POST", "/v1/chat/completions"): walk.chat,
            ("POST", "/v1/completions"): walk.completions,
            ("POST", "/v1/embeddings"): walk.embeddings,
            ("GET", "/v1/models"): own.models,
            ("GET", "/status"): own.status,
            ("GET", "/healthz"): own.healthz,
            ("GET", "/readyz"): own.readyz,
            ("GET", "/metrics"): own.metrics,
            ("POST", "/admin/reload"): own.reload,
        }
        self._paths = {path for _, path in self._routes}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await answer_lifespan(receive, send)
            return
        if kind != "http":
            return
        hooks = _hooks(scope)
        responder = Responder(
            send,
            scope,
            hooks.write_body_nowait if hooks is not None else None,
            hooks.respond_nowait if hooks is not None else None,
        )
        if scope["path"] in QUEUE_PAGE_PATHS:  # the live queue page, an app of its own ([queue-page])
            await self.queue_page(scope, receive, send)
            return
        handler = self._routes.get((scope["method"], scope["path"]))
        try:
            if handler is None:
                if scope["path"] in self._paths:
                    raise RequestRejected(405, "method_not_allowed", f"{scope['method']} is not allowed here")
                raise RequestRejected(404, "not_found", f"no route for {scope['path']}")
            await handler(scope, receive, responder)
        except ClientGone:
            return
        except RequestRejected as rejection:
            await responder.reject(rejection)

    def refuse_head(self, method: bytes, target: bytes, headers: Headers) -> tuple[CannedResponse, float] | None:
        """The listener's ``refuse_head``: ``not_leader_on_head`` [ha-step-down], then :meth:`HeadRefusal.refuse`."""
        return not_leader_on_head(self.service.ha, method, target) or self.head_refusal.refuse(method, target, headers)


@final
class Completions:
    """The walk of one completion or embeddings request: refused on its head or read, admitted,
    run on a node and relayed, within its deadline and while this Edge leads.

    Args:
        service: the Edge.
        head_refusal: the Edge's refusals before a lease (overload, tenants, authorization).
        body: reads the request bodies and counts their context tokens.
        answers: the non-stream answers held ([upstream-bounds]).
    """

    def __init__(self, service: EdgeParts, head_refusal: HeadRefusal, body: BodyReader, answers: AnswerBudget) -> None:
        self.service = service
        self.head_refusal = head_refusal
        self._body = body
        self.answers = answers

    async def chat(self, scope: Scope, receive: Receive, responder: Responder) -> None:
        await self._completion(scope, receive, responder, "chat/completions")

    async def completions(self, scope: Scope, receive: Receive, responder: Responder) -> None:
        await self._completion(scope, receive, responder, "completions")

    async def embeddings(self, scope: Scope, receive: Receive, responder: Responder) -> None:
        await self._completion(scope, receive, responder, "embeddings")

    async def _completion(self, scope: Scope, receive: Receive, responder: Responder, endpoint: str) -> None:
        service = self.service
        if service.ha is not None and not service.ha.admits():
            if self.head_refusal.let_through_by_listener(scope, _hooks(scope)):
                self.head_refusal.gave_up(scope)  # it will not ask for a lease
            raise standby_refusal(service.ha)
        refused = self.head_refusal.refuse_request(scope, _hooks(scope))
        if refused is not None:
            response, scope[PAUSE_READING] = refused
            await responder.canned(response)
            return
        try:
            body = await self._body.read(scope["headers"], receive, service.config.max_body_bytes)
            fields = body.fields
            model = fields.get("model")
            if not isinstance(model, str) or not model:
                raise RequestRejected(400, "bad_request", "'model' is required and must be a string")
            stream = checked_stream(endpoint, fields)
            threshold = service.config.long_threshold(model)
            long = threshold is not None and estimate_tokens(endpoint, fields) > threshold
            charge = charge_of(service.config, scope["headers"], lambda: estimate_tokens(endpoint, fields))
            deadline = request_deadline(scope["headers"], service.config.model_entry(model), stream)
            if admits_by_tokens(service.config):
                tokenizer = service.config.tokenizer(model)
                charge.context = await self._body.context_tokens(endpoint, fields, tokenizer)
        except BaseException:
            self.head_refusal.gave_up(scope)  # let through on its head, it will not ask for a lease
            raise

        term = trio.CancelScope()  # [ha-step-down] cancelled when this Edge stops leading
        with contextlib.ExitStack() as stack:
            if service.ha is not None:
                stack.enter_context(service.ha.cut_on_step_down(term))
            with term:
                await self._watched(scope, receive, responder, (model, long, endpoint, body, stream, charge, deadline))
        if term.cancelled_caught and service.ha is not None:
            # queued: a 503 now; streaming: a final error event. A request whose run was sent may have
            # run: its code says so, and not_leader always means it did not [ha-step-down].
            raise standby_refusal(service.ha, ran=responder.run_sent)

    async def _watched(self, scope: Scope, receive: Receive, responder: Responder, request: _Request) -> None:
        """Admit and run ``request``, cancelled if the client goes away."""
        hooks = _hooks(scope)
        if hooks is not None and hooks.can_watch_disconnect:  # the connection's own watcher: no task per request
            with trio.CancelScope() as cancel_scope:
                hooks.cancel_on_disconnect(cancel_scope)
                await self._admit_and_run(*request, responder)
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_disconnect, receive, nursery.cancel_scope)
            await self._admit_and_run(*request, responder)
            nursery.cancel_scope.cancel()

    async def _admit_and_run(
        self,
        model: str,
        long: bool,
        endpoint: str,
        body: ClientBody,
        stream: bool,
        charge: Charge,
        deadline: RequestDeadline,
        responder: Responder,
    ) -> None:
        """Serve the request within its deadline ([deadline], :func:`within_deadline`)."""
        service = self.service
        metrics = service.metrics
        started_at = trio.current_time()
        outcome = "error"
        visit = service.front_door.enter(charge.tenant)
        served: Lease | None = None  # the lease of the latest attempt

        async def attempt(lease: Lease) -> str:
            nonlocal served
            visit.grant()
            served, ran_before = lease, responder.run_sent  # ran_before: an earlier attempt's run was sent
            try:
                return await self._run(lease, model, endpoint, body, (stream, charge, deadline), responder)
            except RequestRejected as rejection:
                raise attempt_failure(ran_earlier(rejection, ran_before), lease, responder.started) from None
            finally:
                charge.settle(service.admission, lease, answered=responder.started)

        try:
            hooks = (service.metrics, service.ha, service.config.model_entry(model))
            outcome = await within_deadline(
                service.admission, (model, long, charge), attempt, deadline, responder, hooks
            )
        except (AdmissionError, RequestRejected) as failure:
            if isinstance(failure, AdmissionError):
                visit.stop_asking()
            rejection, outcome = counted_failure(service, self.head_refusal, model, failure)
            await responder.reject(rejection)
        except trio.Cancelled:
            outcome = "cancelled"
            count_cancelled(metrics, model)
            raise
        finally:
            visit.leave()
            if served is not None:
                duration = trio.current_time() - started_at
                metrics.lease_ended(model, outcome, duration)
                service.front_door.shedder.observe_service(duration - served.queue_wait)

    async def _run(
        self,
        lease: Any,
        model: str,
        endpoint: str,
        body: ClientBody,
        how: tuple[bool, Charge, RequestDeadline],
        responder: Responder,
    ) -> str:
        """Send the run to the lease's node and relay its answer. Returns the outcome.

        ``how``: whether it streams, its tenant charge (whose :meth:`Charge.scanners` see the
        answer in token mode or on a token budget, to settle with the reported usage) and its deadline.

        Checkpoints. The first message must come within the model's first-token
        timeout ([first-token-timeout]); the first output reports a success to
        admission ([outlier-ejection]).
        """
        stream, charge, deadline = how
        charge.reserve(self.service.admission, lease)  # a retry: the request's reserve again
        run = _open_run(self.service, lease, model, endpoint, body, stream, deadline.run_ms())
        responder.run_sent = True
        scan, scan_parts = charge.scanners(self.service.admission, lease) if charge.reads_usage else (None, None)
        head = [
            (b"x-iop-provider", str(lease.provider).encode()),
            (b"x-iop-queue-ms", str(round(lease.queue_wait * 1000)).encode()),
            (b"x-iop-attempts", str(lease.attempt).encode()),
        ]
        first_token = self.service.config.first_token_timeout(model)
        if not stream:  # the node link's reader may write the whole answer itself (see relay_whole)
            most = self.service.config.max_answer_bytes
            run.answer_whole(lambda answer: len(answer) <= most and responder.whole_nowait(200, [_JSON, *head], answer))
        async with run:
            try:
                first = await first_message(run, first_token)
                if isinstance(first, RunData):
                    deadline.first_byte()
                    self.service.admission.report_success(lease)
                if stream:
                    await relay_stream(run, responder, head, first, scan)
                else:
                    config = self.service.config
                    hold = (self.answers, (config.max_answer_bytes, config.answer_budget_bytes))
                    await relay_whole(run, responder, head, hold, first, scan_parts)
            except trio.Cancelled:
                await deadline.answer_now(responder)  # leaving the run waits for the node's end
                raise
        return "ok"


@final
class ServiceRoutes:
    """The routes the Edge answers from its own state, no node involved: models, status, health,
    readiness, metrics and the admin reload."""

    def __init__(self, service: EdgeParts, head_refusal: HeadRefusal) -> None:
        self.service = service
        self.head_refusal = head_refusal

    async def models(self, scope: Scope, receive: Receive, responder: Responder) -> None:
        self.head_refusal.authorize(scope["headers"])
        data = [{"id": m.id, "object": "model", "created": 0, "owned_by": "iop"} for m in self.service.config.models]
        await responder.whole(200, [_JSON], _dumps({"object": "list", "data": data}))

    async def status(self, scope: Scope, receive: Receive, responder: Responder) -> None:
        """``GET /status[?node=ID][&model=ID]``: the state is read on the loop a slice at a time;
        turning 10,000 providers into JSON runs in a worker thread, so streams keep flowing meanwhile."""
        query = urllib.parse.parse_qs(bytes(scope.get("query_string", b"")).decode("latin-1"))
        rows = await self.service.status_rows(node=_last(query, "node"), model=_last(query, "model"))
        body = await run_off_loop(lambda: status_json_rows(rows))
        await responder.whole(200, [_JSON], body)

    async def healthz(self, scope: Scope, receive: Receive, responder: Responder) -> None:
        await responder.whole(200, [_JSON], b'{"status":"ok"}')

    async def readyz(self, scope: Scope, receive: Receive, responder: Responder) -> None:
        """200 when this Edge admits (it leads, or runs without ``ha:``); 503 ``not leader`` else."""
        ha = self.service.ha
        if ha is None or ha.admits():
            await responder.whole(200, [_JSON], b'{"status":"ready"}')
            return
        body = {"status": "not leader", "leader": ha.leadership.leader, "epoch": ha.leadership.epoch}
        await responder.whole(503, [_JSON, *header_pairs(ha.refusal_headers())], _dumps(body))

    async def metrics(self, scope: Scope, receive: Receive, responder: Responder) -> None:
        body, content_type = await self.service.metrics.render_off_loop()
        await responder.whole(200, [(b"content-type", content_type.encode())], body)

    async def reload(self, scope: Scope, receive: Receive, responder: Responder) -> None:
        config = self.service.config
        if not config.admin_token:
            raise RequestRejected(404, "not_found", "no route for /admin/reload")
        if not config.accepts_admin_token(_bearer(scope["headers"]) or ""):
            raise RequestRejected(401, "unauthorized", "a valid admin token is required", type="authentication_error")
        errors = await self.service.reload()
        if errors:
            body = {
                "error": {
                    "message": "config rejected; the old config stays in force",
                    "type": "invalid_request_error",
                    "code": "config_rejected",
                },
                "errors": errors,
            }
            await responder.whole(400, [_JSON, (b"x-iop-reject-reason", b"config_rejected")], _dumps(body))
            return
        await responder.whole(200, [_JSON], b'{"status":"reloaded"}')


OFF_LOOP_BODY_BYTES = 64 * 1024
"""Request bodies larger than this are read in a worker thread (:func:`run_off_loop`), so a
flood of large bodies leaves the loop free for everything else."""


def _open_run(
    service: EdgeParts, lease: Any, model: str, endpoint: str, body: ClientBody, stream: bool, deadline_ms: int | None
) -> RunChannel:
    """Send ``run`` to the node holding the lease (never waits).

    The run carries the client's body as sent, with the upstream model beside it (``run.model``):
    the frame is the body plus a few fields. The link says it to a node of the previous wire
    version (docs/wire.md, Versioning); if that frame is over the node's limit only this run
    fails, with 413. ``deadline_ms``: what is left of the request's deadline ([deadline]), None for none.

    Raises:
        NotLeading: this Edge has ``ha:`` and cannot prove it leads (the link's ``epoch``): nothing is sent.
    """
    key = lease.provider
    try:
        link = service.registry.link(key.node_id, lease.generation)
        upstream_model = service.config.upstream_model(model, key)
        run_id = service.registry.new_run_id()
        # [held-elsewhere] a long run says so: the node counts it among its long runs
        run = Run(run_id, key.provider_id, endpoint, {}, stream, link.epoch, lease.long, upstream_model, deadline_ms)
        return link.open_run(run, body.text)
    except (NodeGone, KeyError) as exc:  # nothing left for the node: another candidate may serve it
        raise node_disconnected(str(exc), sent=False) from None
    except RunNotSent as exc:  # nothing was registered: the lease is released on the way out
        kind = "upstream_error" if exc.status >= 500 else "invalid_request_error"
        raise RequestRejected(exc.status, exc.code, str(exc), type=kind) from None
    except NotLeading:  # [ha-step-down] granted, or retried, by an Edge that cannot prove it leads: not sent
        assert service.ha is not None  # only an Edge with ha: refuses to stamp
        raise standby_refusal(service.ha) from None
