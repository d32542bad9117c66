"""kvguard transfer: move KV-cache blocks and type every failure.

KV cache layout over torch tensors, validated and coalesced transfer plans,
backends (the real Mooncake engine, an in-process local one), typed errors
and fault injection. Imports ``lifecycle`` only.
"""

from .backend import Batch, PeerInfo, Region, TransferBackend, TransferOp, TransferPlan
from .errors import (
    BackendClosed,
    Backpressure,
    EngineError,
    InvalidPlan,
    PeerLost,
    PeerProtocolError,
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
from .mooncake import MooncakeBackend
from .peer_protocol import block_digests, peer_info_from_message, peer_info_to_message
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
    "BackendClosed",
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
    "MooncakeBackend",
    "PeerInfo",
    "PeerLost",
    "PeerProtocolError",
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
    "block_digests",
    "build_plan",
    "peer_info_from_message",
    "peer_info_to_message",
    "plan_entries_naive",
]
