"""What the queue page needs of the Edge ([queue-page]), and those parts for a page served alone."""

from __future__ import annotations

from typing import Protocol, final

import attrs

from iop_admission import Admission
from iop_edge.config import UiConfig


class PageConfig(Protocol):
    """What the page reads of the Edge's config (an :class:`~iop_edge.config.EdgeConfig`)."""

    @property
    def ui(self) -> UiConfig: ...
    @property
    def admin_token(self) -> str | None: ...


class PageParts(Protocol):
    """What the page needs of the Edge."""

    @property
    def config(self) -> PageConfig: ...
    @property
    def admission(self) -> Admission: ...


@final
@attrs.define
class PageAlone:
    """The parts of a page served without an Edge, over an admission core of its own (the
    benchmarks, the browser tests): its ``ui`` settings (replace them to change them) and no
    admin token unless given. Its own :attr:`config`."""

    admission: Admission
    ui: UiConfig
    admin_token: str | None = None

    @property
    def config(self) -> PageAlone:
        return self
