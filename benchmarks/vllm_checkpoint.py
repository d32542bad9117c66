"""A random Llama checkpoint with a realistic KV size per token, cheap to compute.

What a connector moves is the KV cache: ``layers x kv_heads x head_dim x 2
(K and V) x dtype bytes`` per token. A real 8B model has about 128 KiB; the
tests' tiny checkpoint about 1 KiB, too little for a connector's cost to
show. This one has 32 KiB per token (4 x 8 x 128 x 2 x 4 bytes, float32)
while hidden size, MLP and vocabulary stay small, so a 2K-token prefill costs
mostly attention on a 2-core CPU. float32 rather than bfloat16: the same
bytes in half the elements, half the attention work.

Deterministic (seeded); no model hub. Runs where ``transformers`` is
installed (``.venv-vllm``)::

    python -m benchmarks.vllm_checkpoint DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Final

__all__ = ["CONFIG", "DTYPE_BYTES", "generate", "kv_bytes_per_token"]

CONFIG: Final[dict[str, Any]] = {
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
DTYPE_BYTES: Final = 4  # float32


def kv_bytes_per_token(config: dict[str, Any] = CONFIG) -> int:
    return (
        int(config["num_hidden_layers"])
        * int(config["num_key_value_heads"])
        * int(config["head_dim"])
        * 2
        * DTYPE_BYTES
    )


def generate(out: Path, seed: int = 0) -> Path:
    """Write the checkpoint to ``out`` unless the same recipe is already there."""
    marker = out / "kvguard-checkpoint.json"
    recipe = {"config": CONFIG, "seed": seed}
    if marker.exists() and json.loads(marker.read_text()) == recipe:
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, torch_dtype="float32"))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    marker.write_text(json.dumps(recipe))
    return out


if __name__ == "__main__":
    print(generate(Path(sys.argv[1] if len(sys.argv) > 1 else ".venv-vllm/bench-llama")))
