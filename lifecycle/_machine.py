"""A state machine as a table: its edges, its one setter, its checks, its drawing.

The request lifecycle has its own table (``_table``) because its hot path
dispatches on (state, event). The smaller machines above it -- the
scheduler's phase, the prefill's hold, the decode's load and its link to a
prefill -- only need what h11's ``_state.py`` gives each of its machines:
a plain table of which state may follow which (and on what event, for the
docs), one function that changes a state and refuses anything else with a
precise message, and a check at import that terminal states are absorbing
and every state can end. ``StateTable`` is that, once for all of them;
``render_mermaid`` draws any of them with ``transitions``' own mermaid
drawing, as ``_diagram`` draws the lifecycle.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from transitions.extensions import GraphMachine
from transitions.extensions.diagrams_mermaid import Graph

__all__ = ["Edge", "StateTable", "Stateful", "TableError"]

S = TypeVar("S", bound=enum.Enum)


class TableError(RuntimeError):
    """A state change the table does not allow: a bug in the code that owns
    the machine (never bad input: that is refused before any change)."""


class Edge(NamedTuple, Generic[S]):
    source: S
    event: str  # what makes the change, as the docs name it
    dest: S


class Stateful(Protocol[S]):
    """What ``StateTable.move`` changes: an object with a ``state``."""

    state: S


class StateTable(Generic[S]):
    """One machine: every state, every allowed edge, where it starts and ends.

    Built once at import; the constructor checks the table (every member is a
    state of it, terminal states have no way out, every state is reachable
    from ``initial`` and can reach a terminal one) and raises TableError
    naming what is wrong, so a bad edit fails at import, not in production.
    """

    __slots__ = ("_next", "edges", "initial", "name", "states", "terminal", "title")

    name: str  # short, for messages and docs anchors
    title: str  # the docs heading
    states: type[S]
    edges: tuple[Edge[S], ...]  # the whole machine; the docs' table row by row
    initial: S
    terminal: frozenset[S]  # absorbing: no edge leaves them
    _next: Mapping[S, frozenset[S]]  # derived from edges: the setter's lookup

    def __init__(
        self,
        name: str,
        title: str,
        states: type[S],
        edges: Iterable[Edge[S]],
        initial: S,
        terminal: Iterable[S],
    ) -> None:
        self.name, self.title, self.states = name, title, states
        self.edges = tuple(edges)
        self.initial = initial
        self.terminal = frozenset(terminal)
        nxt: dict[S, set[S]] = {s: set() for s in states}
        for e in self.edges:
            nxt[e.source].add(e.dest)
        self._next = {s: frozenset(d) for s, d in nxt.items()}
        self._check()

    def _check(self) -> None:
        for e in self.edges:
            if e.source in self.terminal:
                raise TableError(f"{self.name}: terminal state {e.source.name} has an edge out")
        if not self.terminal:
            raise TableError(f"{self.name}: no terminal state")
        seen = {self.initial}
        frontier = [self.initial]
        while frontier:
            for d in self._next[frontier.pop()] - seen:
                seen.add(d)
                frontier.append(d)
        unreachable = set(self.states) - seen
        if unreachable:
            names = sorted(s.name for s in unreachable)
            raise TableError(f"{self.name}: unreachable from {self.initial.name}: {names}")
        ends = set(self.terminal)
        for _ in self.states:
            ends |= {s for s, d in self._next.items() if d & ends}
        stranded = set(self.states) - ends
        if stranded:
            names = sorted(s.name for s in stranded)
            raise TableError(f"{self.name}: cannot reach a terminal state: {names}")

    def allows(self, source: S, dest: S) -> bool:
        return dest in self._next[source]

    def move(self, obj: Stateful[S], dest: S, what: object = "") -> None:
        """Change ``obj.state`` to ``dest`` along the table; else raise
        TableError naming ``what`` and both states, the state unchanged."""
        source = obj.state
        if dest not in self._next[source]:
            raise TableError(f"{self.name} {what!s}: cannot go from {source.name} to {dest.name}")
        obj.state = dest

    def render_mermaid(self) -> str:
        """A mermaid stateDiagram-v2, drawn by ``transitions``; [*] marks the
        initial and terminal states."""
        # No model: the machine is never triggered, it only draws.
        machine = GraphMachine(
            model=None,
            states=[s.name for s in self.states],
            transitions=[
                {"trigger": e.event, "source": e.source.name, "dest": e.dest.name}
                for e in self.edges
            ],
            initial=self.initial.name,
            graph_engine="mermaid",
            title=f"title: {self.title}",  # mermaid front matter
            auto_transitions=False,
        )
        graph: Any = Graph(machine).get_graph()  # type: ignore[arg-type]  # stub wants the class
        lines = [line.rstrip() for line in graph.source.splitlines()]
        lines += [f"  {s.name} --> [*]" for s in self.states if s in self.terminal]
        return "\n".join(lines) + "\n"

    def render_markdown(self, module: str) -> str:
        """A docs section: the drawing and the table, generated from ``edges``."""
        rows = "\n".join(f"| {e.source.name} | `{e.event}` | {e.dest.name} |" for e in self.edges)
        terminal = ", ".join(s.name for s in self.states if s in self.terminal)
        return f"""## {self.title}

From `{module}`. Initial state: {self.initial.name}. Terminal and absorbing:
{terminal}. Any change not listed below raises `TableError`.

```mermaid
{self.render_mermaid().rstrip()}
```

| state | event | destination |
|---|---|---|
{rows}
"""
