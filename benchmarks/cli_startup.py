"""How long `lagom` takes to start: wall-clock and CPU seconds (medians over fresh processes).

    python benchmarks/cli_startup.py [--runs 7]

1. ``lagom --help``: the parser alone (no plugged subcommand may import torch or matplotlib for it).
2. ``lagom compare`` start-up: a fresh process imports the CLI, parses ``compare <w> --json``, loads
   the workload and hardware and imports what compare runs (tune, search, simulator, report), and
   stops there; the search itself is the planner's work, not start-up.
3. ``lagom compare <w> --json`` on a two-layer workload, whole: start-up plus a small search.
"""

from __future__ import annotations

import argparse
import os
import resource
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


def medians(command: list[str], runs: int) -> tuple[float, float]:
    """Median wall time and median CPU time (user + system) of ``command`` in fresh processes; on a
    shared host the CPU time moves less with the load than the wall time does."""
    walls, cpus = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        walls.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7, help="fresh processes per measurement")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workload = Path(tmp) / "tiny.yaml"
        workload.write_text(yaml.safe_dump(TINY))
        rows = {
            "lagom --help": medians([*_lagom(), "--help"], args.runs),
            "lagom compare start-up (parse + load)": medians(
                [sys.executable, "-c", COMPARE_STARTUP, str(workload), HARDWARE], args.runs),
            "lagom compare tiny --json (whole run)": medians(
                [*_lagom(), "compare", str(workload), "--hardware", HARDWARE, "--json"], args.runs),
        }
    load = os.getloadavg()[0]
    print(f"medians over {args.runs} fresh processes (python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
          f"load average {load:.1f})")
    print(f"  {'':40s} {'wall':>8s} {'cpu':>8s}")
    for label, (wall, cpu) in rows.items():
        print(f"  {label:40s} {wall:7.3f}s {cpu:7.3f}s")


if __name__ == "__main__":
    main()
