"""Launcher for unpatched installs: ``python -m lagom_megatron.run pretrain_gpt.py <megatron args> --lagom ...``.

Installs the same hooks the patch adds (the flags on Megatron's parser, Lagom's setup after parsing),
then runs the training script as ``__main__``, exactly as ``python pretrain_gpt.py ...`` would.
Works under torchrun: ``torchrun ... -m lagom_megatron.run pretrain_gpt.py ...``.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from lagom.errors import LagomError

USAGE = "usage: python -m lagom_megatron.run SCRIPT.py [megatron args] --lagom [--lagom-* ...]"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    script = Path(argv[0])
    if not script.is_file():
        print(f"lagom: error: SCRIPT: {script} is not a file\n{USAGE}", file=sys.stderr)
        return 2
    # The script's directory first, as `python SCRIPT.py` has it, and before the hooks import
    # megatron.training: a Megatron-LM checkout's own megatron/ must win over an installed wheel's.
    sys.path.insert(0, str(script.resolve().parent))
    sys.argv = [str(script), *argv[1:]]
    from lagom_megatron.hooks import install_launcher_hooks

    install_launcher_hooks()
    try:
        runpy.run_path(str(script), run_name="__main__")
    except LagomError as err:
        print(f"lagom: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
