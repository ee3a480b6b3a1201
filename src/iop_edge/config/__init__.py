"""The Edge config file (``edge.yaml``): its schema, checks and mapping to a PoolConfig.

:mod:`.edge` holds the file's structure and checks; :mod:`.reader` reads a reload's file
off the event loop.
"""

from iop_edge.config.edge import (
    MEMO_SIZE,
    TENANT_COSTS,
    ApiKeyDigest,
    ApiTls,
    EdgeCandidate,
    EdgeConfig,
    EdgeModel,
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
    load_edge_config,
    parse_host_port,
    tenant_problems,
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
