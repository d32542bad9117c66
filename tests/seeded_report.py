"""Print how the state machine's search finds each seeded bug of the core.

``python -m tests.seeded_report`` (from the repository root) runs the search of
``tests/test_scheduler_core.py`` on each of its seeds, once per seeded bug and
once on the clean core, and prints per line: the runs out of 10 whose search
failed the bug's own invariant check, which check that was, the median (and
maximum) number of examples to the catch, the median rule step within that
example, and the examples run in all. Settings are the search's own, not a
pytest profile's, so the table is the one the tests assert on.
"""

from __future__ import annotations

import structlog
from _pytest.monkeypatch import MonkeyPatch

from tests.test_scheduler_core import SEARCH_EXAMPLES, SEEDED_BUGS, SEEDS, report_line, search


def main() -> None:
    # The rules make callbacks raise on purpose; their logged tracebacks are noise.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(50))
    print(f"seeds {SEEDS.start}-{SEEDS.stop - 1}, at most {SEARCH_EXAMPLES} examples each")
    for name, bug in SEEDED_BUGS.items():
        with MonkeyPatch.context() as mp:
            bug.plant(mp)
            print(report_line(f"{name} ({bug.invariant})", [search(n) for n in SEEDS]))
    print(report_line("clean core (control)", [search(n) for n in SEEDS]))


if __name__ == "__main__":
    main()
