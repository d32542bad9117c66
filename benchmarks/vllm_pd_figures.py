"""The vLLM PD benchmark's figures: what the servers recorded, summed up per level, and the plot.

Reads the records ``benchmarks.vllm_shim`` writes inside the servers
(requests, hook times, transfer events), matches them to the client's
requests and makes each level's row: handover and TTFT percentiles, KV
bytes/s over busy time, CPU seconds per GB, hook time per request and, for
kvguard, the handover split into ``PHASES``. ``goals`` holds a run against
the issue's ratios.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from tests.vllm.checkpoint import BENCH, kv_bytes_per_token
from tests.vllm.servers import Server

from .vllm_pd_client import PROMPT_TOKENS, Sent
from .vllm_pd_servers import BLOCK_SIZE
from .vllm_shim import IDLE_WAIT

__all__ = [
    "PHASES",
    "goals",
    "hook_delta",
    "hook_totals",
    "percentile",
    "plot",
    "spread",
    "summarize",
    "ttft_split",
    "union_seconds",
]

# kvguard's handover, phase by phase (each from the end of the one before):
PHASES: Final = (
    ("schedule", "decode: request arrival -> the connector asks the prefill (receiver.expect)"),
    ("push", "the decode's Push reaches the prefill's sender"),
    ("submit", "push received -> Scheduler.submit returned"),
    ("engine", "submit -> the transfer DONE (kvguard's engine loop, Mooncake TCP)"),
    ("release", "DONE -> quiesced, released, Result sent to the decode"),
    ("report", "Result sent -> the load reported to vLLM (finished_recving)"),
    ("first_token", "reported -> first token in the decode's frontend"),
)


# -- small figures ---------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100): a value that occurred."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def union_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """Total time covered by at least one of the ``(start, end)`` intervals."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _ms(x: float) -> float:
    return round(1000 * x, 2)


def spread(seconds: Sequence[float]) -> dict[str, float]:
    """p50, p99 and mean in ms: means add up (a handover's mean is the sum of
    its phases' means), percentiles do not."""
    mean = statistics.mean(seconds) if seconds else math.nan
    return {
        "p50": _ms(percentile(seconds, 50)),
        "p99": _ms(percentile(seconds, 99)),
        "mean": _ms(mean),
    }


def read_jsonl(records: Path, kind: str, server: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in sorted(records.glob(f"{kind}-{server}-*.jsonl")):
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a line cut by a kill
                out.append(json.loads(line))
    return out


def hook_totals(records: Path, server: str) -> dict[str, tuple[int, float]]:
    """Per hook: calls and seconds, summed over the server's processes."""
    out: dict[str, tuple[int, float]] = {}
    for path in records.glob(f"hooks-{server}-*.json"):
        with contextlib.suppress(json.JSONDecodeError, OSError):
            for name, (calls, secs) in json.loads(path.read_text())["hooks"].items():
                c0, s0 = out.get(name, (0, 0.0))
                out[name] = (c0 + int(calls), s0 + float(secs))
    return out


def hook_delta(
    after: dict[str, tuple[int, float]], before: dict[str, tuple[int, float]], *, idle: bool = False
) -> float:
    """Seconds between two ``hook_totals``: the hooks' own work, or (``idle``)
    kvguard's doorbell waits, which the hooks' times include."""

    def split(totals: dict[str, tuple[int, float]]) -> tuple[float, float]:
        waited = totals.get(IDLE_WAIT, (0, 0.0))[1]
        return sum(s for n, (_, s) in totals.items() if n != IDLE_WAIT) - waited, waited

    (work1, idle1), (work0, idle0) = split(after), split(before)
    return idle1 - idle0 if idle else work1 - work0


def _match(server_reqs: list[dict[str, Any]], rid: str) -> dict[str, Any] | None:
    for r in server_reqs:
        if rid and rid in str(r.get("request_id")):
            return r
    return None


def ttft_split(sent: list[Sent], prefill_reqs: list[dict[str, Any]]) -> dict[str, Any]:
    """The client's TTFT split at the server that computed the prompt (the
    aggregated one, or the prefill): its compute (scheduled -> first token),
    its own latency (arrival -> first token) and the rest, beyond it (HTTP,
    the proxy both ways; two steps: the handover and the decode's step too).

    A server's request is the client's if it arrived while the client waited
    for the first token and has its prompt's length (no two overlap at c = 1).
    """
    compute: list[float] = []
    server: list[float] = []
    beyond: list[float] = []
    for s in sent:
        if s.error or not s.first:
            continue
        r = next(
            (
                r
                for r in prefill_reqs
                if r.get("prompt_tokens") == s.tokens_in
                and r.get("first_token_latency") is not None
                and s.start <= float(r.get("arrival") or 0.0) <= s.first
            ),
            None,
        )
        if r is None:
            continue
        compute.append(float(r["prefill"]))
        server.append(float(r["first_token_latency"]))
        beyond.append(s.first - s.start - server[-1])
    return {
        "ttft_split_n": len(compute),
        "prefill_compute_ms": spread(compute),
        "prefill_server_ms": spread(server),
        "ttft_beyond_prefill_ms": spread(beyond),
    }


def kvguard_phases(
    prefill_events: list[dict[str, Any]],
    decode_events: list[dict[str, Any]],
    decode_request: dict[str, Any],
) -> dict[str, float] | None:
    """One request's handover split at kvguard's events (seconds), or None."""
    arrival = decode_request.get("arrival")
    first = decode_request.get("first_token_latency")
    if arrival is None or first is None:
        return None
    # The decode's engine request id: the one whose expect happened first after arrival.
    expects = [e for e in decode_events if e["kind"] == "expect" and e["t"] >= arrival]
    ext = str(decode_request["request_id"])
    expects = [e for e in expects if ext in e["request"]] or []
    if not expects:
        return None
    exp = expects[0]
    rid, remote = exp["request"], exp["remote"]

    def at(events: list[dict[str, Any]], kind: str, key: str) -> dict[str, Any] | None:
        return next((e for e in events if e["kind"] == kind and e.get("request") == key), None)

    push = at(prefill_events, "push", remote)
    sub = at(prefill_events, "submitted", remote)
    rel = at(prefill_events, "released", remote)
    rep = at(decode_events, "reported", rid)
    if not (push and sub and rel and rep):
        return None
    done = sub["start"] + rel["engine_s"]
    sent = next(
        (e["t"] for e in prefill_events if e["kind"] == "results_sent" and e["t"] >= rel["t"]),
        rel["t"],
    )
    marks = [arrival, exp["t"], push["t"], sub["t"], done, sent, rep["t"], arrival + first]
    return {name: marks[i + 1] - marks[i] for i, (name, _) in enumerate(PHASES)}


def summarize(
    connector: str,
    sent: list[Sent],
    servers: list[Server],
    records: Path,
    window: tuple[float, float],
    cpu: dict[str, float],
    hooks: dict[str, float],
    idle: dict[str, float] | None = None,
) -> dict[str, Any]:
    ok = [s for s in sent if not s.error]
    decode = servers[-1]
    decode_reqs = read_jsonl(records, "requests", decode.name)
    handover: list[float] = []
    client_handover: list[float] = []
    matched: list[dict[str, Any]] = []
    for s in ok:
        r = _match(decode_reqs, s.request_id)
        if r is not None and r.get("first_token_latency") is not None:
            handover.append(float(r["first_token_latency"]))
            matched.append(r)
        if s.first:
            client_handover.append(s.first - (s.decode_sent or s.start))
    ttft = [s.first - s.start for s in ok if s.first]
    took_handover = spread(handover)
    row: dict[str, Any] = {
        "requests": len(sent),
        "errors": len(sent) - len(ok),
        "error_sample": next((s.error for s in sent if s.error), ""),
        "prompt_tokens_mean": round(statistics.mean(s.tokens_in for s in sent)),
        "handover_n": len(handover),
        "handover_p50_ms": took_handover["p50"],
        "handover_p99_ms": took_handover["p99"],
        "handover_mean_ms": took_handover["mean"],
        "ttft_p50_ms": _ms(percentile(ttft, 50)),
        "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "wall_s": round(window[1] - window[0], 3),
        **ttft_split(ok, read_jsonl(records, "requests", servers[0].name)),
    }
    if connector == "mooncake":
        row["client_decode_leg_p50_ms"] = _ms(percentile(client_handover, 50))
        row["client_decode_leg_p99_ms"] = _ms(percentile(client_handover, 99))
    # Transfers that belong to this level: started within its window.
    a, b = window
    if connector == "aggregated":
        nbytes = sum(math.ceil(s.tokens_in / BLOCK_SIZE) * BLOCK_SIZE for s in sent)
        nbytes *= kv_bytes_per_token(BENCH)
        row["kv_bytes_prefilled"] = nbytes
        row["kv_gbps"] = None
        row[f"cpu_s_per_gb_{decode.name}"] = round(cpu[decode.name] / (nbytes / 1e9), 3)
        row["cpu_s"] = {k: round(v, 2) for k, v in cpu.items()}
        return row
    intervals: list[tuple[float, float]] = []
    rates: list[float] = []
    took: list[float] = []  # each transfer's own seconds, in the engine
    nbytes = 0
    events = {s.name: read_jsonl(records, "events", s.name) for s in servers}
    if connector.startswith("kvguard"):
        sub = {e["request"]: e for e in events[servers[0].name] if e["kind"] == "submitted"}
        for e in events[servers[0].name]:
            if e["kind"] == "released" and e["ok"] and e["request"] in sub:
                start = sub[e["request"]]["start"]
                if a <= start <= b:
                    intervals.append((start, start + e["engine_s"]))
                    took.append(e["engine_s"])
                    rates.append(e["nbytes"] / max(e["engine_s"], 1e-9))
                    nbytes += e["nbytes"]
    else:
        for srv in servers:
            for e in events[srv.name]:
                if e["kind"] == "xfer" and e["ok"] and a <= e["start"] <= b:
                    intervals.append((e["start"], e["t"]))
                    took.append(e["t"] - e["start"])
                    rates.append(e["nbytes"] / max(e["t"] - e["start"], 1e-9))
                    nbytes += e["nbytes"]
    busy = union_seconds(intervals)
    row["transfers"] = len(intervals)
    row["kv_bytes"] = nbytes
    row["kv_gbps"] = round(nbytes / busy / 1e9, 3) if busy else None
    row["kv_gbps_median_transfer"] = round(statistics.median(rates) / 1e9, 3) if rates else None
    row["kv_gbps_wall"] = round(nbytes / (b - a) / 1e9, 3)
    row["transfer_ms"] = spread(took)
    gb = nbytes / 1e9
    for srv in servers:
        role = "prefill" if srv is servers[0] else "decode"
        row[f"cpu_s_per_gb_{role}"] = round(cpu[srv.name] / gb, 3) if gb else None
        row[f"hook_us_per_request_{role}"] = round(1e6 * hooks[srv.name] / max(1, len(sent)), 1)
        if idle is not None and connector.startswith("kvguard"):
            waited = idle.get(srv.name, 0.0)
            row[f"idle_wait_us_per_request_{role}"] = round(1e6 * waited / max(1, len(sent)), 1)
    row["cpu_s"] = {k: round(v, 2) for k, v in cpu.items()}
    if connector.startswith("kvguard"):
        splits = [
            p
            for r in matched
            if (p := kvguard_phases(events[servers[0].name], events[decode.name], r)) is not None
        ]
        row["phases_n"] = len(splits)
        row["phases_ms"] = {name: spread([p[name] for p in splits]) for name, _ in PHASES}
    return row


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    for connector, data in result["connectors"].items():
        levels = sorted(data.get("levels", {}), key=int)
        if not levels:
            continue
        xs = [int(c) for c in levels]
        for ax, key in zip(axes, ("handover", "ttft"), strict=True):
            p50 = [data["levels"][c][f"{key}_p50_ms"] for c in levels]
            p99 = [data["levels"][c][f"{key}_p99_ms"] for c in levels]
            (line,) = ax.plot(xs, p50, marker="o", label=f"{connector} p50")
            ax.plot(
                xs,
                p99,
                marker="x",
                linestyle="--",
                color=line.get_color(),
                label=f"{connector} p99",
            )
    axes[0].set_title("decode handover: arrival to first token (decode's view)")
    axes[1].set_title("time to first token through the proxy (client)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("ms")
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2)
    m = result["machine"]
    fig.suptitle(
        f"vLLM PD on {m['cpus']} CPUs, {result['kv_bytes_per_token'] // 1024} KiB KV/token, "
        f"prompts {PROMPT_TOKENS[0]}-{PROMPT_TOKENS[1]} tokens, vLLM's queue readers spin "
        + (f"{float(spin):g} s" if (spin := result.get("reader_spin_s")) else "1 s (vLLM's own)"),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def goals(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's ratios, same run: kvguard / Mooncake handover, kvguard /
    aggregated TTFT, kvguard / backend-alone KV bytes/s."""
    conns = result["connectors"]
    kvg, mc = (
        conns.get("kvguard", {}).get("levels", {}),
        conns.get("mooncake", {}).get("levels", {}),
    )
    # The engine's limit at each concurrency: the better of the two runs
    # (before and after the servers), so load from elsewhere never lowers it.
    runs = [result.get("backend_limit", {}), result.get("backend_limit_after", {})]
    limit = {
        c: {"kv_gbps": max(r[c]["kv_gbps"] for r in runs if c in r)} for c in set().union(*runs)
    }
    best = max((v["kv_gbps"] for v in limit.values()), default=math.nan)
    agg = conns.get("aggregated", {}).get("levels", {})
    out: dict[str, Any] = {}
    for c in sorted(set(kvg) | set(mc), key=int):
        g: dict[str, Any] = {}
        if c in kvg and c in agg and agg[c].get("ttft_p50_ms"):
            ratio = kvg[c]["ttft_p50_ms"] / agg[c]["ttft_p50_ms"]
            g["ttft_p50_vs_aggregated"] = round(ratio, 3)
            g["ttft_p50_ok"] = ratio <= 1.25
        if c in kvg and c in mc:
            for q in ("p50", "p99"):
                ratio = kvg[c][f"handover_{q}_ms"] / mc[c][f"handover_{q}_ms"]
                g[f"handover_{q}_vs_mooncake"] = round(ratio, 3)
                g[f"handover_{q}_ok"] = ratio <= 1.0
        if c in kvg and kvg[c].get("kv_gbps") and c in limit:
            ratio = kvg[c]["kv_gbps"] / limit[c]["kv_gbps"]
            g["kv_gbps_vs_backend_same_c"] = round(ratio, 3)
            g["kv_gbps_vs_backend_best"] = round(kvg[c]["kv_gbps"] / best, 3)
            g["kv_gbps_ok"] = ratio >= 0.8
        out[c] = g
    return out
