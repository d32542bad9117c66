"""The journal: one structlog record per transition and per ignored late event;
the library never configures structlog."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from lifecycle import (
    LOGGER_NAME,
    CompletionGuard,
    Event,
    FailureReason,
    InvalidTransition,
    Journal,
    RequestLifecycle,
    TransferState,
    TransitionRecord,
)

KEYS = {"event", "request_id", "source", "dest", "reason", "attempt", "ts", "log_level"}


def test_one_record_per_transition(all_levels: None) -> None:
    t0 = time.time()
    with capture_logs() as logs:
        lc = RequestLifecycle("j-1", max_attempts=2)
        lc.start()
        lc.retry()
        lc.start()
        err = ConnectionResetError("peer")
        lc.fail(FailureReason.PEER_LOST, err)
    t1 = time.time()
    assert [set(r) for r in logs] == [KEYS] * 4
    assert [
        (r["event"], r["request_id"], r["source"], r["dest"], r["reason"], r["attempt"])
        for r in logs
    ] == [
        ("start", "j-1", "PENDING", "TRANSFERRING", None, 1),
        ("retry", "j-1", "TRANSFERRING", "PENDING", None, 1),
        ("start", "j-1", "PENDING", "TRANSFERRING", None, 2),
        ("fail", "j-1", "TRANSFERRING", "FAILED", "PEER_LOST", 2),
    ]
    ts = [r["ts"] for r in logs]
    assert ts == sorted(ts)
    assert t0 <= ts[0] and ts[-1] <= t1
    assert all("ignored" not in r for r in logs)
    # Levels: failures stand out, the happy path is debug.
    assert [r["log_level"] for r in logs] == ["debug", "info", "debug", "warning"]
    # Records match the history one to one.
    assert [(r["source"], r["dest"]) for r in logs] == [
        (h.source.name, h.dest.name) for h in lc.history
    ]


def test_happy_path_records(all_levels: None) -> None:
    with capture_logs() as logs:
        lc = RequestLifecycle("j-2")
        lc.start()
        lc.complete()
    assert [(r["event"], r["source"], r["dest"], r["reason"]) for r in logs] == [
        ("start", "PENDING", "TRANSFERRING", None),
        ("complete", "TRANSFERRING", "DONE", None),
    ]


def test_ignored_late_events_are_recorded(all_levels: None) -> None:
    lc = RequestLifecycle("j-3")
    lc.start()
    lc.fail(FailureReason.TIMEOUT)
    with capture_logs() as logs:
        assert lc.complete() is False
        assert lc.fail(FailureReason.ABORTED) is False
        assert lc.start() is False
        assert lc.retry() is False
    assert len(logs) == 4
    assert all(r["ignored"] is True for r in logs)
    assert all(set(r) == KEYS | {"ignored"} for r in logs)
    assert [r["event"] for r in logs] == ["complete", "fail", "start", "retry"]
    assert all(r["source"] == r["dest"] == "FAILED" for r in logs)
    assert all(r["request_id"] == "j-3" and r["attempt"] == 1 for r in logs)
    # The late failure's own reason is what was ignored; the first cause stays.
    assert [r["reason"] for r in logs] == [None, "ABORTED", None, None]
    assert lc.reason is FailureReason.TIMEOUT
    assert all(isinstance(r["ts"], float) and r["ts"] > 1.7e9 for r in logs)  # wall clock


def test_guard_exit_of_a_finished_worker_adds_no_record(all_levels: None) -> None:
    # The guard only fails a request that is still live: a worker that
    # completed leaves no ignored "fail" record behind on its normal exit.
    lc = RequestLifecycle("j-4")
    with capture_logs() as logs, CompletionGuard(lc):
        lc.start()
        lc.complete()
    assert [(r["event"], r.get("ignored", False)) for r in logs] == [
        ("start", False),
        ("complete", False),
    ]
    # A guarded worker that did not finish is failed, with one record.
    lc2 = RequestLifecycle("j-4b")
    with capture_logs() as logs, CompletionGuard(lc2):
        lc2.start()
    assert [(r["event"], r["reason"], r.get("ignored", False)) for r in logs] == [
        ("start", None, False),
        ("fail", "WORKER_EXITED", False),
    ]


def test_invalid_events_produce_no_record(all_levels: None) -> None:
    lc = RequestLifecycle("j-5")
    with capture_logs() as logs:
        with pytest.raises(InvalidTransition):
            lc.complete()
        with pytest.raises(InvalidTransition):
            lc.retry()
    assert logs == []


def test_default_production_level_keeps_only_failures_and_retries() -> None:
    # conftest configures an ERROR filter; use INFO, the usual production level.
    old = structlog.get_config()["wrapper_class"]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    try:
        with capture_logs() as logs:
            lc = RequestLifecycle("j-6", max_attempts=2)
            lc.start()
            lc.retry()
            lc.start()
            lc.complete()
            lc.fail(FailureReason.TIMEOUT)  # ignored: debug
            lc2 = RequestLifecycle("j-7")
            lc2.fail(FailureReason.SHUTDOWN)
    finally:
        structlog.configure(wrapper_class=old)
    assert [(r["request_id"], r["event"], r["log_level"]) for r in logs] == [
        ("j-6", "retry", "info"),
        ("j-7", "fail", "warning"),
    ]


class _ListLogger:
    """A stand-in logger: what a custom Journal receives."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        def log(event: str, **kw: Any) -> None:
            self.calls.append((level, event, kw))

        return log


def test_a_custom_journal_receives_every_record() -> None:
    sink = _ListLogger()
    lc = RequestLifecycle("j-8", journal=Journal(sink))
    lc.start()
    lc.complete()
    lc.complete()
    assert [(lvl, ev, kw.get("ignored", False)) for lvl, ev, kw in sink.calls] == [
        ("debug", "start", False),
        ("debug", "complete", False),
        ("debug", "complete", True),
    ]
    assert all(kw["request_id"] == "j-8" for _, _, kw in sink.calls)


def test_records_are_json_serialisable(all_levels: None) -> None:
    with capture_logs() as logs:
        lc = RequestLifecycle("j-9")
        lc.fail(FailureReason.INVALID_REQUEST, ValueError("bad plan"))
        lc.complete()
    for r in logs:
        json.dumps(r)  # values are plain strings, ints, floats and None


def test_the_logger_name_is_stable() -> None:
    assert LOGGER_NAME == "kvguard.lifecycle"


_PROBE = """
import json, logging, structlog
before = (structlog.is_configured(), repr(structlog.get_config()))
handlers_before = list(logging.getLogger().handlers)
import lifecycle
from lifecycle import CompletionGuard, FailureReason, RequestLifecycle
after_import = (structlog.is_configured(), repr(structlog.get_config()))
lc = RequestLifecycle("probe")
with CompletionGuard(lc):
    lc.start()
lc.complete()
after_use = (structlog.is_configured(), repr(structlog.get_config()))
print(json.dumps({
    "before": before[0], "after_import": after_import[0], "after_use": after_use[0],
    "config_unchanged": before[1] == after_import[1] == after_use[1],
    "handlers_unchanged": handlers_before == list(logging.getLogger().handlers),
    "state": lc.state.name,
}))
"""


def test_importing_and_using_lifecycle_does_not_configure_structlog() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {
        "before": False,
        "after_import": False,
        "after_use": False,
        "config_unchanged": True,
        "handlers_unchanged": True,
        "state": "FAILED",
    }


# -- issue 10 item 6h: the first loss is always reported ---------------------------------------


class _RaisingLogger:
    def __getattr__(self, name: str) -> Any:
        def log(*args: object, **kw: object) -> None:
            raise OSError("log disk full")

        return log


def test_racing_losses_still_print_the_one_warning(capsys: pytest.CaptureFixture[str]) -> None:
    # Thread A loses a record and is paused right after its first statement
    # in the error path; thread B loses one meanwhile. With a read-after-
    # increment both saw errors == 2 and nobody printed the warning.
    journal = Journal(_RaisingLogger())
    # By file and name, not code object: mutmut runs a renamed copy of _lost.
    journal_file = sys.modules[Journal.__module__].__file__
    b_may_run = threading.Event()
    b_done = threading.Event()

    def tracer(frame: Any, event: str, arg: object) -> Any:
        code = frame.f_code
        if code.co_filename != journal_file or "_lost" not in code.co_name:
            return None
        lines = [0]

        def local(frame: Any, event: str, arg: object) -> Any:
            if event == "line":
                lines[0] += 1
                if lines[0] == 2:  # after the first statement
                    b_may_run.set()
                    b_done.wait(0.5)  # B may be blocked behind us: do not wait forever
            return local

        return local

    def a() -> None:
        sys.settrace(tracer)
        try:
            journal.ignored("a", Event.COMPLETE, TransferState.DONE, 1, None)
        finally:
            sys.settrace(None)

    def b() -> None:
        assert b_may_run.wait(5)
        journal.ignored("b", Event.COMPLETE, TransferState.DONE, 1, None)
        b_done.set()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    err = capsys.readouterr().err
    assert journal.errors == 2
    assert err.count("kvguard: journal record for") == 1
    assert err.count("OSError: log disk full") == 1


def test_every_later_loss_is_only_counted(capsys: pytest.CaptureFixture[str]) -> None:
    journal = Journal(_RaisingLogger())
    rec = TransitionRecord(
        Event.START, TransferState.PENDING, TransferState.TRANSFERRING, 0.0, None, 1
    )
    for i in range(3):
        journal.transition(f"r{i}", rec)
    err = capsys.readouterr().err
    assert journal.errors == 3
    assert err.count("kvguard: journal record for 'r0' lost") == 1
    assert "'r1'" not in err and "'r2'" not in err


def test_failing_ignored_records_are_reported_with_their_request(
    capsys: pytest.CaptureFixture[str],
) -> None:
    journal = Journal(_RaisingLogger())
    journal.ignored("late-1", Event.COMPLETE, TransferState.DONE, 1, None)
    err = capsys.readouterr().err
    assert journal.errors == 1
    assert "kvguard: journal record for 'late-1' lost" in err
    assert "OSError: log disk full" in err


def test_a_new_journal_logs_through_the_kvguard_logger(all_levels: None) -> None:
    """A Journal built now (not the import-time default) uses LOGGER_NAME."""
    factory_args: list[tuple[object, ...]] = []
    old = structlog.get_config()

    def factory(*args: object) -> Any:
        factory_args.append(args)
        return structlog.testing.CapturingLogger()

    structlog.configure(logger_factory=factory, cache_logger_on_first_use=False)
    try:
        journal = Journal()
        lc = RequestLifecycle("named", journal=journal)
        lc.start()
        lc.fail(FailureReason.PEER_LOST)
    finally:
        structlog.configure(**old)
    assert journal.errors == 0
    assert factory_args == [(LOGGER_NAME,), (LOGGER_NAME,)]


class _CountingSink:
    """A PrintLogger-like sink that counts what reaches it."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def msg(self, message: str) -> None:
        self.lines.append(message)

    debug = info = warning = error = msg


def _filtering(level: int, sink: _CountingSink, *, cached: bool) -> dict[str, Any]:
    return {
        "wrapper_class": structlog.make_filtering_bound_logger(level),
        "processors": [structlog.processors.KeyValueRenderer(key_order=["event", "request_id"])],
        "logger_factory": lambda *_: sink,
        "cache_logger_on_first_use": cached,
    }


def test_a_cached_logger_skips_filtered_levels_and_keeps_the_rest() -> None:
    # The production configuration (structlog's cache_logger_on_first_use):
    # the journal resolves the cached logger once, drops debug records
    # without building them, and still writes retries and failures. (A
    # logger of its own: a global cached configuration would capture the
    # library's module-level loggers for the rest of the run.)
    sink = _CountingSink()
    cfg = _filtering(logging.INFO, sink, cached=True)
    journal = Journal(
        structlog.wrap_logger(
            sink,
            processors=cfg["processors"],
            wrapper_class=cfg["wrapper_class"],
            cache_logger_on_first_use=True,
        )
    )
    for i in range(3):
        lc = RequestLifecycle(f"c-{i}", max_attempts=2, journal=journal)
        lc.start()
        lc.retry()
        lc.start()
        lc.complete()
        lc.fail(FailureReason.TIMEOUT)  # ignored: a debug record
    RequestLifecycle("c-f", journal=journal).fail(FailureReason.SHUTDOWN)
    assert [line.split(" ")[:2] for line in sink.lines] == [
        *[["event='retry'", f"request_id='c-{i}'"] for i in range(3)],
        ["event='fail'", "request_id='c-f'"],
    ]
    assert journal.errors == 0
    assert journal._emitters["debug"] is None  # resolved once, and skipped whole

    def no_more(**_: object) -> object:
        raise AssertionError("the journal asked the proxy again")

    journal._logger.bind = no_more  # every later record comes from the cache
    lc = RequestLifecycle("c-late", journal=journal)
    lc.start()
    lc.fail(FailureReason.ABORTED)
    assert journal.errors == 0
    assert sink.lines[-1].split(" ")[:2] == ["event='fail'", "request_id='c-late'"]


def test_a_stdlib_backed_logger_follows_level_changes_at_run_time() -> None:
    # structlog's stdlib BoundLogger asks logging on every call: raising the
    # level of kvguard.lifecycle during an incident must take effect at once,
    # even though structlog cached the logger.
    std = logging.getLogger("kvguard.test.journal-stdlib")
    std.propagate = False
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(str(record.msg))  # type: ignore[method-assign]
    std.addHandler(handler)
    std.setLevel(logging.WARNING)
    journal = Journal(
        structlog.wrap_logger(
            std,
            processors=[structlog.processors.KeyValueRenderer(key_order=["event", "request_id"])],
            wrapper_class=structlog.stdlib.BoundLogger,
            cache_logger_on_first_use=True,
        )
    )
    try:
        RequestLifecycle("quiet", journal=journal).start()  # structlog caches its logger
        RequestLifecycle("quieter", journal=journal).start()  # the journal resolves it
        std.setLevel(logging.DEBUG)
        RequestLifecycle("loud", journal=journal).start()
    finally:
        std.removeHandler(handler)
    assert [r.split(" ")[:2] for r in records] == [["event='start'", "request_id='loud'"]]


def test_a_logger_not_yet_cached_follows_a_later_configuration() -> None:
    # Until structlog caches its logger, the journal resolves it per record:
    # a configuration installed after the Journal was made still applies.
    old = structlog.get_config()
    first, second = _CountingSink(), _CountingSink()
    structlog.configure(**_filtering(logging.DEBUG, first, cached=False))
    try:
        journal = Journal()
        RequestLifecycle("u-1", journal=journal).start()
        structlog.configure(**_filtering(logging.DEBUG, second, cached=False))
        RequestLifecycle("u-2", journal=journal).start()
    finally:
        structlog.configure(**old)
    assert [line.split(" ")[1] for line in first.lines] == ["request_id='u-1'"]
    assert [line.split(" ")[1] for line in second.lines] == ["request_id='u-2'"]
    assert journal._emitters == {}  # nothing cached: the proxy is asked every time
