"""`python -m lagom_megatron.run SCRIPT.py` hooks the megatron/training beside the script (a Megatron-LM
checkout's), not the installed wheel's, when it is started from outside the checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A checkout's megatron/training/arguments.py, reduced to the two functions the launcher wraps.
CHECKOUT_ARGUMENTS = textwrap.dedent('''
    import argparse

    FROM_CHECKOUT = True


    def add_megatron_arguments(parser):
        parser.add_argument("--num-layers", type=int)
        return parser


    def parse_and_validate_args():
        return add_megatron_arguments(argparse.ArgumentParser()).parse_args()
''')

SCRIPT = textwrap.dedent('''
    import json
    from megatron.training import arguments

    args = arguments.parse_and_validate_args()
    print(json.dumps({"file": arguments.__file__, "from_checkout": getattr(arguments, "FROM_CHECKOUT", False),
                      "hooked": hasattr(arguments.add_megatron_arguments, "__lagom_original__"),
                      "num_layers": args.num_layers, "lagom": args.lagom}))
''')


def test_launcher_hooks_the_checkout_beside_the_script(tmp_path: Path) -> None:
    checkout = tmp_path / "Megatron-LM"
    training = checkout / "megatron" / "training"
    training.mkdir(parents=True)
    (training / "__init__.py").write_text("")
    (training / "arguments.py").write_text(CHECKOUT_ARGUMENTS)
    (checkout / "pretrain_probe.py").write_text(SCRIPT)
    elsewhere = tmp_path / "run"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    run = subprocess.run([sys.executable, "-m", "lagom_megatron.run", str(checkout / "pretrain_probe.py"),
                          "--num-layers", "3"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(seen["file"]).resolve() == (training / "arguments.py").resolve()
    assert seen["from_checkout"] and seen["hooked"]  # the checkout's module is the one the launcher wrapped
    assert (seen["num_layers"], seen["lagom"]) == (3, False)  # its parser got the lagom flags
