"""Put on PYTHONPATH by benchmarks.vllm_pd for the vLLM servers it starts only."""

import os

if os.environ.get("KVGUARD_BENCH_DIR"):
    from benchmarks.vllm_shim import install

    install()
