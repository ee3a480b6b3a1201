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
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any, Protocol, final

import trio

from iop_admission import (
    Admission,
    AdmissionError,
    Lease,
    LeaseRevoked,
)
from iop_edge._off_loop import run_off_loop
from iop_edge.api.failover import AttemptFailed, serve_with_failover
from iop_edge.api.head_refusal import HeadRefusal
from iop_edge.api.overload import FrontDoor
from iop_edge.api.rejections import JSON as _JSON
from iop_edge.api.rejections import RequestRejected, node_disconnected
from iop_edge.api.rejections import bearer as _bearer
from iop_edge.api.rejections import canned as _canned
from iop_edge.api.rejections import dumps as _dumps
from iop_edge.api.tenant_charge import Charge, charge_of, refusal_of
from iop_edge.api.upstream_errors import upstream_error_object
from iop_edge.config import EdgeConfig
from iop_edge.ha import EdgeHa
from iop_edge.listener.asgi import last_value as _last
from iop_edge.listener.asgi import watch_disconnect as _watch_disconnect
from iop_edge.listener.cycle import CONNECTION, PAUSE_READING, ConnectionHooks
from iop_edge.listener.pacing import Headers
from iop_edge.listener.server import CannedResponse
from iop_edge.metrics import EdgeMetrics
from iop_edge.nodes.links import NodeGone, NodeRegistry, RunChannel, RunMessage
from iop_edge.status import StatusRows, status_json_rows
from iop_edge.ui.page import PATHS as QUEUE_PAGE_PATHS
from iop_edge.ui.page import QueuePage
from iop_wire import LONG_PROTOCOL, Run, RunData, RunEnd, RunEvent

logger = logging.getLogger("iop_edge.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
_Request = tuple[str, bool, str, dict[str, Any], bool, Charge]
"""A completion request as :meth:`EdgeAPI._admit_and_run` takes it (model, long, endpoint, body, stream, charge)."""


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


CHARS_PER_TOKEN = 4
"""Prompt characters per estimated token, for the long-request classification."""
UPSTREAM_RETRY_AFTER = 1
"""``Retry-After`` seconds when a backend answered 429 (the node does not relay the backend's header)."""
STALE_LEADER_RETRY_AFTER = 1
"""``Retry-After`` seconds when a node refused the run as ``stale_epoch``: a newer leader exists already."""


def _hooks(scope: Scope) -> ConnectionHooks | None:
    """The listener's hooks for this request (None under another server)."""
    hooks: ConnectionHooks | None = scope.get("extensions", {}).get(CONNECTION)
    return hooks


_SSE = (b"content-type", b"text/event-stream")


def run_failure(end: RunEnd) -> RequestRejected:
    """Map a node's ``run_end`` error to its HTTP answer, by its failure kind, and say
    whether it may be retried.

    A backend's client error (``client_error``: a 4xx but 401, 403, 407, 408 and
    429) keeps the backend's status and error object, is never retried and never
    counts against the provider; a backend 429 (``rate_limited``) is retried on
    another candidate and, if it ends the request, answered 429 with
    ``Retry-After`` and the backend's error object; the provider's failures
    (unreachable, 5xx, 401/403/407/408, an unreadable answer) are
    retried and count against it, and end as ``502 upstream_error``; the node's
    ``concurrency_limit`` is retried but does not count; a ``bad_request`` from
    the node is never retried. ``x-iop-provider`` is set by the caller.
    """
    detail = end.message or end.code or "run failed"
    kind = end.failure
    if kind == "node_busy":
        return RequestRejected(
            503,
            "provider_busy",
            f"provider busy: {detail}",
            type="service_unavailable",
            reason="provider_busy",
            retry="concurrency_limit",
        )
    if kind == "cancelled":
        return node_disconnected(f"run cancelled by the node: {detail}")
    if kind == "stale_leader":  # [epoch-fencing] a newer leader exists: never retried here
        return RequestRejected(
            503,
            "not_leader",
            f"this Edge no longer leads: {detail}",
            type="service_unavailable",
            retry_after=STALE_LEADER_RETRY_AFTER,
        )
    status = end.upstream_status
    retry = _upstream_retry(end)
    if status is not None and kind in ("client_error", "rate_limited"):
        error = upstream_error_object(status, end.upstream_body, detail)
        return RequestRejected(
            status,
            str(error["code"] or ""),
            str(error["message"]),
            type=str(error["type"]),
            reason="upstream_rate_limited" if kind == "rate_limited" else "upstream_client_error",
            retry_after=UPSTREAM_RETRY_AFTER if kind == "rate_limited" else None,
            retry=retry,
            provider_failure=retry is not None,
            error=error,
        )
    if status is not None:
        detail = f"upstream answered {status}: {detail}"
    return RequestRejected(
        502,
        "upstream_too_large" if end.code == "upstream_too_large" else "upstream_error",
        detail,
        type="upstream_error",
        reason=end.code or "upstream_error",
        retry=retry,
        provider_failure=retry is not None,
    )


def _upstream_retry(end: RunEnd) -> str | None:
    """The retry reason of a failed run (``iop_wire.failure_kind``), or None when the failure is not the provider's."""
    kind = end.failure
    if kind == "unreachable":
        return "upstream_unreachable"
    if kind == "rate_limited":
        return "upstream_429"
    if kind == "provider_error":
        status = end.upstream_status
        return "upstream_5xx" if status is not None and status >= 500 else "upstream_error"
    return None  # client_error, node_refused: the run cannot be served as asked


def checked_stream(endpoint: str, body: dict[str, Any]) -> bool:
    """Check the fields the Edge reads for ``endpoint``; return whether the answer streams.

    Raises:
        RequestRejected: 400 ``bad_request`` naming the field.
    """
    if endpoint == "embeddings":
        if not is_embedding_input(body.get("input")):
            raise RequestRejected(
                400,
                "bad_request",
                "'input' is required: a non-empty string, a list of strings, a token list or a list of token lists",
            )
        return False  # never a stream
    if endpoint == "chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestRejected(400, "bad_request", "'messages' is required and must be a non-empty list")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str | list):
            raise RequestRejected(400, "bad_request", "'prompt' is required and must be a string or a list")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestRejected(400, "bad_request", "'stream' must be true or false")
    return stream


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def is_embedding_input(value: object) -> bool:
    """``input`` of an embeddings request: a non-empty string, or a non-empty list of non-empty
    strings, a token list (integers), or a non-empty list of non-empty token lists."""
    if isinstance(value, str):
        return bool(value)
    if not isinstance(value, list) or not value:
        return False
    return (
        all(isinstance(item, str) and item for item in value)
        or _is_token_list(value)
        or all(_is_token_list(item) for item in value)
    )


def embedding_tokens(value: object) -> int:
    """Estimated tokens of an embeddings ``input``: characters / 4, plus one per token id given."""
    if isinstance(value, str):
        return len(value) // CHARS_PER_TOKEN
    if _is_token_list(value):
        return len(value)  # type: ignore[arg-type]
    if not isinstance(value, list):
        return 0
    chars = sum(len(item) for item in value if isinstance(item, str))
    return chars // CHARS_PER_TOKEN + sum(len(item) for item in value if isinstance(item, list))


def estimate_tokens(endpoint: str, body: dict[str, Any]) -> int:
    """Estimated context of a request: prompt characters / 4 plus the output budget.

    For embeddings: the input's characters / 4 plus its token ids (:func:`embedding_tokens`).
    """
    if endpoint == "embeddings":
        return embedding_tokens(body.get("input"))
    chars = 0
    if endpoint == "chat/completions":
        for message in body.get("messages") or ():
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        chars += len(part["text"])
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            chars += len(prompt)
        elif isinstance(prompt, list):
            chars += sum(len(p) for p in prompt if isinstance(p, str))
    budget = body.get("max_tokens") or body.get("max_completion_tokens") or 0
    if not isinstance(budget, int) or isinstance(budget, bool):
        budget = 0
    return chars // CHARS_PER_TOKEN + budget


@final
class Responder:
    """Sends one HTTP response; knows whether the head is out already."""

    __slots__ = ("_send", "_scope", "started", "finished", "write_nowait", "respond_nowait")

    def __init__(
        self,
        send: Send,
        scope: Scope,
        write_nowait: Callable[[bytes], bool] | None = None,
        respond_nowait: Callable[[int, list[tuple[bytes, bytes]], bytes], bool] | None = None,
    ) -> None:
        self._send = send
        self._scope = scope
        self.started = False
        self.finished = False
        self.write_nowait = write_nowait
        """The listener's ``write_body_nowait``: a body chunk written from any task, never waiting."""
        self.respond_nowait = respond_nowait
        """The listener's ``respond_nowait``: a whole response written from any task, never waiting."""

    async def start(self, status: int, headers: Iterable[tuple[bytes, bytes]]) -> None:
        self.started = True
        await self._send({"type": "http.response.start", "status": status, "headers": list(headers)})

    async def chunk(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def finish(self, data: bytes = b"") -> None:
        self.finished = True
        await self._send({"type": "http.response.body", "body": data, "more_body": False})

    async def whole(self, status: int, headers: Iterable[tuple[bytes, bytes]], body: bytes) -> None:
        await self.start(status, _framing(headers, body))
        await self.finish(body)

    def whole_nowait(self, status: int, headers: Iterable[tuple[bytes, bytes]], body: bytes) -> bool:
        """Answer with a whole response now, from any task, never waiting (the listener's ``respond_nowait``).

        Returns:
            Whether it went out; if not (no such extension, the response started, the client
            gone), answer with :meth:`whole` as usual.
        """
        respond = self.respond_nowait
        if respond is None or self.started or not respond(status, _framing(headers, body), body):
            return False
        self.started = self.finished = True
        return True

    async def canned(self, response: CannedResponse) -> None:
        """Answer with a response encoded once (a refusal on the request head)."""
        self.started = self.finished = True
        await self._send({"type": "http.response.start", "status": response.status, "headers": response.headers})
        await self._send({"type": "http.response.body", "body": response.body, "more_body": False})

    async def reject(self, rejection: RequestRejected) -> None:
        """Answer with an error: a JSON response, or a final SSE error event mid-stream.

        Shielded, for at most :data:`REJECT_BOUND_S`: the answer goes out even when the request's
        scope is cancelled as it is written (a leader stepping down just as a node refuses its run
        as ``stale_epoch``: found by the seeded simulation's Edge replicas). Without the shield the
        response was marked finished and never sent, and the client got nothing.
        """
        if self.finished:
            return
        if rejection.read_after is not None:
            self._scope[PAUSE_READING] = rejection.read_after
        with trio.CancelScope(shield=True), trio.move_on_after(REJECT_BOUND_S):
            if not self.started:
                head, body = _canned(rejection)
                self.started = self.finished = True
                await self._send({"type": "http.response.start", "status": rejection.status, "headers": head})
                await self._send({"type": "http.response.body", "body": body, "more_body": False})
            else:
                await self.finish(b"data: " + rejection.body() + b"\n\n")


@final
class EdgeAPI:
    """The ASGI application of one Edge (its :class:`EdgeParts`)."""

    def __init__(self, service: EdgeParts) -> None:
        self.service = service
        self._routes: dict[tuple[str, str], Callable[[Scope, Receive, Responder], Awaitable[None]]] = {
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/embeddings"): self._embeddings,
            ("GET", "/v1/models"): self._models,
            ("GET", "/status"): self._status,
            ("GET", "/healthz"): self._healthz,
            ("GET", "/readyz"): self._readyz,
            ("GET", "/metrics"): self._metrics,
            ("POST", "/admin/reload"): self._reload,
        }
        self._paths = {path for _, path in self._routes}
        self.head_refusal = HeadRefusal(service)
        self._queue_page = QueuePage(service)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await _lifespan(receive, send)
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
            await self._queue_page(scope, receive, send)
            return
        handler = self._routes.get((scope["method"], scope["path"]))
        try:
            if handler is None:
                if scope["path"] in self._paths:
                    raise RequestRejected(405, "method_not_allowed", f"{scope['method']} is not allowed here")
                raise RequestRejected(404, "not_found", f"no route for {scope['path']}")
            await handler(scope, receive, responder)
        except _ClientGone:
            return
        except RequestRejected as rejection:
            await responder.reject(rejection)

    # ------------------------------------------------------------ completions

    async def _chat(self, scope: Scope, receive: Receive, responder: Responder) -> None:
        await self._completion(scope, receive, responder, "chat/completions")

    async def _completions(self, scope: Scope, receive: Receive, responder: Responder) -> None:
        await self._completion(scope, receive, responder, "completions")

    async def _embeddings(self, scope: Scope, receive: Receive, responder: Responder) -> None:
        await self._completion(scope, receive, responder, "embeddings")

    async def _completion(self, scope: Scope, receive: Receive, responder: Responder, endpoint: str) -> None:
        service = self.service
        if service.ha is not None and not service.ha.admits():
            if self.head_refusal.let_through_by_listener(scope, _hooks(scope)):
                service.front_door.gave_up()  # it will not ask for a lease
            raise _standby_refusal(service.ha)
        refused = self.head_refusal.refuse_request(scope, _hooks(scope))
        if refused is not None:
            response, scope[PAUSE_READING] = refused
            await responder.canned(response)
            return
        try:
            body = await self._read_json(scope, receive)
            model = body.get("model")
            if not isinstance(model, str) or not model:
                raise RequestRejected(400, "bad_request", "'model' is required and must be a string")
            stream = checked_stream(endpoint, body)
            threshold = service.config.long_threshold(model)
            long = threshold is not None and estimate_tokens(endpoint, body) > threshold
            charge = charge_of(service.config, scope["headers"], lambda: estimate_tokens(endpoint, body))
        except BaseException:
            service.front_door.gave_up()  # let through on its head, it will not ask for a lease
            raise

        term = trio.CancelScope()  # [ha-step-down] cancelled when this Edge stops leading
        with contextlib.ExitStack() as stack:
            if service.ha is not None:
                stack.enter_context(service.ha.cut_on_step_down(term))
            with term:
                await self._watched(scope, receive, responder, (model, long, endpoint, body, stream, charge))
        if term.cancelled_caught and service.ha is not None:
            raise _standby_refusal(service.ha)  # queued: a 503 now; streaming: a final error event

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

    def refuse_head(self, method: bytes, target: bytes, headers: Headers) -> tuple[CannedResponse, float] | None:
        """The listener's ``refuse_head``: :meth:`HeadRefusal.refuse`."""
        return self.head_refusal.refuse(method, target, headers)

    async def _admit_and_run(
        self,
        model: str,
        long: bool,
        endpoint: str,
        body: dict[str, Any],
        stream: bool,
        charge: Charge,
        responder: Responder,
    ) -> None:
        service = self.service
        metrics = service.metrics
        started_at = trio.current_time()
        outcome = "error"
        visit = service.front_door.enter()
        served: Lease | None = None  # the lease of the latest attempt

        async def attempt(lease: Lease) -> str:
            nonlocal served
            visit.grant()
            served = lease
            try:
                return await self._run(lease, model, endpoint, body, (stream, charge), responder)
            except RequestRejected as rejection:
                raise _attempt_failure(rejection, lease, responder.started) from None
            finally:
                charge.settle(service.admission, lease, answered=responder.started)

        on_retry = _retried(metrics, model)
        try:
            outcome = await serve_with_failover(
                service.admission,
                model,
                long,
                attempt,
                answered=lambda: responder.started,
                on_retry=on_retry,
                tenant=charge.tenant,
                cost=charge.cost,
            )
        except AdmissionError as exc:
            visit.stop_asking()
            if isinstance(exc, LeaseRevoked):
                outcome = "revoked"
            await responder.reject(refusal_of(exc, service, self.head_refusal))
        except RequestRejected as rejection:
            if rejection.code == "provider_busy":
                metrics.request_rejected(model, "provider_busy")
            elif rejection.reason == "upstream_client_error":
                outcome = "client_error"
            await responder.reject(rejection)
        except trio.Cancelled:
            outcome = "cancelled"
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
        body: dict[str, Any],
        how: tuple[bool, Charge],
        responder: Responder,
    ) -> str:
        """Send the run to the lease's node and relay its answer. Returns the outcome.

        ``how``: whether it streams, and its tenant charge (whose :meth:`Charge.scan` sees the
        answer in token mode, to settle with the reported usage).

        Checkpoints. The first message must come within the model's first-token
        timeout ([first-token-timeout]); the first output reports a success to
        admission ([outlier-ejection]).
        """
        stream, charge = how
        charge.reserve(self.service.admission, lease)  # a retry: the request's reserve again
        run = _open_run(self.service, lease, model, endpoint, body, stream)
        scan = charge.scan if charge.tokens else None
        head = [
            (b"x-iop-provider", str(lease.provider).encode()),
            (b"x-iop-queue-ms", str(round(lease.queue_wait * 1000)).encode()),
            (b"x-iop-attempts", str(lease.attempt).encode()),
        ]
        first_token = self.service.config.first_token_timeout(model)
        if not stream:  # the node link's reader may write the whole answer itself (see _relay_whole)
            run.answer_whole(lambda answer: responder.whole_nowait(200, [_JSON, *head], answer))
        async with run:
            first = await _first_message(run, first_token)
            if isinstance(first, RunData | RunEvent):
                self.service.admission.report_success(lease)
            if stream:
                await _relay_stream(run, responder, head, first, scan)
            else:
                await _relay_whole(run, responder, head, first, scan)
        return "ok"

    # ------------------------------------------------------------ other routes

    async def _models(self, scope: Scope, receive: Receive, responder: Responder) -> None:
        self.head_refusal.authorize(scope["headers"])
        data = [{"id": m.id, "object": "model", "created": 0, "owned_by": "iop"} for m in self.service.config.models]
        await responder.whole(200, [_JSON], _dumps({"object": "list", "data": data}))

    async def _status(self, scope: Scope, receive: Receive, responder: Responder) -> None:
        """``GET /status[?node=ID][&model=ID]``: the state is read on the loop a slice at a time;
        turning 10,000 providers into JSON runs in a worker thread, so streams keep flowing meanwhile."""
        query = urllib.parse.parse_qs(bytes(scope.get("query_string", b"")).decode("latin-1"))
        rows = await self.service.status_rows(node=_last(query, "node"), model=_last(query, "model"))
        body = await run_off_loop(lambda: status_json_rows(rows))
        await responder.whole(200, [_JSON], body)

    async def _healthz(self, scope: Scope, receive: Receive, responder: Responder) -> None:
        await responder.whole(200, [_JSON], b'{"status":"ok"}')

    async def _readyz(self, scope: Scope, receive: Receive, responder: Responder) -> None:
        """200 when this Edge admits (it leads, or runs without ``ha:``); 503 ``not leader`` else."""
        ha = self.service.ha
        if ha is None or ha.admits():
            await responder.whole(200, [_JSON], b'{"status":"ready"}')
            return
        body = {"status": "not leader", "leader": ha.leadership.leader, "epoch": ha.leadership.epoch}
        await responder.whole(503, [_JSON, *_header_pairs(ha.refusal_headers())], _dumps(body))

    async def _metrics(self, scope: Scope, receive: Receive, responder: Responder) -> None:
        body, content_type = await self.service.metrics.render_off_loop()
        await responder.whole(200, [(b"content-type", content_type.encode())], body)

    async def _reload(self, scope: Scope, receive: Receive, responder: Responder) -> None:
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

    # ------------------------------------------------------------------ input

    async def _read_json(self, scope: Scope, receive: Receive) -> dict[str, Any]:
        limit = self.service.config.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    raise RequestRejected(400, "bad_request", "invalid content-length") from None
                if declared > limit:
                    raise _too_large(limit)
        chunks = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        try:
            raw = b"".join(chunks)
            body = _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))  # as json.loads reads bytes
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise RequestRejected(400, "bad_request", f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise RequestRejected(400, "bad_request", "request body must be a JSON object")
        return body


def _open_run(
    service: EdgeParts, lease: Any, model: str, endpoint: str, body: dict[str, Any], stream: bool
) -> RunChannel:
    """Send ``run`` to the node holding the lease (never waits)."""
    key = lease.provider
    try:
        link = service.registry.link(key.node_id, lease.generation)
        upstream = dict(body)
        upstream["model"] = service.config.upstream_model(model, key)
        if endpoint != "embeddings":  # an embeddings body goes as the client sent it
            upstream["stream"] = stream
        long = lease.long and link.protocol >= LONG_PROTOCOL  # [held-elsewhere] a v4 node counts its long runs
        run = Run(service.registry.new_run_id(), key.provider_id, endpoint, upstream, stream, link.epoch, long)
        return link.open_run(run)
    except (NodeGone, KeyError) as exc:
        raise node_disconnected(str(exc)) from None


def _retried(metrics: EdgeMetrics, model: str) -> Callable[[str, Lease], None]:
    """What to do before a retry ([failover-before-first-byte]): count it and say so."""

    def on_retry(reason: str, failed: Lease) -> None:
        metrics.retried(model, reason)
        logger.info("retrying %s after %s on %s (attempt %d)", model, reason, failed.provider, failed.attempt)

    return on_retry


async def _next(run: RunChannel) -> RunMessage:
    try:
        return await run.next()
    except NodeGone as exc:
        if run.overflowed:
            raise RequestRejected(502, "client_too_slow", str(exc), type="upstream_error") from None
        raise node_disconnected(str(exc)) from None


def _attempt_failure(rejection: RequestRejected, lease: Lease, started: bool) -> Exception:
    """What an attempt's failure becomes: :class:`AttemptFailed` when another candidate may serve.

    Never for the client's error, never once a byte went out ([failover-before-first-byte]).
    """
    rejection.attempts = lease.attempt
    rejection.provider = str(lease.provider)  # the provider that was tried: x-iop-provider
    if rejection.retry is None or started:
        return rejection
    return AttemptFailed(rejection, rejection.retry, provider_failure=rejection.provider_failure)


async def _first_message(run: RunChannel, first_token: float | None) -> RunMessage:
    """The run's first message, within ``first_token`` seconds when set ([first-token-timeout]).

    Checkpoints. Past the timeout it raises a retryable provider failure; the
    caller leaving the run's ``async with`` then cancels the run on the node.
    A message that arrived in the scheduling round the timeout ended the wait
    came in time: the node link's reader may have written the whole answer to
    the client already (:meth:`RunChannel.answer_whole`), which must then count
    as answered, not as a failure of the provider.
    """
    if first_token is None:
        return await _next(run)
    with trio.move_on_after(first_token):
        return await _next(run)
    if run.ready():
        return await _next(run)
    raise RequestRejected(
        502,
        "first_token_timeout",
        "no first byte from the upstream in time (first_token_timeout_ms)",
        type="upstream_error",
        retry="first_token_timeout",
        provider_failure=True,
    )


def _end_of(message: RunMessage) -> RunEnd:
    """The run's end; an error end or a message no run carries becomes the client's error."""
    if type(message) is not RunEnd:
        raise RequestRejected(502, "upstream_error", "unexpected tunnel message for a run", type="upstream_error")
    if message.status != "ok":
        raise run_failure(message)
    return message


async def _relay_stream(
    run: RunChannel,
    responder: Responder,
    head: list[tuple[bytes, bytes]],
    first: RunMessage | None = None,
    scan: Callable[[bytes], None] | None = None,
) -> None:
    """Relay a streamed run: every burst of output that has arrived goes out in one send.

    Output in data records (v2) is the SSE body already, written as is; output in
    ``run_event`` messages (v1) is framed here, and the stream ends with our ``[DONE]``.
    ``first`` is the run's first message when the caller received it already.
    ``scan`` (token cost, [tenant-edge]) sees every burst written, to find the reported usage.

    Once the head is out and everything received is written, data records go
    from the node link's reader straight to the client's socket (the server's
    ``write_body_nowait``, :meth:`RunChannel.attach`); this task then only
    waits for the run's end.
    """
    try:
        await _relay_bursts(run, responder, head, first, scan)
    finally:
        run.detach()


async def _relay_bursts(
    run: RunChannel,
    responder: Responder,
    head: list[tuple[bytes, bytes]],
    first: RunMessage | None,
    scan: Callable[[bytes], None] | None,
) -> None:
    framed_here = False
    while True:
        if not framed_here and scan is None and responder.started and responder.write_nowait is not None:
            run.attach(responder.write_nowait)
        message, first = (first, None) if first is not None else (await _next(run), None)
        burst = [message, *run.buffered()]
        parts: list[bytes] = []
        end: RunMessage | None = None
        for item in burst:
            if isinstance(item, RunData):
                parts.append(item.data)
            elif isinstance(item, RunEvent):
                framed_here = True
                parts.append(b"data: " + _dumps(item.data) + b"\n\n")
            else:
                end = item
                break
        if parts:
            if not responder.started:
                await responder.start(200, [_SSE, (b"cache-control", b"no-cache"), *head])
            data = b"".join(parts)
            if scan is not None:
                scan(data)
            await responder.chunk(data)
        if end is not None:
            _end_of(end)
            if not responder.started:
                await responder.start(200, [_SSE, (b"cache-control", b"no-cache"), *head])
            await responder.finish(b"data: [DONE]\n\n" if framed_here else b"")
            return


async def _relay_whole(
    run: RunChannel,
    responder: Responder,
    head: list[tuple[bytes, bytes]],
    first: RunMessage | None = None,
    scan: Callable[[bytes], None] | None = None,
) -> None:
    """Relay a non-stream run: the body bytes (v2 records) or the one response object (v1).

    ``first`` is the run's first message when the caller received it already.
    Messages that arrived with it are taken without waiting (the answer and its
    end usually come in one read: no scheduling round between them). When the
    whole answer came before this task took any of it, the node link's reader
    has written it to the client already (:meth:`RunChannel.answer_whole`):
    the client has its answer one scheduling round sooner, and this task only
    goes through the run's messages.
    """
    parts: list[bytes] = []
    while True:
        if first is None:
            first = await _next(run)
        for message in (first, *run.buffered()):
            if isinstance(message, RunData):
                parts.append(message.data)
            elif isinstance(message, RunEvent):
                parts.append(_dumps(message.data))
            else:
                _end_of(message)
                if not parts:
                    raise RequestRejected(
                        502, "upstream_error", "the node ended the run without a response", type="upstream_error"
                    )
                answer = b"".join(parts)
                if scan is not None:
                    scan(answer)
                if not run.answered:
                    await responder.whole(200, [_JSON, *head], answer)
                return
        first = None


class _ClientGone(RequestRejected):
    """The client disconnected before its request body arrived; nothing to answer."""

    def __init__(self) -> None:
        super().__init__(499, "client_closed", "client closed the connection")


def _reject_constant(name: str) -> None:
    # The stdlib reads NaN/Infinity; the node link (strict JSON) could not carry them.
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as infinity
        raise ValueError(f"number {text[:30]} is out of range")
    return value


REJECT_BOUND_S = 1.0
"""How long an error answer may take to write, shielded from the request's cancellation (:meth:`Responder.reject`)."""

_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)
"""The request body's decoder, built once (``json.loads`` with hooks builds one per call)."""


def _standby_refusal(ha: EdgeHa) -> RequestRejected:
    """[ha-election] A standby's (or a stepped-down leader's) 503: retry after a TTL, at the leader."""
    leader = ha.leadership.leader
    where = f"; the leader is {leader}" if leader else "; no Edge leads at the moment"
    return RequestRejected(
        503,
        "not_leader",
        "this Edge does not lead" + where,
        type="service_unavailable",
        retry_after=ha.retry_after(),
        leader=leader,
    )


def _header_pairs(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    return [(name.encode(), value.encode()) for name, value in headers]


def _framing(headers: Iterable[tuple[bytes, bytes]], body: bytes) -> list[tuple[bytes, bytes]]:
    """``headers`` and the ``content-length`` of ``body``.

    With a content-length the server frames the body as is; without one it
    chunk-encodes it and writes the terminating chunk as one more socket send.
    """
    return [*headers, (b"content-length", b"%d" % len(body))]


def _too_large(limit: int) -> RequestRejected:
    return RequestRejected(413, "request_too_large", f"request body exceeds {limit} bytes")


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
