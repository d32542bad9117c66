"""Views of a replayed journal: one request's timeline, a run's summary, and
the state diagram labelled with what really happened.

Everything here works on a ``journal.Replay``: journal.py owns the file
format. The diagram comes from the same ``TRANSITIONS`` table as
docs/state-diagram.md: mermaid is ``lifecycle.render_mermaid(
replay.edge_counts(), replay.terminal_counts())``; DOT, for Graphviz, is
``render_dot`` below. ``trace_command`` and ``diagram_command`` are the
bodies of ``kvguard trace`` and ``kvguard diagram --counts/--format``.
"""

from __future__ import annotations

import difflib
import json
import shutil
import subprocess
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from lifecycle import INITIAL, TERMINAL, TRANSITIONS, Event, TransferState, render_mermaid

from .journal import EdgeKey, JournalError, JournalRecord, Replay, RequestTrace, read_journal

__all__ = [
    "EXIT_OK",
    "EXIT_UNKNOWN_REQUEST",
    "EXIT_UNUSABLE",
    "GraphvizMissing",
    "diagram_command",
    "format_summary",
    "format_timeline",
    "percentiles",
    "render_dot",
    "render_graphviz",
    "summary_json",
    "timeline_json",
    "trace_command",
]

_PERCENTILES = (50, 90, 99)


def percentiles(values: Sequence[float], ps: Sequence[int] = _PERCENTILES) -> dict[str, float]:
    """Nearest-rank percentiles (as ``kvguard run`` computes them) and the max."""
    if not values:
        return {}
    s = sorted(values)
    out = {f"p{p}": s[min(len(s) - 1, len(s) * p // 100)] for p in ps}
    out["max"] = s[-1]
    return out


# -- one request -------------------------------------------------------------------


def _describe(rec: JournalRecord) -> str:
    if rec.ignored:
        return f"{rec.event.value:<9} ignored: already {rec.source.name}"
    return f"{rec.event.value:<9} {rec.source.name} -> {rec.dest.name}"


def format_timeline(t: RequestTrace) -> str:
    """Each record with the time since the request's first record."""
    if t.is_terminal:
        outcome = t.state.name + (f" ({t.reason.name})" if t.reason is not None else "")
        outcome += f" after {1000 * (t.latency_s or 0.0):.3f} ms"
    else:
        outcome = f"never reached a terminal state (last seen in {t.state.name})"
    lines = [f"{t.request_id}: {outcome}, {t.attempt} attempt(s)"]
    t0 = t.first_ts
    for rec in t.timeline():
        reason = f"  reason {rec.reason.name}" if rec.reason is not None else ""
        stray = "  (out of path: a record before it is missing)" if rec in t.stray else ""
        lines.append(
            f"  {1000 * (rec.ts - t0):>+11.3f} ms  {_describe(rec):<40} "
            f"attempt {rec.attempt}{reason}  [line {rec.line}]{stray}"
        )
    return "\n".join(lines) + "\n"


def timeline_json(t: RequestTrace) -> dict[str, Any]:
    t0 = t.first_ts
    return {
        "request_id": t.request_id,
        "state": t.state.name,
        "reason": t.reason.name if t.reason is not None else None,
        "attempt": t.attempt,
        "latency_s": t.latency_s,
        "records": [
            {
                "line": r.line,
                "since_first_s": r.ts - t0,
                "event": r.event.value,
                "source": r.source.name,
                "dest": r.dest.name,
                "reason": r.reason.name if r.reason is not None else None,
                "attempt": r.attempt,
                "ignored": r.ignored,
            }
            for r in t.timeline()
        ],
    }


# -- the whole journal -------------------------------------------------------------


def summary_json(replay: Replay) -> dict[str, Any]:
    traces = replay.requests.values()
    latencies = [t.latency_s for t in traces if t.latency_s is not None]
    by_reason = Counter(
        t.reason.name for t in traces if t.state is TransferState.FAILED and t.reason is not None
    )
    end = replay.end_ts
    return {
        "journal": str(replay.path),
        "records": replay.records,
        "problems": len(replay.problems),
        "requests": len(replay.requests),
        "by_state": {s.name: sum(t.state is s for t in traces) for s in TransferState},
        "by_reason": dict(sorted(by_reason.items())),
        "retries": sum(r.event is Event.RETRY for t in traces for r in t.path),
        "ignored_events": sum(len(t.ignored) for t in traces),
        "latency_ms": {k: round(1000 * v, 3) for k, v in percentiles(latencies).items()},
        "non_terminal": [
            {
                "request_id": t.request_id,
                "state": t.state.name,
                "attempt": t.attempt,
                "first_seen_ts": t.first_ts,
                "silent_for_s": round(end - t.last_ts, 6),
            }
            for t in replay.non_terminal()
        ],
    }


def format_summary(replay: Replay) -> str:
    s = summary_json(replay)
    rows: list[tuple[str, object]] = [
        ("journal", f"{s['journal']} ({s['records']} records, {s['problems']} problems)"),
        ("requests", s["requests"]),
        ("DONE", s["by_state"]["DONE"]),
        ("FAILED", s["by_state"]["FAILED"]),
        *((f"  {reason}", n) for reason, n in s["by_reason"].items()),
        ("retries", s["retries"]),
        ("ignored late events", s["ignored_events"]),
    ]
    lat = s["latency_ms"]
    if lat:
        rows.append(
            (
                "latency (ms, first record -> terminal)",
                "  ".join(f"{k} {v:.2f}" for k, v in lat.items()),
            )
        )
    width = max(len(k) for k, _ in rows)
    out = [f"{k:<{width}}  {v}" for k, v in rows]
    stuck = s["non_terminal"]
    out.append(
        f"never reached a terminal state: {len(stuck)}" + (" (oldest first)" if stuck else "")
    )
    out.extend(
        f"  {t['request_id']}  {t['state']:<12}  attempt {t['attempt']}  "
        f"silent for {t['silent_for_s']:.3f} s before the journal ends"
        for t in stuck
    )
    return "\n".join(out) + "\n"


# -- the diagram -------------------------------------------------------------------


def render_dot(
    counts: Mapping[EdgeKey, int] | None = None,
    terminal_counts: Mapping[TransferState, int] | None = None,
) -> str:
    """The transition table as Graphviz DOT; edges thicken with their count.

    An edge never taken is dashed and grey: with counts, the picture shows
    which paths a run exercised, and which it did not.
    """
    top = max(counts.values(), default=0) if counts else 0
    lines = [
        "digraph kvguard {",
        "    rankdir=LR;",
        '    node [shape=box, style=rounded, fontname="Helvetica"];',
        '    edge [fontname="Helvetica"];',
        '    __initial [shape=point, label=""];',
        f"    __initial -> {INITIAL.name};",
    ]
    for state in TransferState:
        if state in TERMINAL:
            label = state.name
            if terminal_counts is not None:
                label += f" ({terminal_counts.get(state, 0)})"
            lines.append(f'    {state.name} [label="{label}", peripheries=2];')
    for t in TRANSITIONS:
        label = t.event.value + (f" [{t.guard}]" if t.guard else "")
        attrs = ""
        if counts is not None:
            n = counts.get((t.source, t.event, t.dest), 0)
            label += f" ({n})"
            attrs = (
                f", penwidth={1 + 4 * n / top:.2f}"
                if n and top
                else ', style=dashed, color="gray50", fontcolor="gray50"'
            )
        lines.append(f'    {t.source.name} -> {t.dest.name} [label="{label}"{attrs}];')
    lines.append("}")
    return "\n".join(lines) + "\n"


class GraphvizMissing(RuntimeError):
    """Graphviz's ``dot`` is not on PATH."""


def render_graphviz(dot_source: str, fmt: str, output: Path, *, timeout_s: float = 60.0) -> None:
    """Render DOT to ``output`` as svg or png with Graphviz's ``dot``."""
    if fmt not in ("svg", "png"):
        raise ValueError(f"Graphviz formats are svg and png, not {fmt!r}")
    dot = shutil.which("dot")
    if dot is None:
        raise GraphvizMissing(
            f"--format {fmt} needs Graphviz's `dot` on PATH "
            "(Debian/Ubuntu: apt-get install graphviz); --format mermaid needs nothing"
        )
    proc = subprocess.run(
        [dot, f"-T{fmt}", "-o", str(output)],
        input=dot_source,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"dot exited with status {proc.returncode}: {proc.stderr.strip()}")


# -- the commands (``kvguard trace``, ``kvguard diagram --counts/--format``) --------

# Exit statuses of both commands; documented in docs/observability.md.
EXIT_OK, EXIT_UNKNOWN_REQUEST, EXIT_UNUSABLE = 0, 1, 2
_MAX_PROBLEMS_SHOWN = 20


def _read(prog: str, journal: Path, err: TextIO) -> Replay | None:
    """Read the journal; report skipped lines on ``err`` and carry on."""
    replay: Replay | None = None
    try:
        replay = read_journal(journal)
        problems = replay.problems
    except JournalError as exc:
        problems = exc.problems
        failure: JournalError | None = exc
    else:
        failure = None
    for p in problems[:_MAX_PROBLEMS_SHOWN]:
        err.write(f"{prog}: {journal}:{p.line}: {p.message}\n")
    if len(problems) > _MAX_PROBLEMS_SHOWN:
        err.write(f"{prog}: ... and {len(problems) - _MAX_PROBLEMS_SHOWN} more in {journal}\n")
    if failure is not None:
        err.write(f"{prog}: {failure}\n")
    return replay


def trace_command(
    journal: Path, request: str | None, as_json: bool, out: TextIO, err: TextIO
) -> int:
    prog = "kvguard trace"
    replay = _read(prog, journal, err)
    if replay is None:
        return EXIT_UNUSABLE
    if request is None:
        out.write(
            json.dumps(summary_json(replay), indent=2) + "\n" if as_json else format_summary(replay)
        )
        return EXIT_OK
    t = replay.requests.get(request)
    if t is None:
        close = difflib.get_close_matches(request, list(replay.requests), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        err.write(
            f"{prog}: request {request!r} is not in {journal} "
            f"({len(replay.requests)} requests){hint}\n"
        )
        return EXIT_UNKNOWN_REQUEST
    out.write(json.dumps(timeline_json(t), indent=2) + "\n" if as_json else format_timeline(t))
    return EXIT_OK


def diagram_command(
    journal: Path | None, fmt: str, output: Path | None, out: TextIO, err: TextIO
) -> int:
    """The table's diagram, labelled with a journal's counts when given one."""
    prog = "kvguard diagram"
    counts: Counter[EdgeKey] | None = None
    terminal: Counter[TransferState] | None = None
    if journal is not None:
        replay = _read(prog, journal, err)
        if replay is None:
            return EXIT_UNUSABLE
        counts, terminal = replay.edge_counts(), replay.terminal_counts()
    if fmt == "mermaid":
        text = render_mermaid(counts, terminal)
        if output is None:
            out.write(text)
        else:
            output.write_text(text)
            err.write(f"{prog}: wrote {output}\n")
        return EXIT_OK
    if output is None:
        err.write(f"{prog}: --format {fmt} needs --output FILE\n")
        return EXIT_UNUSABLE
    try:
        render_graphviz(render_dot(counts, terminal), fmt, output)
    except (GraphvizMissing, RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        err.write(f"{prog}: {exc}\n")
        return EXIT_UNUSABLE
    err.write(f"{prog}: wrote {output}\n")
    return EXIT_OK
