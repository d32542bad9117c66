"""The per-scenario table the server-mode tests print (``-s``) and write beside the logs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tests.vllm.client import Outcome

__all__ = ["TABLE_HEADER", "Row"]


@dataclass
class Row:
    """One scenario's figures for the closing note."""

    scenario: str
    requests: int = 0
    ok_equal: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    max_s: float = 0.0
    decode_idle: str = "-"
    note: str = ""

    def add(self, outcomes: Iterable[Outcome], want: Iterable[Sequence[int]]) -> None:
        """Count ``outcomes`` against the expected tokens of each (every choice must equal)."""
        for got, tokens in zip(outcomes, want, strict=True):
            self.requests += 1
            self.max_s = max(self.max_s, got.seconds)
            if got.kind == "ok" and all(list(c) == list(tokens) for c in got.choices):
                self.ok_equal += 1
            elif got.kind == "ok":
                self.errors["wrong tokens"] += 1
            else:
                self.errors[got.kind] += 1

    def line(self) -> str:
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(self.errors.items())) or "-"
        return (
            f"| {self.scenario} | {self.requests} | {self.ok_equal} | {errors} "
            f"| {self.max_s:.2f} | {self.decode_idle} | {self.note} |"
        )


TABLE_HEADER = (
    "| scenario | requests | ok and equal | errors by kind | max s to outcome "
    "| servers idle after | note |\n|---|---|---|---|---|---|---|"
)
