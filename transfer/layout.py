"""The shape of a paged KV cache: what two sides of a transfer exchange.

A cache is ``num_buffers`` contiguous byte buffers, one per (layer, K/V) -- or
one per layer when K and V share a buffer (MLA). Every buffer holds
``num_blocks`` blocks of ``block_bytes`` each, so block ``b`` of buffer ``i``
lives at ``buffer_bases[i] + b * block_bytes``. A strided cache (a view of
vLLM's KV cache in a layout that is not one dense page per layer and block:
padded pages, blocks that span every layer, heads outside blocks) sets
``block_stride`` > ``block_bytes``: block ``b`` of buffer ``i`` is then the
``block_bytes`` at ``buffer_bases[i] + b * block_stride``, and its buffers are
"units" (a layer, a layer's head, or every layer), not necessarily layers.
``KVLayout`` is this pure
description; ``transfer.cache.KVCache`` binds it to torch tensors. Imports no
torch, so peers and backends can name a layout without loading it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["KVLayout"]

_INT_FIELDS = ("num_layers", "num_blocks", "block_bytes")
_OPTIONAL_INT_FIELDS = ("block_stride",)
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
    block_stride: int = 0  # bytes from one block to the next in a buffer; 0: block_bytes

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if not isinstance(self.kv_split, bool):
            raise ValueError(f"KVLayout.kv_split must be a bool, got {self.kv_split!r}")
        stride = self.block_stride
        if not _is_int(stride) or (stride != 0 and stride < self.block_bytes):
            raise ValueError(
                f"KVLayout.block_stride must be 0 or an int >= block_bytes "
                f"({self.block_bytes}), got {stride!r}"
            )

    @property
    def stride(self) -> int:
        """Bytes from block ``b`` to block ``b + 1`` of a buffer."""
        return self.block_stride or self.block_bytes

    @property
    def dense(self) -> bool:
        """Whether neighbouring blocks of a buffer touch (runs of them are one range)."""
        return self.stride == self.block_bytes

    @property
    def buffers_per_layer(self) -> int:
        return 2 if self.kv_split else 1

    @property
    def num_buffers(self) -> int:
        """Buffer index = layer * buffers_per_layer + (0 for K, 1 for V)."""
        return self.num_layers * self.buffers_per_layer

    @property
    def buffer_bytes(self) -> int:
        """From a buffer's first byte to its last block's last byte."""
        return (self.num_blocks - 1) * self.stride + self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_buffers * self.buffer_bytes

    def to_dict(self) -> dict[str, int | bool]:
        d: dict[str, int | bool] = {
            "num_layers": self.num_layers,
            "num_blocks": self.num_blocks,
            "block_bytes": self.block_bytes,
            "kv_split": self.kv_split,
        }
        if self.block_stride:
            d["block_stride"] = self.block_stride
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> KVLayout:
        """Parse a peer message strictly: exact keys, exact types."""
        if not isinstance(d, Mapping):
            raise ValueError(f"KVLayout must be a mapping, got {type(d).__name__}")
        known = {*_INT_FIELDS, *_OPTIONAL_INT_FIELDS, *_BOOL_FIELDS}
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
            block_stride=_int_field(d, "block_stride") if "block_stride" in d else 0,
        )


def _int_field(d: Mapping[str, object], name: str) -> int:
    value = d[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"KVLayout.{name} must be an int, got {value!r}")
    return value
