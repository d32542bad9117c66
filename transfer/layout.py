"""The shape of a paged KV cache: what two sides of a transfer exchange.

A cache is ``num_buffers`` contiguous byte buffers, one per (layer, K/V) -- or
one per layer when K and V share a buffer (MLA). Every buffer holds
``num_blocks`` blocks of ``block_bytes`` each, so block ``b`` of buffer ``i``
lives at ``buffer_bases[i] + b * block_bytes``. ``KVLayout`` is this pure
description; ``transfer.cache.KVCache`` binds it to torch tensors. Imports no
torch, so peers and backends can name a layout without loading it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["KVLayout"]

_INT_FIELDS = ("num_layers", "num_blocks", "block_bytes")
_BOOL_FIELDS = ("kv_split",)


def _is_int(value: object) -> bool:
    # bool is an int subclass; a block count of True is a bug, not a 1.
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Geometry of a paged KV cache. Immutable and validated on construction."""

    num_layers: int  # > 0
    num_blocks: int  # > 0; may differ between the two sides of a transfer
    block_bytes: int  # > 0; bytes of one block in one buffer
    kv_split: bool = True  # True: K and V buffers per layer; False: one (MLA)

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if not isinstance(self.kv_split, bool):
            raise ValueError(f"KVLayout.kv_split must be a bool, got {self.kv_split!r}")

    @property
    def buffers_per_layer(self) -> int:
        return 2 if self.kv_split else 1

    @property
    def num_buffers(self) -> int:
        """Buffer index = layer * buffers_per_layer + (0 for K, 1 for V)."""
        return self.num_layers * self.buffers_per_layer

    @property
    def buffer_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_buffers * self.buffer_bytes

    def to_dict(self) -> dict[str, int | bool]:
        return {
            "num_layers": self.num_layers,
            "num_blocks": self.num_blocks,
            "block_bytes": self.block_bytes,
            "kv_split": self.kv_split,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> KVLayout:
        """Parse a peer message strictly: exact keys, exact types."""
        if not isinstance(d, Mapping):
            raise ValueError(f"KVLayout must be a mapping, got {type(d).__name__}")
        known = {*_INT_FIELDS, *_BOOL_FIELDS}
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise ValueError(f"KVLayout: unknown keys {unknown}")
        missing = [k for k in _INT_FIELDS if k not in d]
        if missing:
            raise ValueError(f"KVLayout: missing keys {missing}")
        kv_split = d.get("kv_split", True)
        if not isinstance(kv_split, bool):
            raise ValueError(f"KVLayout.kv_split must be a bool, got {kv_split!r}")
        return cls(
            num_layers=_int_field(d, "num_layers"),
            num_blocks=_int_field(d, "num_blocks"),
            block_bytes=_int_field(d, "block_bytes"),
            kv_split=kv_split,
        )


def _int_field(d: Mapping[str, object], name: str) -> int:
    value = d[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"KVLayout.{name} must be an int, got {value!r}")
    return value
