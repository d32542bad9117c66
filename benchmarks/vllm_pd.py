"""kvguard's connector against vLLM's own, in real OpenAI servers, at realistic KV sizes.

    python -m benchmarks.vllm_pd [--quick] [--connectors kvguard,mooncake,nixl]
                                 [--concurrency 1,8,32] [--runs 3] [--out DIR]
    kvguard bench --vllm [...]   # the same; re-executed with .venv-vllm's python

For each connector, one prefill and one decode vLLM OpenAI server
(``vllm.entrypoints.openai.api_server``, default multiprocessing) serve a
generated Llama checkpoint with 32 KiB of KV per token
(``tests.vllm.checkpoint.BENCH``); an HTTP client sends prompts of 1K-2K
random tokens in closed loops of 1, 8 and 32 concurrent requests. Each
connector runs ``--runs`` times (3), the connectors interleaved so that
host load falls on each alike, and each figure is the median of the runs'
(each run's value beside it; ``benchmarks.vllm_pd_runs``). The same
invocation also measures:

* the aggregated baseline: one server, no connector, the same prompts
  prefilled locally;
* the engine's limit without vLLM: kvguard's ``MooncakeBackend`` between two
  processes moving the same per-request KV sizes at the same concurrencies.

Every request is the two-step PD protocol, legs in sequence: the prefill
with ``max_tokens`` 1 and ``do_remote_decode``, then the decode with the
parameters that make it load the prefill's KV. Connectors that return those
parameters from the prefill (kvguard, NIXL) go through ``kvguard proxy``;
Mooncake's need the router to make them up (a ``transfer_id`` on both legs,
the prefill's engine id and bootstrap address on the decode leg), which
``kvguard proxy`` does not do, so the client drives both legs itself.

Figures per connector and concurrency (``vllm_pd.json``, plot
``vllm_pd.png``):

* handover: decode request arrival to first token, from the decode server's
  own view (vLLM's arrival time and first-token latency for the request,
  recorded in its frontend), p50 and p99; the aggregated row is the same
  figure on the one server (local prefill included);
* TTFT: the client's request sent to first streamed token, through the proxy;
  split at the server that computed the prompt (the aggregated one, or the
  prefill): its compute, its own latency, and the rest beyond it;
* KV bytes/s: KV bytes moved over the time some transfer was in flight (the
  union of the transfers' intervals, each as the connector timed it), and
  the median transfer's own rate;
* CPU s/GB: CPU seconds of each server's whole process tree (API server,
  engine core, worker; ``/proc/<pid>/stat``) over the level, per GB moved;
* hook overhead: time vLLM's loop spent inside the connector's per-step
  hooks, per request, on each server;
* kvguard only, per request: where the handover time goes (schedule, push,
  submit, engine, release, report, first token; see
  ``benchmarks.vllm_pd_figures.PHASES``).

vLLM's queue readers busy-wait 1 s after each read. On a host with fewer
than ``SPIN_OWN_CPUS`` CPUs the two servers of a pair spin on the cores the
other computes on, which a deployment with cores or a host per server does
not, so by default (``--reader-spin-s auto``) every server alike, the
aggregated one included, runs with kvguard's ``KVGUARD_VLLM_READER_SPIN_S``
at 2 ms there (``kvguard.vllm.reader_spin``, the vLLM plugin a deployment
that shares cores sets the same way). ``--reader-spin-s vllm`` keeps vLLM's
own; a number sets it. The run's JSON records what the servers were
asked, and each server's log must say it bounded its readers.

The patches inside the servers (a CPU shim for Mooncake's device lookup and
the recorders) are ``benchmarks.vllm_shim``'s, never kvguard's. Needs
``.venv-vllm`` (``scripts/vllm-env.sh``) and the ``bench`` extra (matplotlib).

This module is the command line; the run is ``benchmarks.vllm_pd_run``, its
parts ``vllm_pd_servers`` (on the vLLM tests' harness, the checkout's
``tests.vllm``), ``vllm_pd_client``, ``vllm_pd_figures`` and
``vllm_pd_limit`` (the engine alone).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Final

from kvguard.vllm.reader_spin import ENV, PLUGIN, ReaderSpinError, parse

__all__ = ["CONNECTORS", "SPIN_OWN_CPUS", "main", "plugin_missing", "reader_spin"]

ROOT: Final = Path(__file__).resolve().parent.parent
VLLM_PYTHON: Final = ROOT / ".venv-vllm" / "bin" / "python"
# kvguard-unverified: kvguard with kvguard_verify off, the cost of the check side by side.
CONNECTORS: Final = ("aggregated", "mooncake", "kvguard", "kvguard-unverified", "nixl")
# On request only: kvguard with kvguard_idle_wait_ms 0 (an idle engine steps
# as vLLM steps it), what the doorbell (kvguard.vllm.idle) gains side by side.
# kvguard-two-step: kvguard with the proxy's early first token off (the
# decode's first token, after the handover), its TTFT side by side.
OPTIONAL: Final = ("kvguard-nowait", "kvguard-two-step")
# Requests per level. 24 at c = 1, where they are cheap: with 8 a run's p99
# was its slowest request, and the runs' ranges overlapped between connectors.
FULL_REQUESTS: Final = {1: 24, 8: 32, 32: 64}
# Two servers, each with two readers that spin (its worker's and its engine
# core's) and two compute threads: below this the pair spins on shared cores.
SPIN_OWN_CPUS: Final = 8
# A reader spins only for a message within this of its last read (steps take
# longer): an idle server's spin ends after 2 ms instead of 1 s.
SHARED_CPUS_SPIN_S: Final = 0.002


def reader_spin(arg: str, cpus: int) -> tuple[float | None, str]:
    """The servers' reader spin for ``--reader-spin-s arg`` (None: vLLM's own) and why.

    A bad ``arg`` raises ``ReaderSpinError`` naming it.
    """
    if arg == "vllm":
        return None, "vLLM's own (--reader-spin-s vllm)"
    if arg != "auto":
        return parse(arg, name="--reader-spin-s"), "--reader-spin-s"
    if cpus < SPIN_OWN_CPUS:
        return SHARED_CPUS_SPIN_S, f"auto: {cpus} CPUs, fewer than {SPIN_OWN_CPUS}"
    return None, f"auto: vLLM's own, {cpus} CPUs"


def plugin_missing(allowed: str | None) -> str:
    """Why vLLM here would not load kvguard's reader-spin plugin, or "".

    ``allowed``: vLLM's ``VLLM_PLUGINS`` allow-list (None: every plugin).
    """
    if PLUGIN not in {e.name for e in entry_points(group="vllm.general_plugins")}:
        return f"kvguard's vLLM plugin {PLUGIN!r} is not installed here (pip install -e . again)"
    if allowed is not None and PLUGIN not in allowed.split(","):
        return f"VLLM_PLUGINS={allowed!r} leaves out kvguard's {PLUGIN!r}"
    return ""


def reexec_in_vllm_env(argv: Sequence[str]) -> None:
    """Run this module with .venv-vllm's interpreter when this one lacks vLLM."""
    if importlib.util.find_spec("vllm") is not None:
        return
    if not VLLM_PYTHON.exists():
        raise SystemExit(
            f"vLLM is not importable here and {VLLM_PYTHON} does not exist: "
            "build it with `bash scripts/vllm-env.sh`"
        )
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)  # the checkout: tests.vllm, from any directory
    os.execve(str(VLLM_PYTHON), [str(VLLM_PYTHON), "-m", "benchmarks.vllm_pd", *argv], env)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.vllm_pd",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--connectors",
        default="",
        help=f"default: {','.join(CONNECTORS)}; also: {','.join(OPTIONAL)}",
    )
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--requests", default="", help="per level, e.g. 24,32,64 (default)")
    parser.add_argument(
        "--runs", type=int, default=3, help="runs per connector, interleaved (default 3)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="one run, concurrency 1 and 4, 4 requests each"
    )
    parser.add_argument(
        "--reader-spin-s",
        default="auto",
        help="how long every server's vLLM queue readers busy-wait after a read: "
        f"seconds, 'vllm' (its own, 1 s) or 'auto' ({SHARED_CPUS_SPIN_S} s on a host "
        f"with fewer than {SPIN_OWN_CPUS} CPUs, else vLLM's own; the default)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / ".venv-vllm" / "vllm-pd")
    parser.add_argument("--json", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    reexec_in_vllm_env(argv)
    # SIGTERM unwinds like ^C: every server session started is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    connectors = [c for c in args.connectors.split(",") if c]
    unknown = sorted(set(connectors) - set(CONNECTORS) - set(OPTIONAL))
    if unknown:
        parser.error(f"unknown connectors {unknown}; known: {', '.join(CONNECTORS + OPTIONAL)}")
    if not connectors:
        connectors = list(CONNECTORS)
        if importlib.util.find_spec("nixl") is None:  # its wheels: Linux x86-64/aarch64 only
            print("nixl is not installed here (scripts/vllm-env.sh installs it): not compared")
            connectors.remove("nixl")
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, not {args.runs}")
    runs = 1 if args.quick else args.runs
    try:
        spin, why = reader_spin(args.reader_spin_s, len(os.sched_getaffinity(0)))
    except ReaderSpinError as exc:
        parser.error(str(exc))
    os.environ.pop(ENV, None)  # the servers inherit this environment
    if spin is not None:
        if why_not := plugin_missing(os.environ.get("VLLM_PLUGINS")):
            parser.error(f"the servers' readers cannot spin {spin:g} s: {why_not}")
        os.environ[ENV] = repr(spin)
    print(f"vLLM's queue readers spin {'1 s' if spin is None else f'{spin:g} s'} ({why})")
    concurrencies = [1, 4] if args.quick else [int(c) for c in args.concurrency.split(",")]
    if args.requests:
        counts = [int(n) for n in args.requests.split(",")]
        requests = dict(zip(concurrencies, counts, strict=True))
    elif args.quick:
        requests = dict.fromkeys(concurrencies, 4)
    else:
        requests = {c: FULL_REQUESTS.get(c, 2 * c) for c in concurrencies}
    if importlib.util.find_spec("matplotlib") is None:
        # Checked before the first server starts, not after minutes of runs.
        parser.error("the plot needs matplotlib: pip install -e '.[bench]' (vllm-env.sh does)")
    if str(ROOT) not in sys.path:  # the harness, tests.vllm, is the checkout's
        sys.path.insert(0, str(ROOT))
    from .vllm_pd_run import run

    result = run(
        connectors,
        concurrencies,
        requests,
        args.out,
        log=lambda s: print(s, flush=True),
        runs=runs,
        spin_why=why,
    )
    if args.json is not None:
        shutil.copyfile(args.out / "vllm_pd.json", args.json)
    failed = [n for n, d in result["connectors"].items() if "error" in d]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
