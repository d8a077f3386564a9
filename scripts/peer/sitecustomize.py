"""Runs at start-up of every Python process with ``scripts/peer`` on PYTHONPATH (peer test runs only).

With ``LAGOM_PEER_INJECT=deepspeed`` in the environment (set by the ``lagom_deepspeed_inject``
pytest plugin), Lagom is injected into deepspeed right after deepspeed is imported, so ranks
started by DeepSpeed's test harness (forkserver or spawn) run with Lagom like the pytest process.
Without the variable it does nothing. Importing deepspeed only when the process imports it keeps
helper processes (the forkserver, the resource tracker) as light as before.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from typing import Any


class _InjectAfterImport(importlib.abc.MetaPathFinder):
    """Finds ``deepspeed`` the usual way and runs ``inject`` once its module has executed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "deepspeed":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_inject(module: Any) -> None:
            exec_module(module)
            from lagom_deepspeed_inject import inject

            inject()

        spec.loader.exec_module = exec_then_inject  # type: ignore[method-assign]
        return spec


if os.environ.get("LAGOM_PEER_INJECT") == "deepspeed" and "deepspeed" not in sys.modules:
    sys.meta_path.insert(0, _InjectAfterImport())
