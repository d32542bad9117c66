#!/usr/bin/env python3
"""Move KV blocks between two processes through kvguard, on a GPU, and verify them there.

Not part of CI: run it on a CUDA host with the CUDA build of the engine
(``pip install mooncake-transfer-engine`` in place of the ``-non-cuda``
wheel; docs/vllm.md). It lays out a KV cache the way vLLM 0.32 does
(``--layout``, one of the six; ``tests/layout_helpers.make_views``) on
``--device`` in this process (the prefill) and in a child (the decode),
each with its own Mooncake engine, writes scattered blocks with kvguard's
plan (``kv_views`` units, ``build_plan``), and compares per-block checksums
that both sides compute with torch on the device: nothing is copied to the
host but one integer per block and unit. ``--device cpu`` runs the same
calls on a CPU host.

    python scripts/gpu-smoke.py --device cuda --layout BHLNC
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kvguard.vllm.kv_views import KVGeometry, describe  # noqa: E402
from tests.layout_helpers import LAYOUTS, make_views  # noqa: E402
from transfer import KVCache, build_plan  # noqa: E402
from transfer.mooncake import MooncakeBackend  # noqa: E402
from transfer.peer_protocol import peer_info_from_message, peer_info_to_message  # noqa: E402


def _geometry(args: argparse.Namespace, blocks: int) -> tuple[KVGeometry, KVCache]:
    _, views = make_views(
        args.layout,
        args.layers,
        blocks,
        args.heads,
        args.tokens,
        2 * args.head_size,
        device=args.device,
    )
    geo = describe(views, args.layout, blocks)
    return geo, geo.cache()


def checksums(cache: KVCache, blocks: list[int]) -> list[int]:
    """One int per block: a position-weighted sum of its bytes in every unit,
    computed with torch on the cache's device (only the sums leave it)."""
    lay = cache.layout
    idx = torch.tensor(blocks, dtype=torch.int64, device=cache.device)
    weights = torch.arange(lay.block_bytes, device=cache.device, dtype=torch.int64) % 65521 + 1
    total = torch.zeros(len(blocks), dtype=torch.int64, device=cache.device)
    for i in range(lay.num_buffers):
        rows = cache.rows(i).index_select(0, idx).to(torch.int64)
        total = total * 1000003 + (rows * weights).sum(dim=1)
    return [int(x) for x in total.tolist()]


def decode(args: argparse.Namespace) -> None:
    _, cache = _geometry(args, args.blocks * 2)
    backend = MooncakeBackend(args.host)
    backend.register(cache)
    msg = peer_info_to_message(cache.peer_info(backend.session_id))
    print(json.dumps({"peer": msg.hex()}), flush=True)
    try:
        for line in sys.stdin:
            blocks = json.loads(line)
            print(json.dumps({"sums": checksums(cache, blocks)}), flush=True)
    finally:
        backend.close()


def prefill(args: argparse.Namespace) -> int:
    geo, cache = _geometry(args, args.blocks)
    cache.fill_seeded(1)
    child = subprocess.Popen(
        [sys.executable, __file__, *sys.argv[1:], "--role", "decode"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    backend = MooncakeBackend(args.host)
    try:
        backend.register(cache)
        info = peer_info_from_message(bytes.fromhex(json.loads(child.stdout.readline())["peer"]))
        backend.add_peer(info)
        src = list(range(args.blocks))
        dst = [2 * b + 1 for b in src]  # every other block: nothing coalesces
        plan = build_plan(cache, info, src, dst)
        start = time.monotonic()
        op = backend.submit(plan)
        op.result(timeout=60)
        took = time.monotonic() - start
        child.stdin.write(json.dumps(dst) + "\n")
        child.stdin.flush()
        got = json.loads(child.stdout.readline())["sums"]
        bad = [d for d, w, g in zip(dst, checksums(cache, src), got, strict=True) if w != g]
        print(
            f"{args.layout} on {cache.device}: {geo.unit} units, {plan.num_entries} entries, "
            f"{plan.nbytes / 1e6:.1f} MB in {took:.3f}s ({plan.nbytes / took / 1e9:.2f} GB/s); "
            + (f"{len(bad)} blocks differ: {bad[:10]}" if bad else "every block equal")
        )
        return 1 if bad else 0
    finally:
        backend.close()
        child.kill()
        child.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["prefill", "decode"], default="prefill")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layout", choices=LAYOUTS, default="LBHNC")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--head-size", type=int, default=128)
    args = ap.parse_args()
    if args.role == "decode":
        decode(args)
        return 0
    return prefill(args)


if __name__ == "__main__":
    sys.exit(main())
