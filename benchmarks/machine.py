"""What every benchmark records of the machine it ran on, next to its figures."""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from importlib import metadata
from typing import Any

__all__ = ["describe_machine"]


def describe_machine(dists: Mapping[str, str]) -> dict[str, Any]:
    """The platform, CPUs, Python and load, and under each key of ``dists``
    the installed version of its distribution (``"absent"`` if none)."""

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "absent"

    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        **{key: version(dist) for key, dist in dists.items()},
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
