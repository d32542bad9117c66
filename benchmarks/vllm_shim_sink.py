"""The machinery of ``benchmarks.vllm_shim``: record files of a server process, patches on import.

``Sink`` writes one process's records into the benchmark's directory, named
after the server and the process id: transfer events (``events-*``) and
finished requests (``requests-*``) as JSON lines, the connector's hook
times (``hooks-*``) as a snapshot every 0.5 s. ``AfterImport`` runs a patch
right after its module is first executed, so a patch reaches every process
that imports the module, whenever it does.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Final

__all__ = ["AfterImport", "Sink"]

_SNAPSHOT_S: Final = 0.5


class Sink:
    """This process's record files; every thread may write."""

    def __init__(self, out: Path, server: str) -> None:
        self.out, self.server, self.pid = out, server, os.getpid()
        self._lock = threading.Lock()
        self._events: Any = None
        self._requests: Any = None
        self.hooks: dict[str, list[float]] = {}  # hook -> [calls, seconds]
        self._dirty = False
        self._writer: threading.Thread | None = None

    def _open(self, kind: str) -> Any:
        return open(self.out / f"{kind}-{self.server}-{self.pid}.jsonl", "a", buffering=1)

    def event(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"t": time.time(), "kind": kind, **fields})
        with self._lock:
            if self._events is None:
                self._events = self._open("events")
            self._events.write(line + "\n")

    def request(self, record: dict[str, Any]) -> None:
        with self._lock:
            if self._requests is None:
                self._requests = self._open("requests")
            self._requests.write(json.dumps(record) + "\n")

    def hook_time(self, name: str, seconds: float) -> None:
        with self._lock:
            acc = self.hooks.setdefault(name, [0, 0.0])
            acc[0] += 1
            acc[1] += seconds
            self._dirty = True
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_hooks, daemon=True)
                self._writer.start()

    def _write_hooks(self) -> None:
        """Every 0.5 s, a snapshot of the hook totals if they changed."""
        path = self.out / f"hooks-{self.server}-{self.pid}.json"
        tmp = path.with_suffix(".tmp")
        while True:
            time.sleep(_SNAPSHOT_S)
            with self._lock:
                if not self._dirty:
                    continue
                self._dirty = False
                snapshot = json.dumps({"pid": self.pid, "t": time.time(), "hooks": self.hooks})
            tmp.write_text(snapshot)
            tmp.replace(path)


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after one module is first executed."""

    def __init__(self, patches: dict[str, Callable[[ModuleType], None]]) -> None:
        self._patches = patches

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = self._patches.pop(name, None)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            try:
                patch(module)
            except Exception as exc:  # a broken patch must not break the server
                print(f"kvguard bench shim: patching {name} failed: {exc!r}", file=sys.stderr)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
