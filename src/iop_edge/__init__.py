"""iop_edge: the Edge daemon -- OpenAI-compatible HTTP API, node socket, live refresh.

The Edge only wires transport to :mod:`iop_admission`; it keeps no counter or
queue of its own.

Besides the daemon's pieces, the config reload's reader (:func:`run_config_reader`,
:func:`rebuild_config`, :func:`lower_priority`) and the queue page's view
(:class:`QueuePage`, :func:`build_view`) are public so the benchmarks measure them
through public names, and so are the readings of a large pool a slice per loop turn
(:func:`snapshot_in_slices`, :func:`rows_in_slices`) and the release of a large config
a slice per turn (:func:`release_in_slices`), which the tests hold.
"""

from iop_edge._off_loop import release_in_slices, rows_in_slices, snapshot_in_slices
from iop_edge._service import EdgeService
from iop_edge.api.app import EdgeAPI
from iop_edge.api.request_body import estimate_tokens
from iop_edge.config import EdgeConfig, load_edge_config
from iop_edge.config.reader import lower_priority
from iop_edge.config.reader import rebuild as rebuild_config
from iop_edge.config.reader import run_reader as run_config_reader
from iop_edge.nodes.link import NodeLink
from iop_edge.nodes.registry import NodeRegistry
from iop_edge.nodes.runs import NodeGone
from iop_edge.ui.page import QueuePage
from iop_edge.ui.view import build_view

__all__ = [
    "EdgeAPI",
    "EdgeConfig",
    "EdgeService",
    "NodeGone",
    "NodeLink",
    "NodeRegistry",
    "QueuePage",
    "build_view",
    "estimate_tokens",
    "load_edge_config",
    "lower_priority",
    "rebuild_config",
    "release_in_slices",
    "rows_in_slices",
    "run_config_reader",
    "snapshot_in_slices",
]
