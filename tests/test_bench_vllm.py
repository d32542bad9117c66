"""The vLLM PD benchmark's own arithmetic and its CPU shim (no vLLM needed)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import vllm_pd
from benchmarks.machine import describe_machine
from benchmarks.vllm_pd import plugin_missing, reader_spin
from benchmarks.vllm_pd_client import Sent
from benchmarks.vllm_pd_figures import (
    goals,
    hook_delta,
    percentile,
    spread,
    ttft_split,
    union_seconds,
)
from benchmarks.vllm_pd_run import merge_runs
from benchmarks.vllm_pd_runs import combine, order
from benchmarks.vllm_shim import IDLE_WAIT
from kvguard.vllm.reader_spin import ReaderSpinError
from tests.vllm.checkpoint import BENCH, TINY, kv_bytes_per_token
from tests.vllm.sessions import session_alive, session_cpu_seconds

ROOT = Path(__file__).resolve().parents[1]


def test_union_counts_overlaps_once_and_gaps_not_at_all() -> None:
    assert union_seconds([]) == 0.0
    assert union_seconds([(0.0, 1.0)]) == 1.0
    assert union_seconds([(0.0, 2.0), (1.0, 3.0)]) == 3.0  # overlap
    assert union_seconds([(0.0, 4.0), (1.0, 2.0)]) == 4.0  # contained
    assert union_seconds([(5.0, 6.0), (0.0, 1.0)]) == 2.0  # gap, unsorted


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([3.0, 1.0, 2.0], 99) == 3.0  # few samples: p99 is the max
    assert percentile([7.0], 50) == 7.0
    assert math.isnan(percentile([], 50))


def test_a_spread_gives_means_that_add_up_where_percentiles_do_not() -> None:
    engine, report = [0.010, 0.020, 0.090], [0.030, 0.001, 0.002]
    total = [a + b for a, b in zip(engine, report, strict=True)]
    assert spread(engine) == {"p50": 20.0, "p99": 90.0, "mean": 40.0}
    assert spread(total)["mean"] == spread(engine)["mean"] + spread(report)["mean"] == 51.0
    assert spread(total)["p50"] == 40.0 != spread(engine)["p50"] + spread(report)["p50"]
    assert math.isnan(spread([])["mean"])


def test_the_doorbells_waits_are_told_apart_from_the_hooks_work() -> None:
    """A doorbell wait runs inside ``build_connector_meta``: the hooks' work
    is their time less the waits', and the waits are a figure of their own."""
    before = {"build_connector_meta": (10, 1.0), "get_finished": (10, 0.5), IDLE_WAIT: (4, 0.75)}
    after = {"build_connector_meta": (30, 3.5), "get_finished": (30, 1.0), IDLE_WAIT: (9, 2.0)}
    assert hook_delta(after, before) == pytest.approx((3.5 + 1.0 - 2.0) - (1.0 + 0.5 - 0.75))
    assert hook_delta(after, before, idle=True) == pytest.approx(1.25)
    peer = {"get_finished": (3, 0.25)}  # another connector: no doorbell at all
    assert hook_delta(peer, {}) == 0.25 and hook_delta(peer, {}, idle=True) == 0.0


def test_runs_interleave_so_each_connector_takes_every_place_in_a_round() -> None:
    got = order(["a", "b", "c"], 3)
    assert got == [
        (0, "a"), (0, "b"), (0, "c"),
        (1, "b"), (1, "c"), (1, "a"),
        (2, "c"), (2, "a"), (2, "b"),
    ]  # fmt: skip
    for name in "abc":  # first, middle and last once each
        assert sorted(i % 3 for i, (_, c) in enumerate(got) if c == name) == [0, 1, 2]
    assert order(["a", "b"], 1) == [(0, "a"), (0, "b")]


def test_a_level_is_the_median_of_its_runs_with_counts_summed_and_runs_kept() -> None:
    rows = [
        {"requests": 8, "errors": 0, "handover_p50_ms": 100.0, "handover_p99_ms": 300.0,
         "kv_gbps": None, "error_sample": "", "cpu_s": {"p": 1.0},
         "phases_ms": {"report": {"p50": 2.0}}},
        {"requests": 8, "errors": 1, "handover_p50_ms": 140.0, "handover_p99_ms": float("nan"),
         "kv_gbps": 0.5, "error_sample": "HTTP 504", "cpu_s": {"p": 3.0},
         "phases_ms": {"report": {"p50": 30.0}}},
        {"requests": 8, "errors": 0, "handover_p50_ms": 90.0, "handover_p99_ms": 200.0,
         "kv_gbps": 0.7, "error_sample": "", "cpu_s": {"p": 2.0},
         "phases_ms": {"report": {"p50": 3.0}}},
    ]  # fmt: skip
    row = combine(rows)
    assert (row["requests"], row["errors"], row["runs"]) == (24, 1, 3)
    assert row["handover_p50_ms"] == 100.0  # the median run, not the mean (110)
    assert row["handover_p99_ms"] == 250.0  # a run with no figure does not count
    assert row["handover_p50_ms_runs"] == [100.0, 140.0, 90.0]
    assert row["kv_gbps"] == 0.6 and row["error_sample"] == "HTTP 504"
    assert row["cpu_s"] == {"p": 2.0} and row["phases_ms"] == {"report": {"p50": 3.0}}
    assert combine([{"kv_gbps": None}])["kv_gbps"] is None
    with pytest.raises(ValueError, match="at least one"):
        combine([])


def test_a_failed_run_is_named_and_the_others_still_make_the_table() -> None:
    good = {"levels": {"1": {"requests": 4, "handover_p50_ms": 10.0}}, "seconds": 5.0}
    bad = {"error": "RuntimeError: warm-up failed", "seconds": 1.0}
    merged = merge_runs([good, bad, {**good, "outputs": {"0": "x"}}])
    assert merged["levels"]["1"]["requests"] == 8 and merged["levels"]["1"]["runs"] == 2
    assert merged["error"] == "1 of 3 runs failed; the first: RuntimeError: warm-up failed"
    assert merged["seconds"] == 11.0 and all("outputs" not in r for r in merged["runs"])
    assert "error" not in merge_runs([good])


def test_the_benchmark_checkpoint_moves_32_kib_of_kv_per_token() -> None:
    assert kv_bytes_per_token(BENCH) == 4 * 8 * 128 * 2 * 4 == 32768
    assert BENCH["num_hidden_layers"] * BENCH["num_key_value_heads"] == 32
    assert kv_bytes_per_token(TINY) == 2 * 2 * 32 * 2 * 4  # the tests': 1 KiB


# Burns 0.3 s of its own CPU, says so, then sleeps until killed.
_BURNER = """
import time
while time.process_time() < 0.3:
    pass
print("burnt", flush=True)
time.sleep(600)
"""


@pytest.mark.filterwarnings("error")  # the /proc scan leaves nothing open, even stopped early
def test_a_session_counts_its_cpu_and_is_dead_once_only_a_zombie_is_left() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _BURNER], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"burnt\n"
        assert session_alive(proc.pid)
        # /proc counts user and system time in whole clock ticks, each rounded down.
        assert session_cpu_seconds(proc.pid) >= 0.3 - 2 / os.sysconf("SC_CLK_TCK")
        proc.kill()
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped
        assert not session_alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    assert not session_alive(proc.pid)
    assert session_cpu_seconds(proc.pid) == 0.0


def test_the_machine_names_each_distributions_version_or_absent() -> None:
    machine = describe_machine({"the_test": "pytest", "missing": "kvguard-no-such-dist"})
    assert (machine["the_test"], machine["missing"]) == (pytest.__version__, "absent")
    assert (machine["cpus"], machine["python"]) == (os.cpu_count(), sys.version.split()[0])
    assert list(machine) == [
        "platform",
        "machine",
        "cpus",
        "python",
        "the_test",
        "missing",
        "loadavg_1m",
    ]


_PROBE = """
import torch
try:
    print(torch.accelerator.current_device_index())
except RuntimeError as exc:
    print("raised", exc)
"""


@pytest.mark.skipif(torch.accelerator.is_available(), reason="the shim is for hosts without one")
@pytest.mark.parametrize("shim", [False, True])
def test_the_device_shim_applies_only_in_benchmark_servers(shim: bool, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVGUARD_BENCH_DIR"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "benchmarks" / "_site"), str(ROOT)])
    if shim:
        env["KVGUARD_BENCH_DIR"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    if shim:
        assert out == "0"
    else:
        assert out == "raised Cannot access accelerator device when none is available."


@pytest.mark.parametrize(
    ("arg", "cpus", "expected"),
    [
        ("auto", 2, (0.002, "auto: 2 CPUs, fewer than 8")),
        ("auto", 7, (0.002, "auto: 7 CPUs, fewer than 8")),
        ("auto", 8, (None, "auto: vLLM's own, 8 CPUs")),
        ("vllm", 2, (None, "vLLM's own (--reader-spin-s vllm)")),
        ("0.01", 64, (0.01, "--reader-spin-s")),
        ("1", 2, (1.0, "--reader-spin-s")),
    ],
)
def test_the_readers_spin_is_bounded_by_default_only_where_servers_share_cores(
    arg: str, cpus: int, expected: tuple[float | None, str]
) -> None:
    assert reader_spin(arg, cpus) == expected


@pytest.mark.parametrize(
    ("arg", "why"),
    [("2ms", "is not a number of seconds"), ("-1", "is outside 0 to 60 seconds")],
)
def test_a_bad_reader_spin_is_named_as_the_flag_before_any_server_starts(
    arg: str, why: str
) -> None:
    with pytest.raises(ReaderSpinError) as err:
        reader_spin(arg, 2)
    assert str(err.value) == f"--reader-spin-s={arg!r} {why}"


@pytest.mark.parametrize(
    ("allowed", "why"),
    [
        (None, ""),
        ("kvguard_reader_spin", ""),
        ("a,kvguard_reader_spin", ""),
        ("a,b", "VLLM_PLUGINS='a,b' leaves out kvguard's 'kvguard_reader_spin'"),
        ("", "VLLM_PLUGINS='' leaves out kvguard's 'kvguard_reader_spin'"),
    ],
)
def test_the_bench_says_when_vllm_would_not_load_the_plugin(allowed: str | None, why: str) -> None:
    assert plugin_missing(allowed) == why


def test_the_bench_says_when_the_plugin_is_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_pd, "entry_points", lambda group: [])
    assert plugin_missing(None) == (
        "kvguard's vLLM plugin 'kvguard_reader_spin' is not installed here (pip install -e . again)"
    )


def _sent(start: float, ttft: float, tokens: int, error: str = "") -> Sent:
    return Sent(index=0, tokens_in=tokens, start=start, first=start + ttft, error=error)


def _served(arrival: float, tokens: int, latency: float, compute: float) -> dict[str, object]:
    return {
        "arrival": arrival,
        "prompt_tokens": tokens,
        "first_token_latency": latency,
        "prefill": compute,
    }


def test_ttft_splits_at_the_server_whose_request_arrived_while_the_client_waited() -> None:
    sent = [
        _sent(100.0, 0.5, 1500),
        _sent(200.0, 0.4, 1200),
        _sent(300.0, 0.3, 1300, error="HTTP 502"),  # failed: not split
        _sent(400.0, 0.3, 1400),  # its server request arrived after its first token
    ]
    served = [
        _served(200.01, 1500, 0.2, 0.15),  # same length, another request's window
        _served(100.02, 1500, 0.45, 0.4),
        _served(200.005, 1201, 0.1, 0.1),  # another prompt in the window
        _served(200.02, 1200, 0.35, 0.3),
        _served(300.01, 1300, 0.25, 0.2),
        _served(400.5, 1400, 0.2, 0.2),
    ]
    split = ttft_split(sent, served)
    assert split["ttft_split_n"] == 2
    assert split["prefill_compute_ms"] == spread([0.4, 0.3])
    assert split["prefill_server_ms"] == spread([0.45, 0.35])
    beyond = split["ttft_beyond_prefill_ms"]
    assert beyond["mean"] == pytest.approx(50.0, abs=0.01)  # 50 ms each
    assert beyond["p99"] == pytest.approx(50.0, abs=0.01)


def test_goals_hold_kvguards_ttft_against_the_aggregated_servers_same_run() -> None:
    def level(ttft: float, handover: float) -> dict[str, float]:
        return {"ttft_p50_ms": ttft, "handover_p50_ms": handover, "handover_p99_ms": handover}

    result = {
        "connectors": {
            "aggregated": {"levels": {"1": level(400.0, 400.0), "8": level(800.0, 800.0)}},
            "kvguard": {"levels": {"1": level(500.0, 90.0), "8": level(1001.0, 100.0)}},
            "mooncake": {"levels": {"1": level(700.0, 100.0), "8": level(900.0, 99.0)}},
        },
        "backend_limit": {},
        "backend_limit_after": {},
    }
    g = goals(result)
    assert (g["1"]["ttft_p50_vs_aggregated"], g["1"]["ttft_p50_ok"]) == (1.25, True)
    assert (g["8"]["ttft_p50_vs_aggregated"], g["8"]["ttft_p50_ok"]) == (1.251, False)
    assert (g["1"]["handover_p50_vs_mooncake"], g["1"]["handover_p50_ok"]) == (0.9, True)
    assert (g["8"]["handover_p99_vs_mooncake"], g["8"]["handover_p99_ok"]) == (1.01, False)


def test_goals_without_an_aggregated_level_hold_no_ttft_and_kv_against_the_better_limit() -> None:
    result = {
        "connectors": {
            "aggregated": {"levels": {"8": {"ttft_p50_ms": 800.0}}},
            "kvguard": {"levels": {"1": {"ttft_p50_ms": 500.0, "kv_gbps": 1.6}}},
        },
        # The limit is the better of before and after at the same c; "best" over every c.
        "backend_limit": {"1": {"kv_gbps": 1.0}, "8": {"kv_gbps": 4.0}},
        "backend_limit_after": {"1": {"kv_gbps": 2.0}},
    }
    assert goals(result) == {
        "1": {
            "kv_gbps_vs_backend_same_c": 0.8,
            "kv_gbps_vs_backend_best": 0.4,
            "kv_gbps_ok": True,
        }
    }
    result["connectors"]["kvguard"]["levels"]["1"]["kv_gbps"] = 1.59
    assert goals(result)["1"]["kv_gbps_ok"] is False
    del result["connectors"]["aggregated"]
    assert "ttft_p50_vs_aggregated" not in goals(result)["1"]


def test_ttft_split_takes_the_window_closed_and_skips_what_it_cannot_match() -> None:
    sent = [
        _sent(10.0, 0.5, 1500, error="HTTP 504"),  # failed first: the others still count
        _sent(20.0, 0.5, 1600),  # its server request has no arrival: unmatched
        _sent(0.5, 0.5, 1700),  # a window that would take a missing arrival read as 1.0
        _sent(30.0, 0.5, 1800),  # arrived at the very start
        _sent(40.0, 0.5, 1900),  # arrived at the very first token
    ]
    served = [
        _served(10.1, 1500, 0.2, 0.1),
        {"arrival": None, "prompt_tokens": 1600, "first_token_latency": 0.3, "prefill": 0.2},
        {"arrival": None, "prompt_tokens": 1700, "first_token_latency": 0.3, "prefill": 0.2},
        _served(30.0, 1800, 0.4, 0.3),
        _served(40.5, 1900, 0.25, 0.2),
    ]
    split = ttft_split(sent, served)
    assert split["ttft_split_n"] == 2
    assert split["prefill_compute_ms"] == spread([0.3, 0.2])
    assert split["prefill_server_ms"] == spread([0.4, 0.25])
