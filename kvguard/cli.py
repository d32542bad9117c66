"""The ``kvguard`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import structlog

from lifecycle import render_markdown

from .vllm.states import TABLES as HANDOFF_TABLES

__all__ = ["diagram_document", "main"]

# The repository checkout this package runs from (an editable install).
DIAGRAM_PATH = Path(__file__).resolve().parents[1] / "docs" / "state-diagram.md"


def diagram_document() -> str:
    """docs/state-diagram.md: the request lifecycle, then the hand-off's tables."""
    return render_markdown() + "".join(
        "\n" + table.render_markdown("kvguard/vllm/states.py") for table in HANDOFF_TABLES
    )


def _cmd_diagram(args: argparse.Namespace) -> int:
    if args.counts is not None or args.format is not None:
        from scheduler.trace import diagram_command

        if args.check:
            print("kvguard diagram: --check takes no --counts/--format", file=sys.stderr)
            return 2
        return diagram_command(
            args.counts, args.format or "mermaid", args.output, sys.stdout, sys.stderr
        )
    text = diagram_document()
    path: Path = args.output or DIAGRAM_PATH
    if args.check:
        current = path.read_text() if path.exists() else None
        if current != text:
            print(
                f"{path} is stale: it differs from the tables in lifecycle/_table.py "
                "and kvguard/vllm/states.py. Run `kvguard diagram` and commit the result.",
                file=sys.stderr,
            )
            return 1
        print(f"{path} is up to date")
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from .run import RunConfig, run

    # The CLI is an application, so it may configure structlog (the library
    # never does): transition records stay out of the terminal by default.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelName(args.log_level.upper())
        ),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    cfg = RunConfig(
        requests=args.requests,
        backend=args.backend,
        seed=args.seed,
        deadline_s=args.deadline,
        workers=args.workers,
        fault_rate=args.fault_rate,
        kill_decode_after=args.kill_decode_after,
        freeze_decode_after=args.freeze_decode_after,
        layers=args.layers,
        blocks=args.blocks,
        block_bytes=args.block_bytes,
        blocks_per_request=args.blocks_per_request,
        fragmentation=args.fragmentation,
        max_attempts=args.max_attempts,
        json_path=args.json,
        progress=not args.no_progress,
        journal_path=args.journal,
        metrics_port=args.metrics_port,
        stuck_after_s=args.stuck_after,
        decode=args.decode,
        metadata=args.metadata,
        curve_secret=args.curve_secret,
        curve_server=args.curve_server,
    )
    try:
        summary = run(cfg)
    except (ValueError, OSError) as exc:  # OSError: journal path, metrics port
        print(f"kvguard run: {exc}", file=sys.stderr)
        return 2
    broken = summary.ok()
    for line in broken:
        print(f"kvguard run: {line}", file=sys.stderr)
    return 1 if broken else 0


def _cmd_keygen(args: argparse.Namespace) -> int:
    from kvguard.curve import keygen

    try:
        public, secret = keygen(args.directory, args.name)
    except (ValueError, OSError) as exc:  # FileExistsError: never overwritten
        print(f"kvguard keygen: {exc}", file=sys.stderr)
        return 2
    print(f"kvguard keygen: public key {public} (hand it out), key pair {secret} (keep it)")
    return 0


def _cmd_decode(args: argparse.Namespace) -> int:
    from kvguard.decode.service import run_service

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    return run_service(args, sys.stdout)


def _cmd_trace(args: argparse.Namespace) -> int:
    from scheduler.trace import trace_command

    return trace_command(args.journal, args.request, args.json, sys.stdout, sys.stderr)


def _cmd_proxy(args: argparse.Namespace) -> int:
    from kvguard.proxy.config import config_from_args

    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelName(args.log_level.upper())
        ),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"kvguard proxy: {exc}", file=sys.stderr)
        return 2
    from kvguard.proxy import run_proxy

    def ready(url: str) -> None:
        print(f"kvguard proxy: listening on {url}", flush=True)

    try:
        run_proxy(config, args.host, args.port, on_ready=ready)
    except OSError as exc:  # the listen address
        print(f"kvguard proxy: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    # benchmarks/ ships with the project but is not a runtime dependency of
    # the library: import it only for this command.
    from benchmarks.bench import main as bench_main

    return bench_main(json_path=args.json, quick=args.quick, vllm=args.vllm)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvguard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "diagram",
        help="regenerate docs/state-diagram.md from the table, or draw a journal's counts",
        description="Without --counts/--format: write (or --check) docs/state-diagram.md. "
        "With them: print the mermaid diagram (or render svg/png with Graphviz `dot` "
        "to --output), each edge labelled with how often a journal took it.",
    )
    p.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    p.add_argument(
        "--output", type=Path, default=None, help=f"default {DIAGRAM_PATH}; stdout with --counts"
    )
    p.add_argument(
        "--counts", type=Path, default=None, metavar="JOURNAL", help="label edges from a journal"
    )
    p.add_argument("--format", choices=("mermaid", "svg", "png"), default=None)
    p.set_defaults(func=_cmd_diagram)

    p = sub.add_parser(
        "trace",
        help="a request's timeline, or a summary, from a journal (kvguard run --journal)",
        epilog="Malformed lines are reported on stderr with their line number and "
        "skipped. Exit status: 0 ok, 1 unknown --request, 2 journal missing or unusable.",
    )
    p.add_argument("journal", type=Path, metavar="JOURNAL")
    p.add_argument("--request", default=None, metavar="ID", help="timeline of this request")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_trace)

    p = sub.add_parser(
        "run",
        help="push N requests prefill -> decode through the scheduler and verify them",
        description="The main job: a decode process on real Mooncake (loopback, "
        "P2PHANDSHAKE, no server), N requests through the scheduler, every DONE "
        "request verified byte for byte. Exit 0 iff every request ended terminal, "
        "integrity held and nothing was released before quiesce.",
    )
    p.add_argument("--requests", type=int, default=200, metavar="N")
    p.add_argument("--backend", choices=("mooncake", "local"), default="mooncake")
    p.add_argument("--seed", type=int, default=0, metavar="S")
    p.add_argument("--deadline", type=float, default=5.0, metavar="SECONDS", help="per request")
    p.add_argument("--workers", type=int, default=4, metavar="W")
    p.add_argument("--fault-rate", type=float, default=0.0, metavar="P")
    p.add_argument("--kill-decode-after", type=int, default=None, metavar="K")
    p.add_argument("--freeze-decode-after", type=int, default=None, metavar="K")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--blocks", type=int, default=1024, help="blocks per side")
    p.add_argument("--block-bytes", type=int, default=8192)
    p.add_argument("--blocks-per-request", type=int, default=16)
    p.add_argument(
        "--fragmentation",
        type=float,
        default=0.0,
        metavar="F",
        help="probability that a freed destination block returns at a random place in the"
        " free list (0: a serving engine's FIFO free list, mostly runs; 1: scattered)",
    )
    p.add_argument("--max-attempts", type=int, default=3)
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--journal", type=Path, default=None, metavar="PATH", help="JSON line per transition"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus /metrics on 127.0.0.1:PORT while running (0: any free port)",
    )
    p.add_argument(
        "--stuck-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="warn (rate-limited) about requests live for longer than this",
    )
    p.add_argument(
        "--decode",
        default=None,
        metavar="HOST:PORT",
        help="drive the `kvguard decode` service there instead of starting a local one",
    )
    p.add_argument(
        "--curve-secret",
        default=None,
        metavar="FILE",
        help="with --decode: this client's CURVE key pair (NAME.key_secret of `kvguard keygen`)",
    )
    p.add_argument(
        "--curve-server",
        default=None,
        metavar="FILE",
        help="with --decode: the service's public key (its NAME.key)",
    )
    p.add_argument(
        "--metadata",
        default="P2PHANDSHAKE",
        metavar="URL",
        help="the engine's metadata mode, as the decode service's: P2PHANDSHAKE (default),"
        " http://HOST:PORT/metadata or etcd://HOST:PORT",
    )
    p.add_argument(
        "--log-level",
        default="error",
        choices=("debug", "info", "warning", "error"),
        help="structlog level on stderr (transitions are debug/info/warning)",
    )
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser(
        "decode",
        help="serve a KV cache registered with Mooncake to `kvguard run --decode`",
        description="A decode service: owns a KV cache registered with Mooncake, "
        "advertises it and answers verification over a control channel (ZeroMQ; CURVE "
        "with --curve-secret/--curve-allowed, see docs/security.md), until SIGINT/SIGTERM; "
        "then it stops "
        "listening and releases the engine. Exit status 0 after a clean stop, 2 if it "
        "cannot start.",
    )
    from kvguard.decode.args import add_service_arguments

    add_service_arguments(p)
    p.set_defaults(func=_cmd_decode)

    p = sub.add_parser(
        "keygen",
        help="write a CURVE key pair for kvguard's control channels",
        description="Writes DIR/NAME.key (the public key: give it to the peers that "
        "allow or reach this one) and DIR/NAME.key_secret (the pair, mode 0600: keep it). "
        "Never overwrites a key. See docs/security.md.",
    )
    p.add_argument("directory", type=Path)
    p.add_argument("name")
    p.set_defaults(func=_cmd_keygen)

    p = sub.add_parser(
        "proxy",
        help="serve one OpenAI endpoint in front of prefill and decode vLLM servers",
        description="A PD proxy, the protocol of vLLM's toy proxy: each completion goes to a "
        "prefill with max_tokens 1 and do_remote_decode, then to a decode with the "
        "prefill's kv_transfer_params, whose reply is streamed back. Each leg has a "
        "deadline; a failed leg answers an OpenAI-style error naming it. Serves until "
        "SIGINT/SIGTERM (exit 0); exit 2 on a bad option or listen address.",
    )
    from kvguard.proxy.config import add_arguments as add_proxy_arguments

    add_proxy_arguments(p)
    p.set_defaults(func=_cmd_proxy)

    p = sub.add_parser(
        "bench",
        help="measure kvguard against its baselines and check the performance budget",
    )
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    p.add_argument("--quick", action="store_true", help="smoke test: fewer reps, no verdict")
    p.add_argument(
        "--vllm",
        action="store_true",
        help="instead: kvguard's vLLM connector against vLLM's own in real OpenAI servers "
        "(python -m benchmarks.vllm_pd, run with .venv-vllm's interpreter)",
    )
    p.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
