"""KV cache views made by vLLM's own ``create_kv_cache_views``, and a decode
rank holding them in another process (``python -m tests.vllm.layout_peer``).

``vllm_views`` allocates as vLLM 0.32's ``get_kv_cache_config_from_groups``
and ``allocate_kv_cache`` do for one KV cache group: the strides of the
resolved layout (``compute_layout_strides``), padded pages, kernel blocks,
MLA's one latent head. ``Peer`` starts the child, whose argument is its
buffer's size (``RAW_BYTES``), and asks it JSON lines on its stdin:

* ``{"op": "setup", "views": {...}}``: new views (``vllm_views``' keywords)
  registered with its own Mooncake engine -> ``{"peer": <peer message, hex>}``;
* ``{"op": "heads", "blocks": [...]}`` -> ``{"heads": [[sha256 of head h of
  block b over every layer, ...], ...]}``;
* ``{"op": "quit"}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvguard.vllm.kv_views import KVGeometry, describe

RAW_BYTES = 4 << 20  # the child's buffer (its argument): enough for every test's views
ROOT = Path(__file__).resolve().parents[2]
WAIT = 30.0  # for a reply


def vllm_views(
    name: str,
    layers: int,
    blocks: int,
    heads: int,
    block_size: int = 16,
    head_size: int = 8,
    kernel: int | None = None,
    padded_page: int | None = None,
    mla: bool = False,
    raw: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(vLLM's flat buffer, its per-layer views) for one group of ``layers``
    layers, ``heads`` KV heads on this rank, in layout ``name``; in ``raw``
    (zeroed first) if given, else in a new buffer."""
    layout = KVCacheLayout[name]
    spec: FullAttentionSpec
    if mla:
        spec = MLAAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=head_size, dtype=torch.bfloat16
        )
    else:
        spec = FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=heads,
            head_size=head_size,
            dtype=torch.bfloat16,
            page_size_padded=padded_page,
        )
    page = spec.page_size_bytes
    fixed = layers * page if layout.is_block_outermost else padded_page
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, blocks, layers, layout, fixed_strides=(None, fixed, None, None, None)
    )
    size = layers * page * blocks
    names = [f"model.layers.{i}.self_attn" for i in range(layers)]
    tensor = KVCacheTensor(
        size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride
    )
    if raw is None:
        raw = torch.zeros(size, dtype=torch.int8)
    assert raw.numel() >= size, (raw.numel(), size)
    raw.zero_()
    views = create_kv_cache_views(raw, spec, blocks, layout, tensor, kernel_block_size=kernel)
    return raw, views


def head_digests(
    views: Sequence[torch.Tensor], blocks: Sequence[int], kernel: int
) -> list[list[str]]:
    """sha256 of each head of each block, over every layer's bytes of it."""
    out = []
    for b in blocks:
        row = []
        for h in range(int(views[0].shape[1])):
            d = hashlib.sha256()
            for v in views:
                part = v[b * kernel : (b + 1) * kernel, h].contiguous()
                d.update(part.view(torch.uint8).numpy().tobytes())
            row.append(d.hexdigest())
        out.append(row)
    return out


def kernel_of(views: Sequence[torch.Tensor], blocks: int) -> int:
    return int(views[0].shape[0]) // blocks


class Peer:
    """A ``tests.vllm.layout_peer`` child: one decode rank in another process."""

    def __init__(self, raw_bytes: int = RAW_BYTES) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.vllm.layout_peer", str(raw_bytes)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.session_id = str(self._read(120.0)["ready"])

    def _read(self, timeout: float) -> dict[str, Any]:
        out = self.proc.stdout
        assert out is not None
        while True:  # vLLM may log to stdout: replies are the JSON lines
            ready, _, _ = select.select([out], [], [], timeout)
            assert ready, f"layout peer pid {self.proc.pid} said nothing in {timeout}s"
            line = out.readline()
            assert line, f"layout peer pid {self.proc.pid} exited {self.proc.poll()}"
            if line.startswith("{"):
                reply: dict[str, Any] = json.loads(line)
                return reply

    def ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(WAIT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def main() -> None:
    from transfer.mooncake import MooncakeBackend
    from transfer.peer_protocol import peer_info_to_message

    backend = MooncakeBackend(transfer_timeout_s=5)
    # One allocation for every setup: the engine registers the same memory each time.
    raw = torch.zeros(int(sys.argv[1]) if len(sys.argv) > 1 else RAW_BYTES, dtype=torch.int8)
    held: tuple[KVGeometry, Any, list[torch.Tensor]] | None = None
    print(json.dumps({"ready": backend.session_id}), flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "setup":
                if held is not None:
                    backend.unregister(held[1])
                kw = cmd["views"]
                _, views = vllm_views(**kw, raw=raw)
                geo = describe(views, kw["name"], kw["blocks"])
                cache = geo.cache()
                backend.register(cache)
                held = (geo, cache, views)
                msg = peer_info_to_message(cache.peer_info(backend.session_id))
                reply: dict[str, Any] = {"peer": msg.hex()}
            elif cmd["op"] == "heads":
                assert held is not None
                views = held[2]
                kernel = kernel_of(views, held[0].layout.num_blocks)
                reply = {"heads": head_digests(views, cmd["blocks"], kernel)}
            else:
                break
            print(json.dumps(reply), flush=True)
    finally:
        backend.close()


if __name__ == "__main__":
    main()
