"""kvguard transfer: move KV-cache blocks and type every failure.

KV cache layout over torch tensors, validated and coalesced transfer plans,
backends (the real Mooncake engine, an in-process local one), typed errors
and fault injection. Imports ``lifecycle`` only.
"""

from .backend import Batch, PeerInfo, Region, TransferBackend, TransferOp, TransferPlan
from .errors import (
    Backpressure,
    EngineError,
    InvalidPlan,
    PeerLost,
    PeerUnreachable,
    RegistrationError,
    RemoteRangeRejected,
    TransferCancelled,
    TransferError,
    TransferTimeout,
)
from .faults import DEFAULT_FAULT_KINDS, Fault, FaultInjectingBackend, FaultKind, FaultPlan
from .layout import KVCache, KVLayout
from .local import LocalBackend
from .plan import (
    DEFAULT_MAX_BATCH_ENTRIES,
    MAX_BATCH_ENTRIES_LIMIT,
    build_plan,
    plan_entries_naive,
)

__all__ = [
    "DEFAULT_FAULT_KINDS",
    "DEFAULT_MAX_BATCH_ENTRIES",
    "MAX_BATCH_ENTRIES_LIMIT",
    "Backpressure",
    "Batch",
    "EngineError",
    "Fault",
    "FaultInjectingBackend",
    "FaultKind",
    "FaultPlan",
    "InvalidPlan",
    "KVCache",
    "KVLayout",
    "LocalBackend",
    "PeerInfo",
    "PeerLost",
    "PeerUnreachable",
    "Region",
    "RegistrationError",
    "RemoteRangeRejected",
    "TransferBackend",
    "TransferCancelled",
    "TransferError",
    "TransferOp",
    "TransferPlan",
    "TransferTimeout",
    "build_plan",
    "plan_entries_naive",
]
