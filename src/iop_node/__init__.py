"""iop_node: the Node daemon -- Edge client, adapters, and the node-local gate.

``iop-node --config node.yaml`` connects to the Edge, registers, heartbeats and
runs the Edge's requests on local backends through one
:class:`~iop_admission.LocalGate` ([tunnel-guard], [runtime-concurrency]).
See ``docs/node.md``.
"""

from ._adapter import Adapter, TunnelHead, encoded_run, relay_encoded
from ._client import EdgeClient, backoff_delay, first_delay, websocket_connector
from ._edges import EdgeClients
from ._errors import (
    BadRunRequest,
    EdgeProtocolViolation,
    NodeError,
    RegistrationRejected,
    RegistrationTimeout,
    RunFailed,
    UpstreamFailed,
    UpstreamUnreachable,
)
from ._fence import EpochFence
from ._mock_adapter import MockAdapter
from ._ollama import OllamaAdapter
from ._openai import OpenAIAdapter
from ._runtime import NodeRuntime, build_adapter
from ._session import EdgeSession
from .config import NodeConfig, ProviderConfig, ReconnectConfig, RuntimeConfig, load_node_config

__all__ = [
    "Adapter",
    "BadRunRequest",
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
    "TunnelHead",
    "UpstreamFailed",
    "UpstreamUnreachable",
    "backoff_delay",
    "build_adapter",
    "encoded_run",
    "first_delay",
    "load_node_config",
    "relay_encoded",
    "websocket_connector",
]
