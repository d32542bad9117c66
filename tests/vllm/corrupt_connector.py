"""The corrupting connectors: KVGuardConnector with its decode's KV garbled on purpose.

* ``corrupt-*`` requests (the negative control of the byte-exact checks):
  after a load was reported loaded, its blocks are overwritten with Gaussian
  noise -- what a transfer that "succeeded" with the wrong bytes would leave
  unchecked. Outputs must differ from the aggregated engine's.
* ``garble-KIND-*`` requests (the integrity check): when the prefill's ok
  Result arrives, before the digest is checked, the blocks are garbled as a
  transfer can leave them: ``flip`` one byte, ``stale`` a block holding
  what it held before the load, ``half`` a block's second half zeroed. The
  load must fail ``integrity``; no wrong token may reach the client.

Every other request goes through unchanged, so one decode engine serves the
real runs and the controls.
"""

from __future__ import annotations

import torch

from kvguard.vllm.connector import KVGuardConnector
from kvguard.vllm.integrity import Part, Verifier
from kvguard.vllm.protocol import Result
from kvguard.vllm.worker import KVGuardWorker
from transfer.cache import KVCache


class GarblingVerifier(Verifier):
    def __init__(self, cache: KVCache) -> None:
        super().__init__(cache)
        self._before: dict[str, list[torch.Tensor]] = {}  # load id -> its last block, per buffer

    def expect(self, load_id: str, blocks: list[int], part: Part | None) -> None:
        super().expect(load_id, blocks, part)
        if load_id.startswith("garble-stale") and blocks:
            rows = range(self.cache.layout.num_buffers)
            self._before[load_id] = [self.cache.rows(b)[blocks[-1]].clone() for b in rows]

    def checked(self, res: Result) -> Result:
        cover = self.cover(res.load_id)
        if res.ok and cover is not None and res.load_id.startswith("garble-"):
            blocks, _ = cover
            kind = res.load_id.split("-")[1]
            cache, n = self.cache, self.cache.layout.block_bytes
            if kind == "flip":
                row = cache.rows(0)
                row[blocks[0], n // 3] = int(row[blocks[0], n // 3]) ^ 0x08
            elif kind == "stale":
                for b, old in enumerate(self._before.pop(res.load_id)):
                    cache.rows(b)[blocks[-1]] = old
            elif kind == "half":
                for b in range(cache.layout.num_buffers):
                    cache.rows(b)[blocks[0], n // 2 :] = 0
            else:
                raise ValueError(f"no such garbling: {kind!r}")
        return super().checked(res)

    def done(self, load_id: str) -> None:
        super().done(load_id)
        self._before.pop(load_id, None)


class CorruptingWorker(KVGuardWorker):
    def make_verifier(self) -> Verifier | None:
        assert self.cache is not None
        return GarblingVerifier(self.cache) if self.settings.verify else None

    def on_loaded(self, request_id: str, blocks: list[int]) -> None:
        if not request_id.startswith("corrupt-") or self.cache is None:
            return
        gen = torch.Generator().manual_seed(1234)
        for buffer in range(self.cache.layout.num_buffers):
            for block in blocks:
                # Plausible values (the engine serves float32): random bytes
                # would be NaN or huge and fail in a less telling way.
                self.cache.block(buffer, block).view(torch.float32).normal_(generator=gen)


class CorruptingKVGuardConnector(KVGuardConnector):
    worker_class = CorruptingWorker
