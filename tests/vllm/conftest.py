"""The vLLM tests' one import gate.

They run in ``.venv-vllm`` (``scripts/vllm-env.sh``); ``scripts/test.sh``
runs them there with ``KVGUARD_REQUIRE_VLLM=1``, where a vLLM that does not
import fails the run. In an environment without vLLM (``.venv``) this
folder's test modules are not collected -- each imports the connector,
which imports vLLM -- and the run's header says so.
"""

from __future__ import annotations

import importlib.util
import os

REQUIRED = os.environ.get("KVGUARD_REQUIRE_VLLM") == "1"
if REQUIRED:
    import vllm  # noqa: F401  -- a missing or broken vLLM is an error, not a skip

# This folder is on sys.path too, as a namespace package "vllm" that only
# the real one (a regular package) outranks: a spec without an origin is it.
_spec = importlib.util.find_spec("vllm")
HAVE_VLLM = REQUIRED or (_spec is not None and _spec.origin is not None)
collect_ignore_glob = [] if HAVE_VLLM else ["test_*.py"]


def pytest_report_header() -> str | None:
    return None if HAVE_VLLM else "tests/vllm: not collected, no vLLM here (scripts/vllm-env.sh)"
