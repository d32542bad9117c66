"""`kvguard run` observed three ways: its journal, its Prometheus metrics and
its stuck-request warnings, each checked against the run's own summary."""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from kvguard.cli import main
from kvguard.run import RunConfig, run
from lifecycle import Event, FailureReason, TransferState
from scheduler import (
    Replay,
    Scheduler,
    StuckInspector,
    read_journal,
    register_metrics,
    serve_metrics,
    stuck_requests,
)
from transfer import KVCache, KVLayout
from transfer.faults import FaultInjectingBackend, FaultKind, FaultPlan
from transfer.local import LocalBackend

S = TransferState
NAMES = {
    "kvguard_transfers",
    "kvguard_live_requests",
    "kvguard_oldest_live_request_seconds",
    "kvguard_quarantined_requests",
    "kvguard_transfer_seconds",
    "kvguard_transfer_bytes",
    "kvguard_peer_lost",
}
Sample = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Sample:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def total(sample: Sample, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in sample.items() if n == name and want <= set(lab))


def assert_replay_matches(replay: Replay, summary: dict[str, object], requests: int) -> None:
    """Every request of the run is in the journal, on a complete path, ending
    where the summary says."""
    assert replay.problems == ()
    assert sorted(replay.requests) == [f"req-{i:06d}" for i in range(requests)]
    for t in replay.requests.values():
        assert t.is_terminal and t.stray == (), t
        # The path is the request's whole history: it leaves PENDING first.
        assert t.path[0].source is S.PENDING
    by_state = replay.terminal_counts()
    assert (by_state[S.DONE], by_state[S.FAILED]) == (summary["done"], summary["failed"])
    by_reason: dict[str, int] = {}
    for t in replay.requests.values():
        if t.reason is not None:
            by_reason[t.reason.name] = by_reason.get(t.reason.name, 0) + 1
    assert by_reason == summary["by_reason"]


# -- one real `kvguard run`, watched from outside while it runs ----------------------


@dataclass
class WatchedRun:
    journal: Path
    summary: dict[str, object]
    returncode: int
    stderr: str
    scrapes: list[Sample] = field(default_factory=list)


REQUESTS = 60
_OUTCOMES = ("done", "failed")  # the labels of kvguard_transfer_seconds


@pytest.fixture(scope="module")
def watched_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WatchedRun]:
    """Deliberately slow: injected hangs hold workers until the 1.5 s deadline."""
    tmp = tmp_path_factory.mktemp("run")
    journal, summary = tmp / "j.jsonl", tmp / "s.json"
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "kvguard.cli", "run", "--backend", "local",
            "--fault-rate", "0.3", "--requests", str(REQUESTS), "--deadline", "1.5",
            "--journal", str(journal), "--json", str(summary), "--no-progress",
            "--metrics-port", "0", "--stuck-after", "0.3",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    err_lines: list[str] = []
    url: list[str] = []
    seen_url = threading.Event()

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            err_lines.append(line)
            if m := re.search(r"serving metrics at (\S+)", line):
                url.append(m.group(1))
                seen_url.set()
        seen_url.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    scrapes: list[Sample] = []
    try:
        assert seen_url.wait(60), "no metrics URL on stderr"
        assert url, "".join(err_lines)
        while proc.poll() is None:
            try:
                scrapes.append(scrape(url[0]))
            except OSError:
                break  # the run ended and took its server with it
            time.sleep(0.1)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    yield WatchedRun(
        journal, json.loads(summary.read_text()), proc.returncode, "".join(err_lines), scrapes
    )


def test_run_journal_replays_to_the_summary(watched_run: WatchedRun) -> None:
    assert watched_run.returncode == 0, watched_run.stderr
    s = watched_run.summary
    assert s["failed"], "the fault rate should have failed some requests"
    assert_replay_matches(read_journal(watched_run.journal), s, REQUESTS)


def test_trace_and_diagram_counts_agree_with_the_summary(
    watched_run: WatchedRun, capsys: pytest.CaptureFixture[str]
) -> None:
    s = watched_run.summary
    assert main(["trace", str(watched_run.journal), "--json"]) == 0
    t = json.loads(capsys.readouterr().out)
    assert t["by_state"] == {
        "PENDING": 0,
        "TRANSFERRING": 0,
        "DONE": s["done"],
        "FAILED": s["failed"],
    }
    assert t["by_reason"] == s["by_reason"]
    assert (t["requests"], t["problems"], t["non_terminal"]) == (REQUESTS, 0, [])
    assert main(["diagram", "--counts", str(watched_run.journal)]) == 0
    diagram = capsys.readouterr().out
    edge = dict(re.findall(r"^\s+(\w+ --> \w+: \w+)[^(\n]*\((\d+)\)$", diagram, re.M))
    assert int(edge["TRANSFERRING --> DONE: complete"]) == s["done"]
    failed = int(edge["PENDING --> FAILED: fail"]) + int(edge["TRANSFERRING --> FAILED: fail"])
    assert failed == s["failed"]
    # Every attempt starts once: starts = requests that started + retries.
    assert int(edge["PENDING --> TRANSFERRING: start"]) == s["done"] + int(
        edge["TRANSFERRING --> FAILED: fail"]
    ) + int(edge["TRANSFERRING --> PENDING: retry"])
    assert f"DONE: DONE ({s['done']})" in diagram
    assert f"FAILED: FAILED ({s['failed']})" in diagram


def test_metrics_endpoint_answers_while_the_run_is_in_progress(watched_run: WatchedRun) -> None:
    scrapes = watched_run.scrapes
    assert len(scrapes) >= 2, watched_run.stderr
    assert {name for name, _ in scrapes[0]} >= {
        n + suffix
        for n, suffix in [
            ("kvguard_transfers", "_total"),
            ("kvguard_live_requests", ""),
            ("kvguard_oldest_live_request_seconds", ""),
            ("kvguard_transfer_seconds", "_bucket"),
            ("kvguard_transfer_bytes", "_total"),
            ("kvguard_peer_lost", "_total"),
        ]
    }
    ended = [total(x, "kvguard_transfers_total") for x in scrapes]
    assert ended[0] < REQUESTS  # scraped mid-run, not after
    assert ended == sorted(ended)  # counters never go back
    assert any(total(x, "kvguard_live_requests") > 0 for x in scrapes)
    # Counted so far never exceeds the final summary.
    s = watched_run.summary
    assert total(scrapes[-1], "kvguard_transfers_total", outcome="done") <= int(str(s["done"]))


def test_stuck_requests_are_warned_about_rate_limited(watched_run: WatchedRun) -> None:
    warnings = [ln for ln in watched_run.stderr.splitlines() if "stuck_requests" in ln]
    wall = float(str(watched_run.summary["wall_s"]))
    # At least one hang outlived --stuck-after; at most one warning per 10 s.
    assert 1 <= len(warnings) <= 1 + int(wall // 10)
    assert "oldest_state=TRANSFERRING" in warnings[0] and "oldest_peer=local-decode" in warnings[0]


# -- the same in-process: the final counters -------------------------------------------


def test_final_metrics_and_journal_match_the_summary(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    cfg = RunConfig(
        requests=50,
        backend="local",
        fault_rate=0.3,
        deadline_s=0.5,
        seed=3,
        progress=False,
        journal_path=tmp_path / "j.jsonl",
    )
    summary = run(cfg, io.StringIO(), registry=registry)
    assert summary.ok() == []
    sample = registry.get_sample_value
    assert sample("kvguard_transfers_total", {"outcome": "done", "reason": ""}) == summary.done
    for reason in FailureReason:
        got = sample("kvguard_transfers_total", {"outcome": "failed", "reason": reason.name})
        assert got == summary.by_reason.get(reason.name, 0), reason

    def ended() -> float:
        counts = (sample("kvguard_transfer_seconds_count", {"outcome": o}) for o in _OUTCOMES)
        return sum(c or 0 for c in counts)

    # The histogram's observer runs on the callback thread, which close()
    # waits for only a second: a host stall can leave the last ones queued.
    deadline = time.monotonic() + 10
    while ended() < cfg.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ended() == cfg.requests
    bytes_per_request = cfg.layers * 2 * cfg.blocks_per_request * cfg.block_bytes
    assert sample("kvguard_transfer_bytes_total") == summary.done * bytes_per_request
    assert sample("kvguard_live_requests", {"state": "PENDING"}) == 0
    assert sample("kvguard_live_requests", {"state": "TRANSFERRING"}) == 0
    assert sample("kvguard_oldest_live_request_seconds") == 0
    assert sample("kvguard_peer_lost_total") == 0
    assert_replay_matches(read_journal(cfg.journal_path or Path()), summary.to_json(), 50)


# -- the pieces an embedding application uses --------------------------------------------


@pytest.fixture
def warnings_on() -> Iterator[None]:
    """conftest filters below ERROR; capture_logs needs warnings through."""
    old = structlog.get_config()["wrapper_class"]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    try:
        yield
    finally:
        structlog.configure(wrapper_class=old)


@pytest.fixture
def hanging_scheduler() -> Iterator[tuple[Scheduler, FaultInjectingBackend]]:
    layout = KVLayout(2, 16, 256)
    local = LocalBackend(workers=2)
    src = KVCache(layout)
    local.register_source(src)
    faults = FaultInjectingBackend(
        local,
        FaultPlan.script([FaultKind.HANG] * 3),  # then no faults
    )
    sched = Scheduler(faults, src, workers=4, default_deadline_s=30.0)
    sched.add_peer(local.register_peer("d", KVCache(layout)))
    try:
        yield sched, faults
    finally:
        faults.release_hangs()
        sched.close()
        local.close()


def test_stuck_inspector_lists_and_warns(
    hanging_scheduler: tuple[Scheduler, FaultInjectingBackend], warnings_on: None
) -> None:
    sched, _ = hanging_scheduler
    sched.submit("h1", [0, 1], [2, 3], peer="d")
    time.sleep(0.02)
    sched.submit("h2", [4], [5], peer="d")
    deadline = time.monotonic() + 5
    while sum(lc.state is S.TRANSFERRING for lc in sched.live_requests()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.02)  # both are now older than the threshold
    now = [time.monotonic()]
    stuck = stuck_requests(sched, 0.01)
    assert [(s.request_id, s.state, s.attempt, s.peer) for s in stuck] == [
        ("h1", S.TRANSFERRING, 1, "d"),
        ("h2", S.TRANSFERRING, 1, "d"),
    ]
    assert stuck[0].age_s > stuck[1].age_s > 0.01
    assert stuck_requests(sched, 60.0) == []
    inspector = StuckInspector(sched, 0.01, warn_every_s=10.0, clock=lambda: now[0])
    with capture_logs() as logs:
        assert len(inspector.check()) == 2
        now[0] += 5.0
        assert len(inspector.check()) == 2  # found, but the warning is rate-limited
        now[0] += 5.0
        inspector.check()
    warnings = [r for r in logs if r["event"] == "stuck_requests"]
    assert len(warnings) == 2
    assert warnings[0]["log_level"] == "warning"
    assert (warnings[0]["count"], warnings[0]["oldest"], warnings[0]["oldest_peer"]) == (
        2,
        "h1",
        "d",
    )
    assert warnings[0]["request_ids"] == ["h1", "h2"]
    assert warnings[1]["checks_since_last_warning"] == 1


def test_stuck_inspector_thread_warns_and_stops(
    hanging_scheduler: tuple[Scheduler, FaultInjectingBackend], warnings_on: None
) -> None:
    sched, _ = hanging_scheduler
    sched.submit("h1", [0], [1], peer="d")
    with capture_logs() as logs, StuckInspector(sched, 0.05, warn_every_s=60.0) as inspector:
        deadline = time.monotonic() + 5
        while not logs:
            assert time.monotonic() < deadline, "no warning from the inspector thread"
            time.sleep(0.02)
        time.sleep(0.2)
    assert [r["event"] for r in logs] == ["stuck_requests"]  # once: rate-limited
    assert inspector._thread is None


def test_collector_on_a_caller_registry_and_server(
    hanging_scheduler: tuple[Scheduler, FaultInjectingBackend],
) -> None:
    sched, faults = hanging_scheduler
    registry = CollectorRegistry()
    register_metrics(sched, registry)
    with pytest.raises(ValueError, match="Duplicated"):
        register_metrics(sched, registry)  # one exporter per name and registry
    # The histogram is fed on the callback thread, after wait() may return.
    # Observers run in order, so once this later one saw "ok", the
    # collector's has seen both "h3" and "ok".
    observed_ok = threading.Event()
    sched.add_observer(lambda fin: fin.request_id == "ok" and observed_ok.set())
    for rid, block in [("h1", 0), ("h2", 2), ("h3", 4)]:  # the three hang
        sched.submit(rid, [block], [block + 1], peer="d")
    deadline = time.monotonic() + 5
    while sum(lc.state is S.TRANSFERRING for lc in sched.live_requests()) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert sched.abort("h3")
    sched.submit("ok", [6], [7], peer="d")
    assert sched.wait("ok", timeout=5) is S.DONE
    assert observed_ok.wait(5)
    with serve_metrics(registry, 0) as server:
        assert server.url.startswith("http://127.0.0.1:")
        x = scrape(server.url)
    assert total(x, "kvguard_live_requests", state="TRANSFERRING") == 2
    assert total(x, "kvguard_live_requests", state="PENDING") == 0
    assert total(x, "kvguard_oldest_live_request_seconds") > 0
    # The aborted request's hung op still holds its blocks (I6).
    assert total(x, "kvguard_quarantined_requests") == 1
    assert total(x, "kvguard_transfers_total", outcome="failed", reason="ABORTED") == 1
    assert total(x, "kvguard_transfers_total", outcome="failed") == 1  # zeros for the rest
    assert len([k for k in x if k[0] == "kvguard_transfers_total"]) == 1 + len(FailureReason)
    assert total(x, "kvguard_transfers_total", outcome="done") == 1
    assert total(x, "kvguard_transfer_bytes_total") == 2 * 2 * 256
    assert total(x, "kvguard_peer_lost_total") == 0
    assert total(x, "kvguard_transfer_seconds_count", outcome="failed") == 1
    assert total(x, "kvguard_transfer_seconds_count", outcome="done") == 1
    with pytest.raises(OSError):
        scrape(server.url)  # closed: nothing listens any more
    faults.release_hangs()


def test_journal_replay_of_a_scheduler_with_an_observer(tmp_path: Path) -> None:
    """Each Finished the scheduler reports has its terminal record in the journal."""
    from scheduler import Finished, JsonlJournal

    layout = KVLayout(2, 16, 256)
    local = LocalBackend(workers=2)
    src = KVCache(layout)
    local.register_source(src)
    faults = FaultInjectingBackend(local, FaultPlan(7, rate=0.5, kinds=(FaultKind.ERROR_CODE,)))
    finished: list[Finished] = []
    with JsonlJournal(tmp_path / "j.jsonl") as journal:
        sched = Scheduler(faults, src, workers=2, journal=journal)
        sched.add_observer(finished.append)
        sched.add_peer(local.register_peer("d", KVCache(layout)))
        for i in range(20):
            sched.submit(f"r{i}", [i % 16], [(i + 1) % 16], peer="d")
        assert sched.drain(10)
        sched.close()
    local.close()
    replay = read_journal(tmp_path / "j.jsonl")
    assert len(finished) == 20 and replay.problems == ()
    for fin in finished:
        t = replay.requests[fin.request_id]
        assert (t.state, t.reason, t.attempt) == (fin.state, fin.reason, fin.attempt)
        starts = sum(r.event is Event.START for r in t.path)
        assert starts == fin.attempt


# -- on the real engine ------------------------------------------------------------------


def _mooncake_importable() -> bool:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.mooncake
@pytest.mark.skipif(not _mooncake_importable(), reason="mooncake.engine not importable")
def test_mooncake_run_journal_matches_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    journal, summary_path = tmp_path / "j.jsonl", tmp_path / "s.json"
    proc = subprocess.run(
        [
            sys.executable, "-m", "kvguard.cli", "run", "--backend", "mooncake",
            "--fault-rate", "0.3", "--requests", "30", "--deadline", "1",
            "--journal", str(journal), "--json", str(summary_path), "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert_replay_matches(read_journal(journal), summary, 30)
    assert main(["diagram", "--counts", str(journal)]) == 0
    assert f"TRANSFERRING --> DONE: complete ({summary['done']})" in capsys.readouterr().out
