"""Generate the tiny random Llama checkpoint the vLLM tests serve.

``load_format="dummy"`` weights are so small that zeroed KV still yields the
same tokens, so they cannot test KV correctness. These weights (init std
0.5) make every generated token depend on the KV cache: a corrupted or
zeroed transfer changes the output. Deterministic (seeded); no model hub.

    python -m tests.vllm.checkpoint DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CONFIG = {
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


def generate(out: Path, seed: int = 0) -> Path:
    marker = out / "kvguard-checkpoint.json"
    if marker.exists() and json.loads(marker.read_text()) == {"config": CONFIG, "seed": seed}:
        return out  # already there, same recipe
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, torch_dtype="float32"))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    marker.write_text(json.dumps({"config": CONFIG, "seed": seed}))
    return out


if __name__ == "__main__":
    print(generate(Path(sys.argv[1] if len(sys.argv) > 1 else ".venv-vllm/tiny-llama")))
