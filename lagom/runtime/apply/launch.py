"""Run a training script as ``__main__`` after a framework adapter has put its hooks in: the launchers
``python -m lagom_megatron.run`` and ``python -m lagom_deepspeed.run`` (also under torchrun, the deepspeed
launcher's ``--module`` and ``accelerate launch -m``) share it.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Callable
from pathlib import Path

from lagom.errors import LagomError


def run_script(argv: list[str], usage: str, install: Callable[[], None]) -> int:
    """``argv``: the script and its arguments. The script's folder goes first on ``sys.path`` (as with ``python
    SCRIPT.py``; a checkout's own packages beside it win over installed ones), ``install`` runs, then the script."""
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    script = Path(argv[0])
    if not script.is_file():
        print(f"lagom: error: SCRIPT: {script} is not a file\n{usage}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(script.resolve().parent))
    sys.argv = [str(script), *argv[1:]]
    install()
    try:
        runpy.run_path(str(script), run_name="__main__")
    except LagomError as err:
        print(f"lagom: error: {err}", file=sys.stderr)
        return 2
    return 0
