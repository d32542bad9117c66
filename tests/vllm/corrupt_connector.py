"""The negative control's connector: KVGuardConnector, except that after a
successful load of a request whose id starts with ``corrupt-`` it overwrites
the loaded blocks with Gaussian noise -- what a transfer that "succeeded" with the
wrong bytes would leave. Every other request goes through unchanged, so one
decode engine serves both the real runs and the control."""

from __future__ import annotations

import torch

from kvguard.vllm.connector import KVGuardConnector
from kvguard.vllm.worker import KVGuardWorker


class CorruptingWorker(KVGuardWorker):
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
