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
    TransferError,
    TransferTimeout,
)

__all__ = [
    "Backpressure",
    "Batch",
    "EngineError",
    "InvalidPlan",
    "PeerInfo",
    "PeerLost",
    "PeerUnreachable",
    "Region",
    "RegistrationError",
    "RemoteRangeRejected",
    "TransferBackend",
    "TransferError",
    "TransferOp",
    "TransferPlan",
    "TransferTimeout",
]
