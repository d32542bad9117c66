"""kvguard transfer: move KV-cache blocks and type every failure.

KV cache layout over torch tensors, validated and coalesced transfer plans,
backends (the real Mooncake engine, an in-process local one), typed errors
and fault injection. Imports ``lifecycle`` only.
"""

from typing import TYPE_CHECKING

from lifecycle._lazy import lazy_exports

# The public names, once: module -> what it defines. Imported on first use
# (PEP 562): torch and the engine load only when a name that needs them is
# used, so torch-free submodules (errors, metadata, service_args) and the
# commands that move no KV stay fast.
_EXPORTS = {
    ".backend": ("Batch", "PeerInfo", "TransferBackend", "TransferOp", "TransferPlan"),
    ".cache": ("KVCache",),
    ".errors": (
        "BackendClosed",
        "Backpressure",
        "EngineError",
        "InvalidPlan",
        "PeerLost",
        "PeerProtocolError",
        "PeerUnreachable",
        "RegistrationError",
        "RemoteRangeRejected",
        "TransferCancelled",
        "TransferError",
        "TransferTimeout",
    ),
    ".faults": ("DEFAULT_FAULT_KINDS", "Fault", "FaultInjectingBackend", "FaultKind", "FaultPlan"),
    ".layout": ("KVLayout",),
    ".local": ("LocalBackend",),
    ".mooncake": ("MooncakeBackend",),
    ".peer_protocol": ("block_digests", "peer_info_from_message", "peer_info_to_message"),
    ".plan": (
        "BlockSlice",
        "DEFAULT_MAX_BATCH_ENTRIES",
        "MAX_BATCH_ENTRIES_LIMIT",
        "build_plan",
        "plan_entries_naive",
    ),
    ".regions": ("Region",),
}

__all__, __getattr__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:  # the same names, for type checkers (tests/test_lazy.py: they agree)
    from .backend import Batch as Batch
    from .backend import PeerInfo as PeerInfo
    from .backend import TransferBackend as TransferBackend
    from .backend import TransferOp as TransferOp
    from .backend import TransferPlan as TransferPlan
    from .cache import KVCache as KVCache
    from .errors import BackendClosed as BackendClosed
    from .errors import Backpressure as Backpressure
    from .errors import EngineError as EngineError
    from .errors import InvalidPlan as InvalidPlan
    from .errors import PeerLost as PeerLost
    from .errors import PeerProtocolError as PeerProtocolError
    from .errors import PeerUnreachable as PeerUnreachable
    from .errors import RegistrationError as RegistrationError
    from .errors import RemoteRangeRejected as RemoteRangeRejected
    from .errors import TransferCancelled as TransferCancelled
    from .errors import TransferError as TransferError
    from .errors import TransferTimeout as TransferTimeout
    from .faults import DEFAULT_FAULT_KINDS as DEFAULT_FAULT_KINDS
    from .faults import Fault as Fault
    from .faults import FaultInjectingBackend as FaultInjectingBackend
    from .faults import FaultKind as FaultKind
    from .faults import FaultPlan as FaultPlan
    from .layout import KVLayout as KVLayout
    from .local import LocalBackend as LocalBackend
    from .mooncake import MooncakeBackend as MooncakeBackend
    from .peer_protocol import block_digests as block_digests
    from .peer_protocol import peer_info_from_message as peer_info_from_message
    from .peer_protocol import peer_info_to_message as peer_info_to_message
    from .plan import DEFAULT_MAX_BATCH_ENTRIES as DEFAULT_MAX_BATCH_ENTRIES
    from .plan import MAX_BATCH_ENTRIES_LIMIT as MAX_BATCH_ENTRIES_LIMIT
    from .plan import BlockSlice as BlockSlice
    from .plan import build_plan as build_plan
    from .plan import plan_entries_naive as plan_entries_naive
    from .regions import Region as Region
