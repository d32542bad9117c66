"""kvguard transfer: move KV-cache blocks and type every failure.

KV cache layout over torch tensors, validated and coalesced transfer plans,
backends (the real Mooncake engine, an in-process local one), typed errors
and fault injection. Imports ``lifecycle`` only.
"""

from typing import TYPE_CHECKING

from lifecycle._lazy import lazy_getattr

# Imported on first use (PEP 562): torch and the engine load only when a
# name that needs them is used, so torch-free submodules (errors, metadata,
# service_args) and the commands that move no KV stay fast. Name -> module.
_LAZY = {
    "Batch": ".backend",
    "PeerInfo": ".backend",
    "TransferBackend": ".backend",
    "TransferOp": ".backend",
    "TransferPlan": ".backend",
    "KVCache": ".cache",
    "BackendClosed": ".errors",
    "Backpressure": ".errors",
    "EngineError": ".errors",
    "InvalidPlan": ".errors",
    "PeerLost": ".errors",
    "PeerProtocolError": ".errors",
    "PeerUnreachable": ".errors",
    "RegistrationError": ".errors",
    "RemoteRangeRejected": ".errors",
    "TransferCancelled": ".errors",
    "TransferError": ".errors",
    "TransferTimeout": ".errors",
    "DEFAULT_FAULT_KINDS": ".faults",
    "Fault": ".faults",
    "FaultInjectingBackend": ".faults",
    "FaultKind": ".faults",
    "FaultPlan": ".faults",
    "KVLayout": ".layout",
    "LocalBackend": ".local",
    "MooncakeBackend": ".mooncake",
    "block_digests": ".peer_protocol",
    "peer_info_from_message": ".peer_protocol",
    "peer_info_to_message": ".peer_protocol",
    "DEFAULT_MAX_BATCH_ENTRIES": ".plan",
    "MAX_BATCH_ENTRIES_LIMIT": ".plan",
    "build_plan": ".plan",
    "plan_entries_naive": ".plan",
    "Region": ".regions",
}

if TYPE_CHECKING:
    from .backend import Batch, PeerInfo, TransferBackend, TransferOp, TransferPlan
    from .cache import KVCache
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
    from .layout import KVLayout
    from .local import LocalBackend
    from .mooncake import MooncakeBackend
    from .peer_protocol import block_digests, peer_info_from_message, peer_info_to_message
    from .plan import (
        DEFAULT_MAX_BATCH_ENTRIES,
        MAX_BATCH_ENTRIES_LIMIT,
        build_plan,
        plan_entries_naive,
    )
    from .regions import Region


__getattr__ = lazy_getattr(__name__, _LAZY, globals())


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
