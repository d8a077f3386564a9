"""How long `lagom` takes to start, in wall-clock seconds (medians over fresh processes).

    python benchmarks/cli_startup.py [--runs 7]

1. ``lagom --help``: the parser alone (no plugged subcommand may import torch or matplotlib for it).
2. ``lagom compare`` start-up: a fresh process imports the CLI, parses ``compare <w> --json``, loads
   the workload and hardware and imports what compare runs (tune, search, simulator, report), and
   stops there; the search itself is the planner's work, not start-up.
3. ``lagom compare <w> --json`` on a two-layer workload, whole: start-up plus a small search.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HARDWARE = "a100-8x-100g"
TINY = {
    "name": "tiny-gpt",
    "model": {"architecture": "gpt", "layers": 2, "hidden": 256, "ffn": 1024, "heads": 8, "seq_len": 512, "vocab": 1024},
    "training": {"micro_batch": 2, "global_batch": 16, "dtype": "bf16"},
    "parallel": {"tp": 2, "sequence_parallel": True, "dp": 4},
    "framework": {"name": "megatron"},
}
COMPARE_STARTUP = """
import sys
from lagom.cli import _load, build_parser
args = build_parser().parse_args(["compare", sys.argv[1], "--hardware", sys.argv[2], "--json"])
_load(args)
import lagom.report, lagom.tune
"""


def _lagom() -> list[str]:
    """The installed console script when there is one (what users run), else the module."""
    script = shutil.which("lagom", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "lagom.cli"]


def median_wall(command: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7, help="fresh processes per measurement")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workload = Path(tmp) / "tiny.yaml"
        workload.write_text(yaml.safe_dump(TINY))
        rows = {
            "lagom --help": median_wall([*_lagom(), "--help"], args.runs),
            "lagom compare start-up (parse + load)": median_wall(
                [sys.executable, "-c", COMPARE_STARTUP, str(workload), HARDWARE], args.runs),
            "lagom compare tiny --json (whole run)": median_wall(
                [*_lagom(), "compare", str(workload), "--hardware", HARDWARE, "--json"], args.runs),
        }
    print(f"median wall time over {args.runs} fresh processes (python {sys.version.split()[0]})")
    for label, seconds in rows.items():
        print(f"  {label:40s} {seconds:6.3f} s")


if __name__ == "__main__":
    main()
