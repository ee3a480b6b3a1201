"""The Edge's own page app (:class:`iop_edge.QueuePage`) served by a tiny hypercorn (trio) server
over an admission core a test configures: a fleet of any shape (tenants, long names, offline
nodes) without Edge and Node processes. The page's memory runs (``QueuePage.run``) as the
Edge runs it."""

from __future__ import annotations

import functools

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from iop_admission import Admission
from iop_edge import QueuePage
from iop_edge.config import UiConfig
from iop_edge.ui.parts import PageAlone


async def serve_page(nursery: trio.Nursery, admission: Admission, ui: UiConfig) -> tuple[str, PageAlone]:
    """Serve the page for ``admission`` on 127.0.0.1 (a free port) until ``nursery`` ends: its base
    URL, and its parts (replace their ``ui`` to change the settings, e.g. rotate the token)."""
    parts = PageAlone(admission, ui)
    page = QueuePage(parts)
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = config.errorlog = None
    nursery.start_soon(page.run)
    binds = await nursery.start(functools.partial(serve, page, config))
    return binds[0], parts
