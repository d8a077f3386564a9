"""What one getCollInfo call costs with the live table in force, in nanoseconds (C, -O2, no sanitizer).

    python benchmarks/tuner_percall.py [--calls 2000000]

Builds the plugin and tests/nccl_tuner_live_stress.c into a temporary folder and runs the driver: one
thread with no reloads (the hot path: one counted atomic load and the rule lookup), then four threads
while the main thread switches tables as fast as it can (the worst case of a switch under way).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from lagom.nccl_tuner import build

ROOT = Path(__file__).resolve().parent.parent
TABLES = {"a": "lagom-nccl-tuner 1\nworld 4\nallreduce 1 4294967296 4 1 ring simple 2 524288\n",
          "b": "lagom-nccl-tuner 1\nworld 4\nallreduce 1 4294967296 4 1 tree ll 7 65536\n"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        plugin = build.compile_plugin(out / "plugin.so")
        driver = build.compile_driver(ROOT / "tests" / "nccl_tuner_live_stress.c", out / "driver", [build.SOURCE_DIR],
                                      ["-O2"])
        for name, text in TABLES.items():
            (out / f"{name}.lagom").write_text(text)
            (out / f"{name}.lagom").chmod(0o600)
        for threads, reloads in ((1, 0), (4, 10_000)):
            done = subprocess.run([str(driver), str(plugin), str(out / "a.lagom"), str(out / "b.lagom"), str(threads),
                                   str(args.calls), str(reloads)], capture_output=True, text=True, check=True)
            fields = dict(zip(done.stdout.split()[::2], done.stdout.split()[1::2]))
            print(f"{threads} thread(s), {reloads} table switches: {fields['ns_per_call']} ns per getCollInfo "
                  f"({fields['calls']} calls, {fields['mixed']} saw a mix)")


if __name__ == "__main__":
    main()
