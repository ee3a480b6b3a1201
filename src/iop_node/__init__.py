"""iop_node: the Node daemon -- Edge client, adapters, and the node-local gate.

``iop-node --config node.yaml`` connects to the Edge, registers, heartbeats and
runs the Edge's requests on local backends through one
:class:`~iop_admission.LocalGate` ([tunnel-guard], [runtime-concurrency]).
See ``docs/node.md``.
"""

from iop_node._errors import (
    BadRunRequest,
    DeadlineExceeded,
    EdgeProtocolViolation,
    NodeError,
    RegistrationRejected,
    RegistrationTimeout,
    RunFailed,
    StaleEpoch,
    StreamStalled,
    UpstreamFailed,
    UpstreamTooLarge,
    UpstreamUnreachable,
)
from iop_node._runtime import NodeRuntime, build_adapter
from iop_node.adapters.interface import Adapter, TunnelHead, encoded_run, relay_encoded
from iop_node.adapters.mock import MockAdapter
from iop_node.adapters.ollama import OllamaAdapter
from iop_node.adapters.openai_compat import OpenAIAdapter
from iop_node.config import (
    NodeConfig,
    ProviderConfig,
    ReconnectConfig,
    RuntimeConfig,
    UpstreamLimits,
    load_node_config,
)
from iop_node.edges.client import EdgeClient, backoff_delay, first_delay, websocket_connector
from iop_node.edges.clients import EdgeClients
from iop_node.edges.fence import EpochFence
from iop_node.edges.session import EdgeSession

__all__ = [
    "Adapter",
    "BadRunRequest",
    "DeadlineExceeded",
    "EdgeClient",
    "EdgeClients",
    "EdgeProtocolViolation",
    "EdgeSession",
    "EpochFence",
    "MockAdapter",
    "NodeConfig",
    "NodeError",
    "NodeRuntime",
    "OllamaAdapter",
    "OpenAIAdapter",
    "ProviderConfig",
    "ReconnectConfig",
    "RegistrationRejected",
    "RegistrationTimeout",
    "RunFailed",
    "RuntimeConfig",
    "StaleEpoch",
    "StreamStalled",
    "TunnelHead",
    "UpstreamFailed",
    "UpstreamLimits",
    "UpstreamTooLarge",
    "UpstreamUnreachable",
    "backoff_delay",
    "build_adapter",
    "encoded_run",
    "first_delay",
    "load_node_config",
    "relay_encoded",
    "websocket_connector",
]
