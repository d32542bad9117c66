"""The transition table: shape, import-time validation, agreement with a real
``transitions.Machine`` built from the same TRANSITIONS, and the generated
diagram (``kvguard diagram --check``)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transitions import Machine, MachineError
from transitions.extensions import GraphMachine

import lifecycle
from kvguard.cli import diagram_document
from lifecycle import (
    DISPATCH,
    GUARDS,
    INITIAL,
    REFERENCE_MACHINE,
    TERMINAL,
    TRANSITIONS,
    Event,
    FailureReason,
    Guard,
    InvalidTransition,
    RequestLifecycle,
    TransferState,
    Transition,
    _table,
    render_markdown,
    render_mermaid,
)

S = TransferState
ROOT = Path(__file__).resolve().parents[1]
DIAGRAM = ROOT / "docs" / "state-diagram.md"


# -- shape of the table ----------------------------------------------------------------


def test_public_enums() -> None:
    assert [s.name for s in TransferState] == ["PENDING", "TRANSFERRING", "DONE", "FAILED"]
    required = {
        "TRANSFER_ERROR",
        "PEER_LOST",
        "TIMEOUT",
        "ABORTED",
        "WORKER_CRASHED",
        "WORKER_EXITED",
        "WORKER_DROPPED",
        "INVALID_REQUEST",
        "SHUTDOWN",
    }
    assert required <= {r.name for r in FailureReason}
    assert {e.value for e in Event} == {"start", "complete", "retry", "fail"}
    assert INITIAL is S.PENDING
    assert frozenset({S.DONE, S.FAILED}) == TERMINAL


def test_dispatch_is_exactly_the_contract() -> None:
    assert dict(DISPATCH) == {
        (S.PENDING, Event.START): (S.TRANSFERRING, None),
        (S.TRANSFERRING, Event.COMPLETE): (S.DONE, None),
        (S.TRANSFERRING, Event.RETRY): (S.PENDING, "attempts_left"),
        (S.PENDING, Event.FAIL): (S.FAILED, None),
        (S.TRANSFERRING, Event.FAIL): (S.FAILED, None),
    }
    assert set(GUARDS) == {"attempts_left"}


def test_dispatch_equals_transitions_tuple() -> None:
    from_tuple = {(t.source, t.event): (t.dest, t.guard) for t in TRANSITIONS}
    assert len(from_tuple) == len(TRANSITIONS)  # no duplicate (state, event)
    assert dict(DISPATCH) == from_tuple
    assert all(t.guard is None or t.guard in GUARDS for t in TRANSITIONS)


def test_terminal_states_have_no_outgoing_edge() -> None:
    for state in TERMINAL:
        assert [k for k in DISPATCH if k[0] is state] == []
        assert [t for t in TRANSITIONS if t.source is state] == []
        for name, ev in REFERENCE_MACHINE.events.items():
            assert state.name not in ev.transitions, (state, name)


def test_every_non_terminal_state_reaches_a_terminal_one() -> None:
    for state in set(TransferState) - TERMINAL:
        seen = {state}
        queue = deque([state])
        while queue:
            cur = queue.popleft()
            for (src, _), (dst, _) in DISPATCH.items():
                if src is cur and dst not in seen:
                    seen.add(dst)
                    queue.append(dst)
        assert seen & TERMINAL, f"{state.name} cannot reach a terminal state"
        # Without a guard: fail is always available from a non-terminal state.
        assert DISPATCH[(state, Event.FAIL)] == (S.FAILED, None)


def test_every_state_is_reachable_from_the_initial_state() -> None:
    seen = {INITIAL}
    changed = True
    while changed:
        changed = False
        for (src, _), (dst, _) in DISPATCH.items():
            if src in seen and dst not in seen:
                seen.add(dst)
                changed = True
    assert seen == set(TransferState)


def test_dispatch_equals_reference_machine() -> None:
    walked: dict[tuple[TransferState, Event], tuple[TransferState, str | None]] = {}
    for name, ev in REFERENCE_MACHINE.events.items():
        for source, edges in ev.transitions.items():
            assert len(edges) == 1
            (edge,) = edges
            conds = [str(c.func) for c in edge.conditions]
            assert all(c.target for c in edge.conditions)
            walked[(TransferState[source], Event(name))] = (
                TransferState[str(edge.dest)],
                conds[0] if conds else None,
            )
    assert walked == dict(DISPATCH)
    assert set(REFERENCE_MACHINE.states) == {s.name for s in TransferState}
    assert REFERENCE_MACHINE.initial == INITIAL.name
    assert REFERENCE_MACHINE.models == []  # no per-request strong references


# -- import-time validation catches bad tables ---------------------------------------------


def test_validate_rejects_an_edge_out_of_a_terminal_state(monkeypatch: Any) -> None:
    bad = dict(DISPATCH)
    bad[(S.DONE, Event.RETRY)] = (S.PENDING, None)
    monkeypatch.setattr(_table, "DISPATCH", bad)
    with pytest.raises(AssertionError, match="terminal state DONE has an outgoing 'retry'"):
        _table._validate()


def test_validate_rejects_a_stranded_state(monkeypatch: Any) -> None:
    # TRANSFERRING can only go back to PENDING, PENDING only forward: a cycle
    # with no way out.
    bad = {
        (S.PENDING, Event.START): (S.TRANSFERRING, None),
        (S.TRANSFERRING, Event.RETRY): (S.PENDING, None),
    }
    monkeypatch.setattr(_table, "DISPATCH", bad)
    with pytest.raises(AssertionError, match=r"cannot reach a terminal state.*PENDING"):
        _table._validate()


def test_validate_accepts_the_real_table() -> None:
    _table._validate()


def test_compile_rejects_ambiguous_transitions_and_unknown_guards() -> None:
    fail = Transition(Event.FAIL, S.PENDING, S.FAILED)
    with pytest.raises(AssertionError, match=r"ambiguous transition \(<TransferState.PENDING"):
        _table._compile([fail, fail._replace(dest=S.DONE)])
    unknown = Transition(Event.RETRY, S.TRANSFERRING, S.PENDING, guard="x")
    with pytest.raises(AssertionError, match="unknown guard 'x' on 'retry'"):
        _table._compile([unknown])
    assert _table._compile(TRANSITIONS) == dict(DISPATCH)


# -- guards: each edge is checked by exactly its own predicate --------------------------------


def test_the_attempts_guard_rule() -> None:
    allows = GUARDS["attempts_left"].allows
    assert [allows(a, 2) for a in range(4)] == [True, True, False, False]
    assert GUARDS["attempts_left"].text == "attempt < max_attempts"


@pytest.mark.parametrize("verdict", [True, False])
def test_a_new_guard_gets_its_own_rule_not_the_attempts_rule(
    monkeypatch: Any, verdict: bool
) -> None:
    # Before, _fire hard-coded the attempts rule for any guard: a second
    # guard would silently have been "attempt < max_attempts".
    import lifecycle._lifecycle as lc_mod

    seen: list[tuple[int, int]] = []

    def rule(attempt: int, max_attempts: int) -> bool:
        seen.append((attempt, max_attempts))
        return verdict

    guards = {**GUARDS, "custom": Guard(rule, "custom rule")}
    dispatch = {**DISPATCH, (S.PENDING, Event.COMPLETE): (S.DONE, "custom")}
    monkeypatch.setattr(lc_mod, "GUARDS", guards)
    monkeypatch.setattr(lc_mod, "DISPATCH", dispatch)
    lc = RequestLifecycle("g", max_attempts=3)  # the attempts rule would allow it
    if verdict:
        assert lc.complete() is True
        assert (lc.state, lc.reason, lc.error) == (S.DONE, None, None)
    else:
        with pytest.raises(InvalidTransition, match=r"guard custom \(custom rule\) is false"):
            lc.complete()
        assert (lc.state, lc.reason, lc.error) == (S.PENDING, None, None)
    assert seen == [(0, 3)]


# -- DISPATCH behaves like a real transitions model --------------------------------------------


class _Model:
    """A fresh model for a new Machine: just the fields the guard reads."""

    def __init__(self, max_attempts: int) -> None:
        self.max_attempts = max_attempts
        self.attempt = 0
        self.state: str = ""

    def attempts_left(self) -> bool:  # the guard named in TRANSITIONS
        return self.attempt < self.max_attempts

    def count_attempt(self) -> None:
        self.attempt += 1


def _fresh_machine(model: _Model) -> Machine:
    """A NEW Machine built from TRANSITIONS, not the library's own machine."""
    return Machine(
        model=model,
        states=[s.name for s in TransferState],
        initial=INITIAL.name,
        transitions=[
            {
                "trigger": t.event.value,
                "source": t.source.name,
                "dest": t.dest.name,
                **({"conditions": t.guard} if t.guard else {}),
                **({"after": "count_attempt"} if t.event is Event.START else {}),
            }
            for t in TRANSITIONS
        ],
        auto_transitions=False,
        ignore_invalid_triggers=False,
    )


EVENTS = st.sampled_from(list(Event))


@settings(max_examples=300)
@given(max_attempts=st.integers(1, 4), events=st.lists(EVENTS, max_size=20))
def test_lifecycle_matches_a_transitions_model(max_attempts: int, events: list[Event]) -> None:
    model = _Model(max_attempts)
    _fresh_machine(model)
    lc = RequestLifecycle("prop", max_attempts=max_attempts)
    assert lc.state.name == model.state
    for event in events:
        before = (lc.state, lc.attempt, len(lc.history))
        was_terminal = model.state in {s.name for s in TERMINAL}
        try:
            ref: bool | None = bool(model.trigger(event.value))  # type: ignore[attr-defined]
        except MachineError:
            ref = None  # no edge from this state
        try:
            got: bool | None = (
                lc.fail(FailureReason.TRANSFER_ERROR)
                if event is Event.FAIL
                else getattr(lc, event.value)()
            )
        except InvalidTransition:
            got = None
        if was_terminal:
            # transitions has no edge out of DONE/FAILED (it raises);
            # the lifecycle absorbs the event instead (I1).
            assert ref is None
            assert got is False
        elif ref is False:
            # The attempts guard refused: the lifecycle raises for that.
            assert event is Event.RETRY
            assert got is None
        else:
            assert got == ref, (event, before)
        if got is not True:
            assert (lc.state, lc.attempt, len(lc.history)) == before
        assert lc.state.name == model.state
        assert lc.attempt == model.attempt <= max_attempts


# -- diagram ----------------------------------------------------------------------------------


def test_committed_diagram_matches_the_table() -> None:
    assert DIAGRAM.read_text() == diagram_document()
    assert diagram_document().startswith(render_markdown())  # the lifecycle, then the hand-off


def test_mermaid_marks_initial_terminal_and_every_edge() -> None:
    text = render_mermaid()
    lines = text.splitlines()
    assert lines[:4] == ["---", "title: Request lifecycle", "---", "stateDiagram-v2"]
    assert text.endswith("  FAILED --> [*]\n")
    assert "  [*] --> PENDING" in lines
    assert "  DONE --> [*]" in lines
    assert "  FAILED --> [*]" in lines
    assert "  PENDING --> [*]" not in lines and "  TRANSFERRING --> [*]" not in lines
    for t in TRANSITIONS:
        label = f"{t.event.value} [{t.guard}]" if t.guard else t.event.value
        assert f"  {t.source.name} --> {t.dest.name}: {label}" in lines
    edges = [ln for ln in lines if "-->" in ln and "[*]" not in ln]
    assert len(edges) == len(TRANSITIONS)
    for state in TransferState:  # drawn by transitions, none styled active
        assert f'  state "{state.name}" as {state.name}' in lines
        assert f"  Class {state.name} s_default" in lines
    assert all(ln == ln.rstrip() for ln in lines)
    assert not any(": " in ln and "(" in ln for ln in lines)  # no counts


def test_markdown_table_lists_every_transition_with_its_guard() -> None:
    text = render_markdown()
    assert "```mermaid\n" + render_mermaid() + "```" in text
    assert "| TRANSFERRING | `retry` | `attempt < max_attempts` | PENDING |" in text
    assert "| PENDING | `start` | - | TRANSFERRING |" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and "`" in ln]
    assert len(rows) == len(TRANSITIONS)


def test_mermaid_counts_label_edges_and_terminals() -> None:
    counts = {(S.PENDING, Event.START, S.TRANSFERRING): 7}
    text = render_mermaid(counts, {S.DONE: 5})
    lines = text.splitlines()
    assert "  PENDING --> TRANSFERRING: start (7)" in lines
    assert "  TRANSFERRING --> DONE: complete (0)" in lines
    assert "  TRANSFERRING --> PENDING: retry [attempts_left] (0)" in lines
    assert lines[-4:] == [
        "  DONE: DONE (5)",
        "  DONE --> [*]",
        "  FAILED: FAILED (0)",
        "  FAILED --> [*]",
    ]
    assert "PENDING: PENDING" not in text and "TRANSFERRING: TRANSFERRING" not in text
    # Edge counts alone, or terminal counts alone.
    only_edges = render_mermaid(counts)
    assert "  PENDING --> TRANSFERRING: start (7)" in only_edges
    assert "DONE: DONE" not in only_edges
    only_terminals = render_mermaid(None, {S.FAILED: 2}).splitlines()
    assert "  FAILED: FAILED (2)" in only_terminals
    assert "  DONE: DONE (0)" in only_terminals
    assert "  PENDING --> TRANSFERRING: start" in only_terminals


def test_diagram_check_fails_on_stale_file_and_passes_after_regenerating(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvguard import cli  # imported here: the CLI pulls in the whole scheduler

    out = tmp_path / "docs" / "state-diagram.md"
    assert cli.main(["diagram", "--check", "--output", str(out)]) == 1  # missing
    assert "stale" in capsys.readouterr().err
    out.parent.mkdir(parents=True)
    out.write_text(diagram_document().replace("retry", "retry-old"))
    assert cli.main(["diagram", "--check", "--output", str(out)]) == 1
    err = capsys.readouterr().err
    assert str(out) in err and "stale" in err and "kvguard diagram" in err
    assert cli.main(["diagram", "--output", str(out)]) == 0
    assert out.read_text() == diagram_document()
    assert cli.main(["diagram", "--check", "--output", str(out)]) == 0
    assert "up to date" in capsys.readouterr().out


def test_kvguard_console_script_check(tmp_path: Path) -> None:
    # The real console script (two interpreter launches: the CLI imports the
    # whole scheduler, so keep this to the minimum).
    exe = shutil.which("kvguard")
    cmd = [exe] if exe else [sys.executable, "-m", "kvguard.cli"]
    out = tmp_path / "diagram.md"
    out.write_text(diagram_document().replace("FAILED", "FAILD"))
    stale = subprocess.run(
        [*cmd, "diagram", "--check", "--output", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert stale.returncode == 1
    assert f"{out} is stale" in stale.stderr
    assert "Run `kvguard diagram`" in stale.stderr
    out.write_text(diagram_document())  # what `kvguard diagram --output` writes (tested above)
    fresh = subprocess.run(
        [*cmd, "diagram", "--check", "--output", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert fresh.returncode == 0, fresh.stderr
    assert "up to date" in fresh.stdout


def test_public_names_are_exported() -> None:
    for name in (
        "TransferState",
        "FailureReason",
        "RequestLifecycle",
        "CompletionGuard",
        "InvalidTransition",
        "Outcome",
        "Guard",
    ):
        assert name in lifecycle.__all__
        assert hasattr(lifecycle, name)


_NO_GRAPHVIZ = """
import sys
sys.modules["graphviz"] = None  # any import of it now fails
sys.modules["pygraphviz"] = None
from lifecycle import render_markdown
sys.stdout.write(render_markdown())
"""


def test_the_mermaid_diagram_needs_nothing_beyond_transitions() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _NO_GRAPHVIZ], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == render_markdown()
    assert proc.stderr == ""


def test_the_reference_machine_is_a_mermaid_graph_machine() -> None:
    assert isinstance(REFERENCE_MACHINE, GraphMachine)
    assert REFERENCE_MACHINE.show_conditions is True
    assert REFERENCE_MACHINE.graph_cls.__module__ == "transitions.extensions.diagrams_mermaid"


def test_building_the_reference_machine_gives_exactly_the_table(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # REFERENCE_MACHINE is built at import; build a fresh one to check how.
    with caplog.at_level(logging.DEBUG, logger="transitions"):
        machine = _table._build_reference_machine()
    # Asked for mermaid directly: no failed Graphviz import, no fallback warning.
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert isinstance(machine, GraphMachine)
    assert list(machine.states) == [s.name for s in TransferState]
    assert machine.initial == INITIAL.name
    assert machine.models == []
    assert machine.auto_transitions is False
    assert machine.ignore_invalid_triggers is False
    assert machine.show_conditions is True
    assert machine.title == "title: Request lifecycle"
    assert machine.graph_cls.__module__ == "transitions.extensions.diagrams_mermaid"
    assert set(machine.events) == {e.value for e in Event}
    edges = {
        (
            TransferState[src],
            Event(name),
            TransferState[str(t.dest)],
            tuple(str(c.func) for c in t.conditions),
        )
        for name, ev in machine.events.items()
        for src, ts in ev.transitions.items()
        for t in ts
    }
    assert edges == {
        (t.source, t.event, t.dest, (t.guard,) if t.guard else ()) for t in TRANSITIONS
    }
    assert all(
        c.target
        for ev in machine.events.values()
        for ts in ev.transitions.values()
        for t in ts
        for c in t.conditions
    )


def test_validate_follows_paths_of_any_length(monkeypatch: Any) -> None:
    # Listed source-first, each state reaches FAILED only through the next
    # one: a single backward pass would strand all but the last.
    chain = {
        (S.PENDING, Event.START): (S.TRANSFERRING, None),
        (S.TRANSFERRING, Event.COMPLETE): (S.DONE, None),
    }
    monkeypatch.setattr(_table, "DISPATCH", chain)
    _table._validate()
    del chain[(S.TRANSFERRING, Event.COMPLETE)]
    with pytest.raises(
        AssertionError,
        match=r"^states that cannot reach a terminal state: \['PENDING', 'TRANSFERRING'\]$",
    ):
        _table._validate()
