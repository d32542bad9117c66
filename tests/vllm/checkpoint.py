"""Generate the random Llama checkpoints vLLM serves in the tests and the benchmark.

``load_format="dummy"`` weights are so small that zeroed KV still yields the
same tokens, so they cannot test KV correctness. These weights (init std
0.5, 0.2) make every generated token depend on the KV cache: a corrupted or
zeroed transfer changes the output. Deterministic (seeded); no model hub.
Runs where ``transformers`` is installed (``.venv-vllm``). Two recipes:

* ``TINY`` (the default), the tests': 2 layers, about 1 KiB of KV per token;
* ``BENCH``, ``benchmarks.vllm_pd``'s: what a connector moves is the KV
  cache, ``layers x kv_heads x head_dim x 2 (K and V) x dtype bytes`` per
  token. A real 8B model has about 128 KiB; ``TINY`` too little for a
  connector's cost to show. ``BENCH`` has 32 KiB per token (4 x 8 x 128 x 2
  x 4 bytes, float32) while hidden size, MLP and vocabulary stay small, so a
  2K-token prefill costs mostly attention on a 2-core CPU. float32 rather
  than bfloat16: the same bytes in half the elements, half the attention
  work.

::

    python -m tests.vllm.checkpoint DIR            # TINY
    python -m tests.vllm.checkpoint --bench DIR    # BENCH
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Final

__all__ = ["BENCH", "CONFIG", "DTYPE_BYTES", "TINY", "generate", "kv_bytes_per_token"]

TINY: Final[dict[str, Any]] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,  # vLLM's CPU attention supports 32, not 16
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "initializer_range": 0.5,
    "tie_word_embeddings": False,
}
CONFIG: Final = TINY  # the tests' checkpoint

BENCH: Final[dict[str, Any]] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,  # one of vLLM's CPU attention head sizes
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    # Large enough that the next token depends on the KV (a wrong transfer
    # changes the output), small enough that activations stay finite.
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
}
DTYPE_BYTES: Final = 4  # float32, both recipes


def kv_bytes_per_token(config: dict[str, Any]) -> int:
    """KV bytes per token of a checkpoint with ``config`` (float32)."""
    return (
        int(config["num_hidden_layers"])
        * int(config["num_key_value_heads"])
        * int(config["head_dim"])
        * 2
        * DTYPE_BYTES
    )


def generate(out: Path, seed: int = 0, config: dict[str, Any] = TINY) -> Path:
    """Write the checkpoint to ``out`` unless the same recipe is already there."""
    marker = out / "kvguard-checkpoint.json"
    recipe = {"config": config, "seed": seed}
    if marker.exists() and json.loads(marker.read_text()) == recipe:
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config, torch_dtype="float32"))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    marker.write_text(json.dumps(recipe))
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    bench = "--bench" in args
    args = [a for a in args if a != "--bench"]
    default = ".venv-vllm/bench-llama" if bench else ".venv-vllm/tiny-llama"
    print(generate(Path(args[0] if args else default), config=BENCH if bench else TINY))
