"""iop_admission: provider-wide leases, one fair global queue, connectivity
generations, live refresh and an honest snapshot -- plus the node-local gate.

See ``docs/admission.md`` for the semantics.
"""

from ._admission import Admission, AdmissionEvent, LeaseScope
from ._config import ModelGroup, PoolConfig, ProviderKey, ProviderSpec, QueuePolicy, validate_pool
from ._errors import (
    AdmissionError,
    ConcurrencyLimitExceeded,
    ConfigError,
    LeaseRevoked,
    ModelNotFound,
    QueueFull,
    QueueTimeout,
    Unavailable,
)
from ._gate import GateStatistics, LocalGate, Permit
from ._snapshot import ProviderSnapshot, Snapshot
from ._state import Lease

__all__ = [
    "Admission",
    "AdmissionError",
    "AdmissionEvent",
    "ConcurrencyLimitExceeded",
    "ConfigError",
    "GateStatistics",
    "Lease",
    "LeaseRevoked",
    "LeaseScope",
    "LocalGate",
    "ModelGroup",
    "ModelNotFound",
    "Permit",
    "PoolConfig",
    "ProviderKey",
    "ProviderSnapshot",
    "ProviderSpec",
    "QueueFull",
    "QueuePolicy",
    "QueueTimeout",
    "Snapshot",
    "Unavailable",
    "validate_pool",
]
