"""The Edge config file (``edge.yaml``): its schema, checks and mapping to a PoolConfig.

:mod:`.schema` holds the file's parts as values; :mod:`.edge` the whole file, its cross-field
rules and its mapping to a PoolConfig; :mod:`.loading` the converter and :func:`load_edge_config`;
:mod:`.reader` reads a reload's file in a child process, off the event loop.
"""

from iop_edge.config.edge import EdgeConfig, tenant_problems
from iop_edge.config.loading import MEMO_SIZE, load_edge_config
from iop_edge.config.models import EdgeCandidate, EdgeModel
from iop_edge.config.schema import (
    TENANT_COSTS,
    ApiKeyDigest,
    ApiTls,
    EdgeNode,
    EdgeProvider,
    EdgeTenant,
    HaConfig,
    HostPort,
    NodeTls,
    OutlierSettings,
    OverloadConfig,
    ProviderPool,
    RetrySettings,
    UiConfig,
    parse_host_port,
)

__all__ = [
    "MEMO_SIZE",
    "TENANT_COSTS",
    "ApiKeyDigest",
    "ApiTls",
    "EdgeCandidate",
    "EdgeConfig",
    "EdgeModel",
    "EdgeNode",
    "EdgeProvider",
    "EdgeTenant",
    "HaConfig",
    "HostPort",
    "NodeTls",
    "OutlierSettings",
    "OverloadConfig",
    "ProviderPool",
    "RetrySettings",
    "UiConfig",
    "load_edge_config",
    "parse_host_port",
    "tenant_problems",
]
