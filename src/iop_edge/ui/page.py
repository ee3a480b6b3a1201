"""The live queue page ([queue-page]): ``GET /ui`` and its server-sent event stream ``GET /ui/stream``.

A small ASGI app of its own, mounted by :class:`~iop_edge.api.app.EdgeAPI` on
those two paths. The page is one HTML document with its script and style inlined
from the package (``iop_edge/ui/``): no CDN, no build step, nothing fetched but
the stream. Off unless ``ui.enabled``; a viewer shows the admin token or the
viewer token (``Authorization: Bearer``, as the page sends it, or ``?token=``
for tools that cannot send a header); at most ``ui.max_viewers`` streams at once.

A stream opens with the page's memory (:mod:`.memory`, kept by :meth:`QueuePage.run`
from the Edge's start): one ``history`` event with the chart series of the last
minutes. Then every ``ui.update_interval_ms`` it reads the view for its filter and
sends it when it changed (a comment line after 5 s of silence keeps proxies from
closing an idle stream and tells the page the stream is alive). A view is built
once per interval and filter, whatever the number of viewers: the state is read on the loop in one synchronous step
(``Admission.snapshot`` and ``Admission.waiters`` together), the view model
(:mod:`.view`, capped in rows) and its JSON are made in a worker thread.
"""

from __future__ import annotations

import base64
import hashlib
import json
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping
from importlib import resources
from typing import Any, final

import trio

from iop_edge._off_loop import run_off_loop
from iop_edge.api.rejections import bearer
from iop_edge.listener.asgi import last_value, watch_disconnect
from iop_edge.ui.history import RECENT
from iop_edge.ui.memory import SAMPLE_S, PageMemory
from iop_edge.ui.parts import PageParts
from iop_edge.ui.view import ViewFilter, ViewLimits, build_view

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

PAGE_PATH = "/ui"
STREAM_PATH = "/ui/stream"
PATHS = frozenset((PAGE_PATH, STREAM_PATH))
"""The request paths the queue page answers."""

_KEEPALIVE_S = 5.0
_CACHE_MAX = 64  # views kept (one per filter); cleared when more filters are asked for


def _page_and_policy() -> tuple[bytes, bytes]:
    """The page with its script and style inlined, and a content security policy allowing only
    that script (by hash), that style and the stream on this origin."""
    folder = resources.files("iop_edge") / "ui"
    script = (folder / "app.js").read_text("utf-8")
    style = (folder / "style.css").read_text("utf-8")
    html = (folder / "page.html").read_text("utf-8").replace("/*STYLE*/", style).replace("/*SCRIPT*/", script)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    policy = (
        f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return html.encode(), policy.encode()


@final
class QueuePage:
    """The ``/ui`` app of one Edge; counts its viewers."""

    def __init__(self, parts: PageParts) -> None:
        self._parts = parts
        self._page: tuple[bytes, bytes] | None = None  # read from the package on first use
        self._views: dict[ViewFilter, tuple[float, bytes]] = {}
        self._building: dict[ViewFilter, trio.Event] = {}
        self.memory = PageMemory(parts)
        """The chart series and the activity counts, kept from the Edge's start."""
        self.viewers = 0
        """Streams running now."""

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        config = self._parts.config
        ui = config.ui
        if not ui.enabled:
            await _answer(send, 404, "not_found", f"no route for {scope['path']}")
            return
        if scope["method"] != "GET":
            await _answer(send, 405, "method_not_allowed", f"{scope['method']} is not allowed here")
            return
        query = urllib.parse.parse_qs(bytes(scope.get("query_string", b"")).decode("latin-1"), encoding="latin-1")
        token = bearer(scope["headers"]) or last_value(query, "token") or ""
        if not ui.accepts(token, config.admin_token):
            await _answer(send, 401, "unauthorized", "a viewer or admin token is required", "authentication_error")
            return
        if scope["path"] == PAGE_PATH:
            await self._serve_page(send)
            return
        if self.viewers >= ui.max_viewers:
            await _answer(send, 429, "too_many_viewers", f"at most {ui.max_viewers} viewers at once")
            return
        wanted = ViewFilter(
            node=last_value(query, "node") or "",
            model=last_value(query, "model") or "",
            health=last_value(query, "health") or "",
            tenant=last_value(query, "tenant") or "",
        )
        self.viewers += 1
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_disconnect, receive, nursery.cancel_scope)
                await self._stream(send, wanted)
        finally:
            self.viewers -= 1

    async def _serve_page(self, send: Send) -> None:
        if self._page is None:
            self._page = _page_and_policy()
        body, policy = self._page
        headers = [
            (b"content-type", b"text/html; charset=utf-8"),
            (b"content-security-policy", policy),
            *_PRIVATE,
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _stream(self, send: Send, wanted: ViewFilter) -> None:
        """Send the history, then the view whenever it changed, at most once an interval, until the
        client goes."""
        headers = [(b"content-type", b"text/event-stream"), *_PRIVATE]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        history = {"interval": SAMPLE_S, "samples": self.memory.history.samples()}
        body = b"event: history\ndata: " + json.dumps(history, separators=(",", ":")).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": body, "more_body": True})
        sent = b""
        quiet_since = trio.current_time()
        while True:
            interval = self._parts.config.ui.update_interval_ms / 1000
            view = await self.view(wanted)
            now = trio.current_time()
            if view != sent:
                await send({"type": "http.response.body", "body": b"data: " + view + b"\n\n", "more_body": True})
                sent, quiet_since = view, now
            elif now - quiet_since >= _KEEPALIVE_S:
                await send({"type": "http.response.body", "body": b": keepalive\n\n", "more_body": True})
                quiet_since = now
            await trio.sleep(interval)

    async def run(self) -> None:
        """Keep the page's memory (:meth:`PageMemory.run`) until cancelled: the Edge starts it with
        its other tasks. Checkpoints."""
        await self.memory.run()

    async def view(self, wanted: ViewFilter) -> bytes:
        """The view for ``wanted`` as JSON: built at most once per update interval, shared by its viewers.

        The state is read on the loop in one step; the view model and the JSON are made
        in a worker thread that yields to the loop as it goes (:func:`run_off_loop`).
        """
        while True:
            now = trio.current_time()
            ui = self._parts.config.ui
            cached = self._views.get(wanted)
            if cached is not None and now - cached[0] < ui.update_interval_ms / 2000:
                return cached[1]
            building = self._building.get(wanted)
            if building is None:
                break
            await building.wait()  # another viewer of this filter builds it
        self._building[wanted] = done = trio.Event()
        try:
            admission = self._parts.admission
            snapshot, waiters = admission.snapshot(), admission.waiters()  # one step: one instant
            models = admission.config.models
            limits = ViewLimits(providers=ui.max_provider_rows, waiters=ui.max_waiter_rows)
            activity, unknown = self.memory.activity.by_model(wanted.model), self.memory.activity.unknown()
            recent = self.memory.history.samples(RECENT)

            def work() -> bytes:
                document = build_view(snapshot, waiters, models, wanted=wanted, limits=limits)
                document["activity"] = activity
                document["unknown_model"] = unknown
                document["recent"] = recent
                return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()

            body = await run_off_loop(work)
            if len(self._views) >= _CACHE_MAX:
                self._views.clear()
            self._views[wanted] = (trio.current_time(), body)
            return body
        finally:
            del self._building[wanted]
            done.set()


_PRIVATE = (
    (b"cache-control", b"no-store"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
)


async def _answer(send: Send, status: int, code: str, message: str, kind: str = "invalid_request_error") -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "code": code}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *_PRIVATE]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
