"""The skip policy (``--strict-skips``, tests/skip_policy.py) and real-engine skips in CI.

Each case runs pytest in a child on a small test file with the policy loaded
as a plugin, and reads the child's exit status and summary.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from skip_policy import ALLOWED

TESTS = Path(__file__).parent
_PYTEST = (
    sys.executable,
    "-m",
    "pytest",
    "-q",
    "-ra",
    "-p",
    "no:cacheprovider",
    "-p",
    "skip_policy",
)


def _pytest(
    where: Path, source: str, *args: str, env: dict[str, str] | None = None
) -> tuple[int, str]:
    (where / "test_case.py").write_text(source)
    done = subprocess.run(
        [*_PYTEST, *args, "test_case.py"],
        cwd=where,
        env={**os.environ, "PYTHONPATH": str(TESTS), **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, done.stdout + done.stderr


SKIPS_FOR_A_MISSING_TOOL = """
import pytest

def test_runs():
    pass

def test_needs_a_tool():
    pytest.skip("the tool is not installed")
"""


def test_a_skip_not_on_the_list_fails_the_session(tmp_path: Path) -> None:
    rc, out = _pytest(tmp_path, SKIPS_FOR_A_MISSING_TOOL, "--strict-skips")
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert "test_case.py::test_needs_a_tool: the tool is not installed" in out, out
    assert "1 passed, 1 skipped" in out, out


def test_without_the_option_a_skip_is_only_reported(tmp_path: Path) -> None:
    rc, out = _pytest(tmp_path, SKIPS_FOR_A_MISSING_TOOL)
    assert rc == pytest.ExitCode.OK, out
    assert "SKIPPED [1] test_case.py:8: the tool is not installed" in out, out


def test_a_module_skipped_at_collection_fails_the_session(tmp_path: Path) -> None:
    source = 'import pytest\n\npytest.importorskip("kvguard_no_such_module")\n\n'
    source += "def test_never_collected():\n    pass\n"
    rc, out = _pytest(tmp_path, source, "--strict-skips")
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert "test_case.py: could not import 'kvguard_no_such_module'" in out, out


def test_an_allowed_skip_passes_only_where_its_condition_holds(tmp_path: Path) -> None:
    source = 'import pytest\n\n@pytest.mark.skipif(True, reason="needs CUDA")\n'
    source += "def test_cuda():\n    pass\n\ndef test_cpu():\n    pass\n"
    rc, out = _pytest(tmp_path, source, "--strict-skips")
    expected = pytest.ExitCode.TESTS_FAILED if torch.cuda.is_available() else pytest.ExitCode.OK
    assert rc == expected, out
    assert "1 passed, 1 skipped" in out, out


XFAILS_FOR_A_KNOWN_BUG = """
import pytest

def test_runs():
    pass

@pytest.mark.xfail(reason="known bug", strict=True)
def test_known_bug():
    assert False

def test_known_at_run_time():
    pytest.xfail("found out while running")
"""


def test_an_xfail_not_on_the_list_fails_the_session_like_a_skip(tmp_path: Path) -> None:
    rc, out = _pytest(tmp_path, XFAILS_FOR_A_KNOWN_BUG, "--strict-skips")
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert "test_case.py::test_known_bug: xfail: known bug" in out, out
    assert "test_case.py::test_known_at_run_time: xfail: found out while running" in out, out
    assert "1 passed, 2 xfailed" in out, out


def test_without_the_option_an_xfail_is_only_reported(tmp_path: Path) -> None:
    rc, out = _pytest(tmp_path, XFAILS_FOR_A_KNOWN_BUG)
    assert rc == pytest.ExitCode.OK, out
    assert "1 passed, 2 xfailed" in out, out


def test_an_allowed_xfail_passes_only_where_its_condition_holds(tmp_path: Path) -> None:
    source = 'import pytest\n\n@pytest.mark.xfail(reason="needs CUDA", strict=True)\n'
    source += "def test_cuda():\n    assert False\n\ndef test_cpu():\n    pass\n"
    rc, out = _pytest(tmp_path, source, "--strict-skips")
    expected = pytest.ExitCode.TESTS_FAILED if torch.cuda.is_available() else pytest.ExitCode.OK
    assert rc == expected, out
    assert "1 passed, 1 xfailed" in out, out


def test_a_failing_session_keeps_its_status(tmp_path: Path) -> None:
    source = SKIPS_FOR_A_MISSING_TOOL + "\ndef test_fails():\n    assert False\n"
    rc, out = _pytest(tmp_path, source, "--strict-skips")
    assert rc == pytest.ExitCode.TESTS_FAILED, out
    assert "1 failed, 1 passed, 1 skipped" in out, out


def test_every_allowed_reason_is_one_the_suite_gives() -> None:
    # The list cannot go stale: each reason is spelled by a test or helper here.
    sources = "\n".join(p.read_text() for p in TESTS.glob("*.py") if p.name != "skip_policy.py")
    assert [r for r in ALLOWED if f'"{r}"' not in sources] == []


REAL_ENGINE = """
from mooncake_helpers import requires_mooncake
from transfer.mooncake import MooncakeBackend

@requires_mooncake
def test_real_engine():
    MooncakeBackend("127.0.0.1").close()
"""


@pytest.mark.parametrize("ci", [False, True])
def test_a_missing_engine_skips_outside_ci_and_fails_in_it(tmp_path: Path, ci: bool) -> None:
    # A `mooncake` package that refuses to import stands for a host without the wheel.
    hidden = tmp_path / "hide"
    (hidden / "mooncake").mkdir(parents=True)
    (hidden / "mooncake" / "__init__.py").write_text('raise ImportError("hidden by the test")\n')
    env = {"PYTHONPATH": f"{hidden}{os.pathsep}{TESTS}", "CI": "1" if ci else ""}
    rc, out = _pytest(tmp_path, REAL_ENGINE, env=env)
    if ci:
        assert rc == pytest.ExitCode.TESTS_FAILED, out
        assert "EngineError: mooncake.engine is not importable" in out, out
        assert "1 failed" in out and "skipped" not in out, out
    else:
        assert rc == pytest.ExitCode.OK, out
        assert "mooncake.engine not importable (wheel or libibverbs1 missing)" in out, out
        assert "1 skipped" in out, out
