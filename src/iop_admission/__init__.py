"""iop_admission: provider-wide leases, one fair global queue, connectivity
generations, live refresh, an honest snapshot, passive provider health
(ejection, probes, panic mode) and retries that keep their place -- plus the
node-local gate.

See ``docs/admission.md`` for the semantics.
"""

from importlib.metadata import PackageNotFoundError, version

from ._config import (
    ModelGroup,
    OutlierPolicy,
    PoolConfig,
    ProviderKey,
    ProviderReport,
    ProviderSpec,
    QueuePolicy,
    RetryPolicy,
    validate_pool,
)
from ._core.records import Lease
from ._core.refresh import PreparedRefresh
from ._errors import (
    AdmissionError,
    ConcurrencyLimitExceeded,
    ConfigError,
    LeaseRevoked,
    LeaseScopeError,
    ModelNotFound,
    NodeNotFound,
    QueueFull,
    QueueTimeout,
    RetriesExhausted,
    TenantLimitExceeded,
    Unavailable,
)
from ._fairness import TenantSpec
from ._gate import GateStatistics, LocalGate, Permit
from ._layers.trio import Admission, AdmissionEvent, LeaseScope
from ._snapshot import PROVIDER_FIELDS, ProviderRow, ProviderSnapshot, Snapshot, TenantSnapshot
from ._waiting import WaiterSnapshot

try:
    __version__: str = version("iop-admission")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "PROVIDER_FIELDS",
    "Admission",
    "AdmissionError",
    "AdmissionEvent",
    "ConcurrencyLimitExceeded",
    "ConfigError",
    "GateStatistics",
    "Lease",
    "LeaseRevoked",
    "LeaseScope",
    "LeaseScopeError",
    "LocalGate",
    "ModelGroup",
    "ModelNotFound",
    "NodeNotFound",
    "OutlierPolicy",
    "Permit",
    "PoolConfig",
    "PreparedRefresh",
    "ProviderKey",
    "ProviderReport",
    "ProviderRow",
    "ProviderSnapshot",
    "ProviderSpec",
    "QueueFull",
    "QueuePolicy",
    "QueueTimeout",
    "RetriesExhausted",
    "RetryPolicy",
    "Snapshot",
    "TenantLimitExceeded",
    "TenantSnapshot",
    "TenantSpec",
    "Unavailable",
    "WaiterSnapshot",
    "__version__",
    "validate_pool",
]
