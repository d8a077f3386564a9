"""Launcher for scripts that call ``deepspeed.initialize`` themselves, or through Hugging Face's Trainer and
Accelerate: ``python -m lagom_deepspeed.run train.py <args>``.

Patches ``deepspeed.initialize`` (``lagom_deepspeed.patch``) before the script runs, so a ``"lagom"`` section in
its DeepSpeed config is read wherever the engine is built; then runs the script as ``__main__``, exactly as
``python train.py ...`` would. Under the launchers people use:

    torchrun --nproc-per-node 8 -m lagom_deepspeed.run train.py ...
    deepspeed --module lagom_deepspeed.run train.py ...          (DeepSpeed's launcher: --module runs python -m)
    accelerate launch -m lagom_deepspeed.run train.py ...
"""

from __future__ import annotations

import sys

from lagom.runtime.apply.launch import run_script

USAGE = "usage: python -m lagom_deepspeed.run SCRIPT.py [script args]  (a \"lagom\" section in its DeepSpeed config)"


def _install() -> None:
    import lagom_deepspeed

    lagom_deepspeed.patch()


def main(argv: list[str] | None = None) -> int:
    return run_script(sys.argv[1:] if argv is None else argv, USAGE, _install)


if __name__ == "__main__":
    sys.exit(main())
