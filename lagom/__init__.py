"""Lagom: tune communication so it hides under computation without slowing it.

``lagom.init(plan)`` is the one-call entry for plain torch.distributed scripts; it is loaded on first
use so that planning (``lagom tune``) does not pay for importing torch.distributed.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["init", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "init":
        from lagom.runtime import init

        return init
    raise AttributeError(f"module 'lagom' has no attribute {name!r}")
