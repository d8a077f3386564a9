"""Which share of the collectives a stock model issues under DeepSpeed are keys of Lagom's plan: the model's own
keys, and the plan's after reconciliation with the measured steps (``lagom.model.reconcile``).

    .venv/bin/python benchmarks/key_coverage.py

GPT-2 and Llama (grouped KV heads) built from their configs, ZeRO-1/2/3 with overlap_comm on and off, on 2 gloo
ranks in online mode (the cases of tests/test_coverage_hf.py). Prints rank 0's coverage of calls and bytes per
step, before and after, and what stayed unplanned.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.distributed import run_ranks  # noqa: E402
from tests.test_coverage_hf import every_case  # noqa: E402
from tests.test_long_lived import HW  # noqa: E402


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "hw.yaml").write_text(HW)
        out = run_ranks(every_case, 2, tmp)[0]
    print(f"{'case':<20} {'model: calls':>12} {'bytes':>7} {'reconciled: calls':>18} {'bytes':>7}  unplanned; "
          "keys made from calls the model lacked")
    for case, row in out.items():
        c = row["coverage"]
        before, after = c["before"], c["after"]
        print(f"{case:<20} {before['calls']:>12.1%} {before['bytes']:>7.1%} {after['calls']:>18.1%} "
              f"{after['bytes']:>7.1%}  {', '.join(c['unplanned']) or '-'}; {', '.join(c['added']) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
