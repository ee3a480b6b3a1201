"""iop_edge: the Edge daemon -- OpenAI-compatible HTTP API, node socket, live refresh.

The Edge only wires transport to :mod:`iop_admission`; it keeps no counter or
queue of its own.
"""

from ._http_api import EdgeAPI, estimate_tokens
from ._links import NodeGone, NodeLink, NodeRegistry
from ._service import EdgeService
from .config import EdgeConfig, load_edge_config

__all__ = [
    "EdgeAPI",
    "EdgeConfig",
    "EdgeService",
    "NodeGone",
    "NodeLink",
    "NodeRegistry",
    "estimate_tokens",
    "load_edge_config",
]
