"""The core's phase machine: its edge table, its one setter, and the core against both.

``scheduler._phase.EDGES`` says which phase may follow which. The table is
walked whole (every listed edge is taken, every other pair is refused with
both phases named), its shape is checked (everything reachable, one way to
end, no dead end), ``move`` is the only code that writes a phase, and a
scripted run of the real core takes every edge of the table and no other.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Callable
from pathlib import Path

import pytest

from lifecycle import FailureReason, TransferState
from scheduler import _core
from scheduler._core import SchedulerCore
from scheduler._phase import EDGES, ENDABLE, LIVE, Phase, Phased, PhaseError, move
from scheduler._records import RetryPolicy
from transfer import (
    Batch,
    EngineError,
    KVLayout,
    PeerInfo,
    Region,
    TransferBackend,
    TransferOp,
    TransferPlan,
)

SCHEDULER = Path(__file__).resolve().parents[1] / "scheduler"
PAIRS = [(old, new) for old in Phase for new in Phase]
LISTED = [(old, new) for old, nxt in EDGES.items() for new in nxt]


class Rec:
    """Just what ``move`` reads and writes."""

    def __init__(self, phase: Phase) -> None:
        self.request_id = "r1"
        self.phase = phase


def test_the_table_has_a_row_for_every_phase_and_lists_eight_edges() -> None:
    assert list(EDGES) == list(Phase)
    assert sorted((o.name, n.name) for o, n in LISTED) == [
        ("BACKOFF", "FINISHED"),
        ("BACKOFF", "RUNNING"),
        ("FINISHED", "RELEASING"),
        ("NEW", "QUEUED"),
        ("QUEUED", "FINISHED"),
        ("QUEUED", "RUNNING"),
        ("RUNNING", "BACKOFF"),
        ("RUNNING", "FINISHED"),
    ]


@pytest.mark.parametrize(("old", "new"), LISTED, ids=lambda p: p.name)
def test_every_listed_edge_is_taken(old: Phase, new: Phase) -> None:
    rec = Rec(old)
    move(rec, new)
    assert rec.phase is new


@pytest.mark.parametrize(
    ("old", "new"), [p for p in PAIRS if p not in LISTED], ids=lambda p: p.name
)
def test_every_other_pair_raises_naming_both_phases_and_changes_nothing(
    old: Phase, new: Phase
) -> None:
    rec = Rec(old)
    with pytest.raises(PhaseError) as info:
        move(rec, new)
    assert str(info.value) == f"request 'r1' cannot go from phase {old.name} to {new.name}"
    assert type(info.value) is PhaseError and isinstance(info.value, RuntimeError)
    assert rec.phase is old


def test_the_refused_pairs_are_all_the_others() -> None:
    refused = 0
    for old, new in PAIRS:
        try:
            move(Rec(old), new)
        except PhaseError:
            refused += 1
    assert (refused, len(LISTED)) == (36 - 8, 8)  # self-changes included: none is an edge


def _reachable(start: Phase) -> set[Phase]:
    seen, todo = {start}, deque([start])
    while todo:
        for nxt in EDGES[todo.popleft()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_every_phase_is_reachable_from_new() -> None:
    assert _reachable(Phase.NEW) == set(Phase)


def test_releasing_is_the_only_terminal_phase_and_every_phase_reaches_it() -> None:
    assert [p for p in Phase if not EDGES[p]] == [Phase.RELEASING]
    for phase in Phase:
        assert Phase.RELEASING in _reachable(phase), phase.name
    for new in Phase:
        with pytest.raises(PhaseError, match=f"from phase RELEASING to {new.name}$"):
            move(Rec(Phase.RELEASING), new)


def test_the_derived_sets_follow_the_table() -> None:
    assert {Phase.QUEUED, Phase.RUNNING, Phase.BACKOFF} == ENDABLE
    assert {Phase.NEW, Phase.QUEUED, Phase.RUNNING, Phase.BACKOFF} == LIVE


def _phase_writes_and_move_calls() -> tuple[list[str], list[str]]:
    """Where scheduler/ assigns ``.phase`` and calls ``move``: "module:function"."""
    writes, calls = [], []
    for path in sorted(SCHEDULER.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue
            where = f"{path.stem}:{getattr(fn, 'name', 'lambda')}"
            for node in ast.walk(fn):
                targets: list[ast.expr] = []
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                    targets = [node.target]
                for t in targets:
                    for sub in ast.walk(t):
                        if isinstance(sub, ast.Attribute) and sub.attr == "phase":
                            writes.append(where)
                if isinstance(node, ast.Call) and (
                    (isinstance(node.func, ast.Name) and node.func.id == "move")
                    or (isinstance(node.func, ast.Attribute) and node.func.attr == "move")
                ):
                    calls.append(where)
    return writes, calls


def test_only_move_changes_a_phase_and_only_the_core_calls_it() -> None:
    writes, calls = _phase_writes_and_move_calls()
    # The record's first phase (NEW), then every change through the one setter.
    assert sorted(writes) == ["_phase:move", "_requests:__init__"]
    assert calls and {c.split(":")[0] for c in calls} == {"_core"}, calls


# -- the real core takes every edge, and only edges ---------------------------------------

LAYOUT = KVLayout(num_layers=1, num_blocks=8, block_bytes=8)


class HeldBackend(TransferBackend):
    """Every op waits until the test resolves and quiesces it."""

    name = "held"

    def __init__(self) -> None:
        self.ops: dict[str, list[TransferOp]] = {}
        self.owner: dict[int, str] = {}

    def submit(self, plan: TransferPlan) -> TransferOp:
        op = TransferOp(plan)
        self.ops.setdefault(self.owner[id(plan)], []).append(op)
        return op

    def probe(self, peer: str) -> None:
        pass

    def close(self) -> None:
        pass


def run_now(fn: Callable[[], object]) -> None:
    fn()


def test_the_core_takes_every_edge_of_the_table_and_no_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    taken: list[tuple[str, Phase, Phase]] = []

    def recording_move(req: Phased, new: Phase) -> None:
        taken.append((req.request_id, req.phase, new))
        move(req, new)

    monkeypatch.setattr(_core, "move", recording_move)
    backend = HeldBackend()
    retry = RetryPolicy(max_attempts=3, backoff_s=1.0, backoff_factor=1.0, backoff_max_s=1.0)
    core = SchedulerCore(
        backend,
        max_in_flight=1,
        retry=retry,
        probe_interval_s=100.0,
        peer_lost_after_probes=1,
        journal=None,
        defer=run_now,
    )
    info = PeerInfo("p0", (Region(0x1000, 4096),), LAYOUT)
    core.add_peer(info)
    reqs = {}
    for rid in ("a", "b", "c"):
        plan = TransferPlan("p0", (Batch((0x10,), (0x1000,), (8,)),), 8, 1)
        backend.owner[id(plan)] = rid
        reqs[rid] = core.new_request(rid, plan, 0.0, 60.0, 0, None)
        core.accept(reqs[rid], info)
    released: list[str] = []

    def step(now: float) -> None:
        released.extend(r.request_id for r in core.step(now).releases)

    step(0.0)  # a runs; b and c wait for the one slot
    reqs["b"].lc.fail(FailureReason.ABORTED)  # b ends in the queue, with no op: released at once
    step(0.0)
    backend.ops["a"][0]._resolve(EngineError("engine -1", peer="p0", code=-1))
    backend.ops["a"][0]._quiesce()
    step(0.0)  # a backs off ...
    step(1.0)  # ... and retries
    backend.ops["a"][1]._resolve(None)  # done, but not quiesced: held
    step(1.0)  # c is admitted in a's slot
    backend.ops["a"][1]._quiesce()
    backend.ops["c"][0]._resolve(EngineError("engine -1", peer="p0", code=-1))
    step(1.0)  # a is released; c backs off
    reqs["c"].lc.fail(FailureReason.ABORTED)  # c ends while backing off
    step(1.5)

    P = Phase
    assert [(rid, o.name, n.name) for rid, o, n in taken] == [
        ("a", "NEW", "QUEUED"),  # the inbox first, in arrival order; then admission
        ("b", "NEW", "QUEUED"),
        ("c", "NEW", "QUEUED"),
        ("a", "QUEUED", "RUNNING"),
        ("b", "QUEUED", "FINISHED"),
        ("b", "FINISHED", "RELEASING"),
        ("a", "RUNNING", "BACKOFF"),
        ("a", "BACKOFF", "RUNNING"),
        ("a", "RUNNING", "FINISHED"),
        ("c", "QUEUED", "RUNNING"),
        ("a", "FINISHED", "RELEASING"),
        ("c", "RUNNING", "BACKOFF"),
        ("c", "BACKOFF", "FINISHED"),
    ]
    assert {(o, n) for _, o, n in taken} == set(LISTED)
    assert [(r.lc.state, r.lc.reason, r.phase) for r in reqs.values()] == [
        (TransferState.DONE, None, P.RELEASING),
        (TransferState.FAILED, FailureReason.ABORTED, P.RELEASING),
        # c's op never quiesced: it stays held, never released before then.
        (TransferState.FAILED, FailureReason.ABORTED, P.FINISHED),
    ]
    assert released == ["b", "a"]
