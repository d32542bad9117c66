"""The journal file format both ways, `kvguard trace` and `kvguard diagram --counts`."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import structlog

from kvguard.cli import main
from lifecycle import (
    TRANSITIONS,
    Event,
    FailureReason,
    RequestLifecycle,
    TransferState,
    render_mermaid,
)
from scheduler import JournalError, JsonlJournal, read_journal
from scheduler.trace import render_dot, summary_json

S = TransferState


def write_journal(path: Path, drive: Callable[[JsonlJournal], None]) -> Path:
    with JsonlJournal(path) as journal:
        drive(journal)
    return path


def record(
    rid: str, event: str, source: str, dest: str, attempt: int, ts: float, **kw: object
) -> str:
    return json.dumps(
        {
            "event": event,
            "request_id": rid,
            "source": source,
            "dest": dest,
            "reason": kw.pop("reason", None),
            "attempt": attempt,
            "ts": ts,
            **kw,
        }
    )


def three_requests(journal: JsonlJournal) -> None:
    a = RequestLifecycle("a", max_attempts=3, journal=journal)
    a.start()
    a.retry()
    a.start()
    a.complete()
    a.fail(FailureReason.TIMEOUT)  # late: ignored, journaled
    b = RequestLifecycle("b", max_attempts=2, journal=journal)
    b.start()
    b.retry()
    b.fail(FailureReason.ABORTED)
    c = RequestLifecycle("c", journal=journal)
    c.start()  # never terminal


# -- the file format --------------------------------------------------------------


def test_records_replay_to_each_lifecycle_history(tmp_path: Path) -> None:
    lcs: list[RequestLifecycle] = []

    def drive(journal: JsonlJournal) -> None:
        for i, reason in enumerate([None, FailureReason.PEER_LOST, FailureReason.TIMEOUT]):
            lc = RequestLifecycle(f"r{i}", max_attempts=3, journal=journal)
            lcs.append(lc)
            lc.start()
            lc.retry()
            lc.start()
            if reason is None:
                lc.complete()
            else:
                lc.fail(reason, ConnectionError("x"))
            lc.complete()  # ignored: a late completion

    replay = read_journal(write_journal(tmp_path / "j.jsonl", drive))
    assert replay.problems == ()
    assert replay.records == 3 * 5
    for lc in lcs:
        t = replay.requests[lc.request_id]
        assert [(r.event, r.source, r.dest, r.reason, r.attempt) for r in t.path] == [
            (h.event, h.source, h.dest, h.reason, h.attempt) for h in lc.history
        ]
        assert (t.state, t.reason, t.attempt) == (lc.state, lc.reason, lc.attempt)
        assert [(r.event, r.ignored, r.source) for r in t.ignored] == [
            (Event.COMPLETE, True, lc.state)
        ]
    first = json.loads((tmp_path / "j.jsonl").read_text().splitlines()[0])
    assert {"request_id", "event", "source", "dest", "reason", "attempt", "ts"} <= set(first)


def test_writes_every_level_without_configuring_structlog(tmp_path: Path) -> None:
    # conftest filters the application's loggers below ERROR; the journal
    # file still gets every (debug) record, and the configuration is untouched.
    before = structlog.get_config()
    replay = read_journal(write_journal(tmp_path / "j.jsonl", three_requests))
    assert structlog.get_config() == before
    assert replay.edge_counts()[(S.PENDING, Event.START, S.TRANSFERRING)] == 4


def test_concurrent_records_never_interleave(tmp_path: Path) -> None:
    threads, per_thread = 8, 300

    def drive(journal: JsonlJournal) -> None:
        def work(t: int) -> None:
            for i in range(per_thread):
                lc = RequestLifecycle(f"t{t}-{i}", journal=journal)
                lc.start()
                lc.complete()

        ts = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        assert journal.written == 2 * threads * per_thread

    replay = read_journal(write_journal(tmp_path / "j.jsonl", drive))
    assert replay.problems == ()
    assert replay.terminal_counts() == {S.DONE: threads * per_thread}


def test_records_after_close_are_dropped_not_raised(tmp_path: Path) -> None:
    journal = JsonlJournal(tmp_path / "j.jsonl")
    lc = RequestLifecycle("late", journal=journal)
    lc.start()
    journal.close()
    assert lc.complete() is True  # the lifecycle is not hurt by a closed journal
    assert (journal.written, journal.dropped) == (1, 1)


def test_swapped_records_replay_in_path_order(tmp_path: Path) -> None:
    # Journaling happens outside the lifecycle lock: a watchdog's `fail` can
    # reach the file before the worker's `start` that preceded it.
    lines = [
        record("x", "fail", "TRANSFERRING", "FAILED", 2, 5.0, reason="TIMEOUT"),
        record("x", "start", "PENDING", "TRANSFERRING", 2, 4.0),
        record("x", "retry", "TRANSFERRING", "PENDING", 1, 3.0),
        record("x", "start", "PENDING", "TRANSFERRING", 1, 2.0),
    ]
    (tmp_path / "j.jsonl").write_text("\n".join(lines) + "\n")
    replay = read_journal(tmp_path / "j.jsonl")
    assert replay.problems == ()
    t = replay.requests["x"]
    assert [(r.event.value, r.attempt) for r in t.path] == [
        ("start", 1),
        ("retry", 1),
        ("start", 2),
        ("fail", 2),
    ]
    assert (t.state, t.reason, t.latency_s) == (S.FAILED, FailureReason.TIMEOUT, 3.0)


def test_a_missing_record_is_reported_at_the_line_after_the_gap(tmp_path: Path) -> None:
    lines = [
        record("x", "start", "PENDING", "TRANSFERRING", 1, 1.0),
        record("x", "retry", "TRANSFERRING", "PENDING", 1, 2.0),
        # start of attempt 2 lost (a crash, a truncated copy)
        record("x", "complete", "TRANSFERRING", "DONE", 2, 3.0),
    ]
    (tmp_path / "j.jsonl").write_text("\n".join(lines) + "\n")
    replay = read_journal(tmp_path / "j.jsonl")
    assert [p.line for p in replay.problems] == [3]
    assert "a record before it is missing" in replay.problems[0].message
    t = replay.requests["x"]
    assert t.state is S.PENDING and not t.is_terminal
    assert [r.line for r in t.stray] == [3]


# -- kvguard trace ----------------------------------------------------------------


def test_trace_reports_malformed_lines_and_reads_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = write_journal(tmp_path / "good.jsonl", three_requests).read_text().splitlines()
    bad_lines = {
        2: '{"event": "start", "request_id": "q"',  # truncated by a crash
        4: "[1, 2]",
        6: record("q", "start", "PENDING", "TRANSFERRING", 1, 1.0).replace('"ts"', '"tz"'),
        8: record("q", "start", "PENDING", "LIMBO", 1, 1.0),
        10: record("q", "complete", "PENDING", "DONE", 1, 1.0),
        12: record("q", "fail", "PENDING", "PENDING", 0, 1.0, ignored=True),
        13: record("q", "fail", "TRANSFERRING", "FAILED", 1, 1.0, reason="BAD_LUCK"),
    }
    lines: list[str] = []
    for text in good:
        while len(lines) + 1 in bad_lines:
            lines.append(bad_lines[len(lines) + 1])
        lines.append(text)
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n\n")
    assert main(["trace", str(path), "--json"]) == 0
    out, err = capsys.readouterr()
    reported = [ln for ln in err.splitlines() if ln.startswith(f"kvguard trace: {path}:")]
    assert [int(ln.split(":")[2]) for ln in reported] == sorted(bad_lines)
    for needle in (
        "not JSON",
        "expected a JSON object",
        "missing key(s) ts",
        "unknown state 'LIMBO'",
        "PENDING --complete--> DONE is not in the transition table",
        "must stay in a terminal state",
        "unknown failure reason 'BAD_LUCK'",
    ):
        assert needle in err, needle
    summary = json.loads(out)
    assert (summary["records"], summary["problems"], summary["requests"]) == (9, 7, 3)
    assert summary["by_state"] == {"PENDING": 0, "TRANSFERRING": 1, "DONE": 1, "FAILED": 1}
    assert summary["by_reason"] == {"ABORTED": 1}
    assert (summary["retries"], summary["ignored_events"]) == (2, 1)


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "no such file"), ("", "empty file"), ("garbage\n{}\n", "2 malformed lines")],
)
def test_trace_unusable_journal_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, message: str
) -> None:
    path = tmp_path / "j.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(JournalError, match=message):
        read_journal(path)
    assert main(["trace", str(path)]) == 2
    assert message in capsys.readouterr().err
    assert main(["diagram", "--counts", str(path)]) == 2


def test_trace_unknown_request_exits_1_with_suggestions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_journal(tmp_path / "j.jsonl", three_requests)
    (tmp_path / "j.jsonl").write_text(path.read_text().replace('"b"', '"req-000042"'))
    assert main(["trace", str(path), "--request", "req-00042"]) == 1
    err = capsys.readouterr().err
    assert "request 'req-00042' is not in" in err and "did you mean req-000042" in err


def test_trace_timeline_of_one_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [
        record("x", "start", "PENDING", "TRANSFERRING", 1, 100.0),
        record("x", "retry", "TRANSFERRING", "PENDING", 1, 100.010),
        record("x", "start", "PENDING", "TRANSFERRING", 2, 100.025),
        record("x", "fail", "TRANSFERRING", "FAILED", 2, 100.5, reason="PEER_LOST"),
        record("x", "complete", "FAILED", "FAILED", 2, 100.7, ignored=True),
        record("y", "start", "PENDING", "TRANSFERRING", 1, 100.1),
    ]
    path = tmp_path / "j.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert main(["trace", str(path), "--request", "x"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "x: FAILED (PEER_LOST) after 500.000 ms, 2 attempt(s)"
    assert [ln.split()[0] for ln in out[1:]] == [
        "+0.000",
        "+10.000",
        "+25.000",
        "+500.000",
        "+700.000",
    ]
    assert "fail      TRANSFERRING -> FAILED" in out[4] and "reason PEER_LOST" in out[4]
    assert "complete  ignored: already FAILED" in out[5]
    assert [ln.split("attempt ")[1][0] for ln in out[1:]] == ["1", "1", "2", "2", "2"]
    assert main(["trace", str(path), "--request", "y", "--json"]) == 0
    y = json.loads(capsys.readouterr().out)
    assert (y["state"], y["latency_s"], len(y["records"])) == ("TRANSFERRING", None, 1)


def test_trace_summary_lists_non_terminal_oldest_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [
        record("young", "start", "PENDING", "TRANSFERRING", 1, 50.0),
        record("old", "start", "PENDING", "TRANSFERRING", 1, 10.0),
        record("old", "retry", "TRANSFERRING", "PENDING", 1, 20.0),
        record("done", "start", "PENDING", "TRANSFERRING", 1, 30.0),
        record("done", "complete", "TRANSFERRING", "DONE", 1, 31.0),
        record("slow", "start", "PENDING", "TRANSFERRING", 1, 40.0),
        record("slow", "complete", "TRANSFERRING", "DONE", 1, 60.0),
    ]
    path = tmp_path / "j.jsonl"
    path.write_text("\n".join(lines) + "\n")
    replay = read_journal(path)
    assert [t.request_id for t in replay.non_terminal()] == ["old", "young"]
    s = summary_json(replay)
    assert [(t["request_id"], t["state"], t["silent_for_s"]) for t in s["non_terminal"]] == [
        ("old", "PENDING", 40.0),
        ("young", "TRANSFERRING", 10.0),
    ]
    assert s["latency_ms"] == {"p50": 20000.0, "p90": 20000.0, "p99": 20000.0, "max": 20000.0}
    assert main(["trace", str(path)]) == 0
    out = capsys.readouterr().out
    tail = out.split("never reached a terminal state: 2 (oldest first)\n")[1].splitlines()
    assert [ln.split()[0] for ln in tail] == ["old", "young"]


# -- kvguard diagram --counts --------------------------------------------------------


def test_diagram_counts_labels_every_edge_and_terminal_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_journal(tmp_path / "j.jsonl", three_requests)
    assert main(["diagram", "--counts", str(path)]) == 0
    out = capsys.readouterr().out
    replay = read_journal(path)
    assert out == render_mermaid(replay.edge_counts(), replay.terminal_counts())
    for line in (
        "PENDING --> TRANSFERRING: start (4)",
        "TRANSFERRING --> DONE: complete (1)",
        "TRANSFERRING --> PENDING: retry [attempts_left] (2)",
        "PENDING --> FAILED: fail (1)",
        "TRANSFERRING --> FAILED: fail (0)",
        "DONE: DONE (1)",
        "FAILED: FAILED (1)",
    ):
        assert line in out, line
    target = tmp_path / "d.mmd"
    assert main(["diagram", "--counts", str(path), "--output", str(target)]) == 0
    assert target.read_text() == out


def test_render_dot_comes_from_the_table_with_counts() -> None:
    counts = {(t.source, t.event, t.dest): 0 for t in TRANSITIONS}
    counts[(S.PENDING, Event.START, S.TRANSFERRING)] = 10
    counts[(S.TRANSFERRING, Event.COMPLETE, S.DONE)] = 5
    dot = render_dot(counts, {S.DONE: 5})
    edges = [ln.strip() for ln in dot.splitlines() if " -> " in ln and "__initial" not in ln]
    assert len(edges) == len(TRANSITIONS)
    assert 'PENDING -> TRANSFERRING [label="start (10)", penwidth=5.00];' in edges
    assert 'TRANSFERRING -> DONE [label="complete (5)", penwidth=3.00];' in edges
    assert sum("style=dashed" in e for e in edges) == len(TRANSITIONS) - 2
    assert 'DONE [label="DONE (5)", peripheries=2]' in dot
    assert 'FAILED [label="FAILED (0)", peripheries=2]' in dot
    plain = render_dot()
    assert "(" not in plain and "dashed" not in plain


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` not installed")
@pytest.mark.parametrize(("fmt", "magic"), [("svg", b"<?xml"), ("png", b"\x89PNG")])
def test_diagram_renders_with_graphviz(tmp_path: Path, fmt: str, magic: bytes) -> None:
    path = write_journal(tmp_path / "j.jsonl", three_requests)
    out = tmp_path / f"d.{fmt}"
    assert main(["diagram", "--counts", str(path), "--format", fmt, "--output", str(out)]) == 0
    assert out.read_bytes().startswith(magic)
    if fmt == "svg":
        assert "start (4)" in out.read_text()


def test_diagram_without_graphviz_says_how_to_get_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_journal(tmp_path / "j.jsonl", three_requests)
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dot` here
    out = tmp_path / "d.svg"
    assert main(["diagram", "--counts", str(path), "--format", "svg", "--output", str(out)]) == 2
    assert "needs Graphviz's `dot`" in capsys.readouterr().err
    assert not out.exists()


def test_diagram_flag_misuse(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_journal(tmp_path / "j.jsonl", three_requests)
    assert main(["diagram", "--counts", str(path), "--format", "svg"]) == 2
    assert "needs --output FILE" in capsys.readouterr().err
    assert main(["diagram", "--check", "--counts", str(path)]) == 2
    assert "--check takes no --counts/--format" in capsys.readouterr().err
