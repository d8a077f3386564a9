"""Launcher for unpatched installs: ``python -m lagom_megatron.run pretrain_gpt.py <megatron args> --lagom ...``.

Installs the same hooks the patch adds (the flags on Megatron's parser, Lagom's setup after parsing),
then runs the training script as ``__main__``, exactly as ``python pretrain_gpt.py ...`` would.
Works under torchrun: ``torchrun ... -m lagom_megatron.run pretrain_gpt.py ...``. The hooks go in after
the script's folder is first on ``sys.path``: a Megatron-LM checkout's own megatron/ wins over a wheel's.
"""

from __future__ import annotations

import sys

from lagom.runtime.apply.launch import run_script

USAGE = "usage: python -m lagom_megatron.run SCRIPT.py [megatron args] --lagom [--lagom-* ...]"


def _install() -> None:
    from lagom_megatron.hooks import install_launcher_hooks

    install_launcher_hooks()


def main(argv: list[str] | None = None) -> int:
    return run_script(sys.argv[1:] if argv is None else argv, USAGE, _install)


if __name__ == "__main__":
    sys.exit(main())
